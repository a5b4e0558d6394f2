"""Reading a live pipeline's chDB store: while ``rlpulse sink`` holds it, its read endpoint answers
``rlpulse query``, ``rlpulse report`` and clickhouse-connect over ClickHouse's HTTP interface on
loopback, read-only, to the password in the store's 0600 endpoint file only; once the sink stops,
the endpoint file is gone and the CLI opens the store itself.

The pipeline runs as a user runs it (``rlpulse streams`` and ``rlpulse sink`` children), the
workload comes from the SDK, and the CLI runs in subprocesses.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path
from urllib.parse import quote, urlsplit

import clickhouse_connect
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from rlpulse.producers import TrainingTelemetry
from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.store.endpoint_file import ENDPOINT_FILE
from tests.integration.until import counts

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[4]

# run -> rollouts -> {term: outcome}, all at step 0
WORKLOAD = {
    "live-1": {"r0": {"judge": "ok", "format": "ok"}, "r1": {"judge": "timeout", "format": "ok"},
               "r2": {"judge": "timeout", "format": "unreadable"}},
    "live-2": {"s0": {"judge": "unavailable"}},
}
HOSTILE = "live-1' OR 1=1) --; DROP TABLE rlpulse.spans"


def publish(settings: Settings) -> None:
    for run, rollouts in WORKLOAD.items():
        with TrainingTelemetry(project="live", run_id=run, attempt=1, trainer="rl", settings=settings) as tel:
            for rollout_id, outcomes in rollouts.items():
                for term, outcome in outcomes.items():
                    tel.grader(step=0, rollout_id=rollout_id, term=term, outcome=outcome, duration_s=0.5,
                               score=0.9 if outcome == "ok" else None)
                tel.rollout(step=0, rollout_id=rollout_id, reward=0.5, completion_tokens=100, max_tokens=1024)
            tel.step_completed(step=0, tokens=1000, duration_s=1.0)
            assert tel.flush(30) == 0


def expected_failures() -> list[dict]:
    """failures-by-cause rows (nonzero causes) as ``rlpulse query --format json`` prints them."""
    counts: dict[tuple[str, str, str], list[int]] = {}
    graded: dict[tuple[str, str], int] = {}
    for run, rollouts in WORKLOAD.items():
        for outcomes in rollouts.values():
            for term, outcome in outcomes.items():
                graded[(run, term)] = graded.get((run, term), 0) + 1
                if outcome != "ok":
                    counts.setdefault((run, term, outcome), [0])[0] += 1
    return [{"run_id": run, "term": term, "cause": cause, "failures": n[0], "graded": graded[(run, term)]}
            for (run, term, cause), n in sorted(counts.items())]


def rlpulse(settings: Settings, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, RLPULSE_CLICKHOUSE_URL=settings.clickhouse_dsn, RLPULSE_HOME=str(settings.home),
               PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "rlpulse.cli", *args], env=env, capture_output=True, text=True,
                          timeout=60)


def query_json(settings: Settings, *args: str) -> list[dict]:
    run = rlpulse(settings, "query", *args, "--format", "json")
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""  # nothing noisy about how the store was reached
    return json.loads(run.stdout)


def non_loopback_address() -> str | None:
    """An address of this machine that is not loopback (None on a machine with no network)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # UDP: no packet is sent
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_live_store_reads_are_served_read_only_on_loopback(settings: Settings) -> None:
    if not settings.clickhouse_dsn.startswith("chdb://"):
        pytest.skip("the read endpoint serves a chDB store; a ClickHouse server answers reads itself")
    store_dir = Path(urlsplit(settings.clickhouse_dsn).path)
    since = (datetime.now(timezone.utc) - timedelta(hours=1)).strftime("%Y-%m-%d %H:%M:%S")
    until = (datetime.now(timezone.utc) + timedelta(hours=1)).strftime("%Y-%m-%d %H:%M:%S")
    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        publish(settings)
        # both runs ended (RUN_END): their windows close as their last messages are processed
        pipeline.wait_caught_up(until=counts(settings, {
            "spans": 11, "steps": 6, "SELECT sum(graded) FROM $db.grader_failures FINAL WHERE cause = 'timeout'": 7}))
        pipeline.check_alive()

        # The sink holds the store and published its endpoint: private to the user, loopback.
        endpoint = json.loads((store_dir / ENDPOINT_FILE).read_text())
        assert (store_dir / ENDPOINT_FILE).stat().st_mode & 0o777 == 0o600
        assert endpoint["pid"] == pipeline.procs["sink"].pid
        host, port = urlsplit(endpoint["url"]).hostname, urlsplit(endpoint["url"]).port
        assert host == "127.0.0.1"
        # a password of its own per sink start, for the user rlpulse, never in the sink's log
        user, password = endpoint["user"], endpoint["password"]
        assert user == "rlpulse" and len(password) >= 32
        assert password not in (settings.home / "logs" / "sink.log").read_text()
        basic = {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}

        # (a) rlpulse query, ad hoc and saved with server-side parameters: the workload's exact rows.
        assert query_json(settings, "SELECT kind, count() AS n FROM rlpulse.spans FINAL GROUP BY kind ORDER BY kind") == [
            {"kind": "GRADER", "n": 7}, {"kind": "ROLLOUT", "n": 4}]
        saved = query_json(settings, "--saved", "failures-by-cause", "--param", f"since={since}", "--param", f"until={until}")
        assert [{k: r[k] for k in ("run_id", "term", "cause", "failures", "graded")} for r in saved if r["failures"]] \
            == expected_failures()

        # (b) clickhouse-connect pointed at the port: a {run:String} parameter, and a hostile value stays one literal.
        client = clickhouse_connect.get_client(host="127.0.0.1", port=port, username=user, password=password)
        sql = "SELECT rollout_id FROM rlpulse.spans FINAL WHERE run_id = {run:String} AND kind = 'ROLLOUT' ORDER BY rollout_id"
        assert client.query(sql, parameters={"run": "live-1"}).result_rows == [("r0",), ("r1",), ("r2",)]
        assert client.query(sql, parameters={"run": HOSTILE}).result_rows == []
        assert client.query("SELECT {v:String}", parameters={"v": HOSTILE}).result_rows == [(HOSTILE,)]
        # ... and plain HTTP, as curl sends it (`curl -u rlpulse:PASSWORD`), or with ClickHouse's own headers.
        count_url = f"{endpoint['url']}/?query={quote('SELECT count() FROM rlpulse.spans FINAL')}"
        for headers in (basic, {"X-ClickHouse-User": user, "X-ClickHouse-Key": password}):
            with urllib.request.urlopen(urllib.request.Request(count_url, headers=headers)) as r:
                assert (r.status, r.read()) == (200, b"11\n")
        with urllib.request.urlopen(f"{endpoint['url']}/ping") as r:  # a health check needs no password, as ClickHouse's
            assert r.read() == b"Ok.\n"

        # (b2) no password, a wrong one, another user, or the password in the URL: AUTHENTICATION_FAILED, no hint of it.
        wrong = {"Authorization": "Basic " + base64.b64encode(f"{user}:{password[:-1]}x".encode()).decode()}
        for headers, url in (({}, count_url), (wrong, count_url),
                             ({"X-ClickHouse-User": "default", "X-ClickHouse-Key": password}, count_url),
                             ({"X-ClickHouse-User": user, "X-ClickHouse-Key": ""}, count_url),
                             ({}, f"{count_url}&user={user}&password={password}"),
                             ({"Authorization": "Basic not-base64!"}, count_url)):
            with pytest.raises(urllib.error.HTTPError) as denied:
                urllib.request.urlopen(urllib.request.Request(url, headers=headers))
            body = denied.value.read().decode()
            assert denied.value.code == 403 and denied.value.headers["X-ClickHouse-Exception-Code"] == "516", headers
            assert body.startswith("Code: 516. DB::Exception: Authentication failed") and "(AUTHENTICATION_FAILED)" in body
            assert password not in body and password[:8] not in body
        for bad in ("", password[:-1]):
            with pytest.raises(DatabaseError) as denied:
                clickhouse_connect.get_client(host="127.0.0.1", port=port, username=user, password=bad)
            assert "516" in str(denied.value) and password not in str(denied.value)

        # (c) writes, DDL, settings, KILL and files are refused with ClickHouse's READONLY error; nothing changed.
        outfile = settings.home / "written.tsv"
        for statement in ("INSERT INTO rlpulse.spans (project, run_id) VALUES ('x', 'y')",
                          "CREATE TABLE rlpulse.extra (x UInt8) ENGINE = Memory", "DROP TABLE rlpulse.spans",
                          "ALTER TABLE rlpulse.spans DELETE WHERE 1", "SET readonly = 0", "KILL QUERY WHERE 1",
                          f"SELECT 1 INTO OUTFILE '{outfile}'", "SELECT file('/etc/hostname')"):
            with pytest.raises(DatabaseError) as refused:
                client.command(statement)
            assert refused.value.code == 164, statement
            assert "read-only" in str(refused.value) or "readonly" in str(refused.value), statement
        with pytest.raises(DatabaseError) as refused:
            client.query("SELECT count() FROM rlpulse.spans", settings={"readonly": 0})
        assert refused.value.code == 164 or "readonly" in str(refused.value)
        assert not outfile.exists()
        assert client.query("SELECT count() FROM rlpulse.spans FINAL").result_rows == [(11,)]
        assert "extra" not in {r[0] for r in client.query("SHOW TABLES FROM rlpulse").result_rows}
        client.close()

        # (d) loopback only: the machine's other address does not answer on that port.
        other = non_loopback_address()
        if other is not None:
            with pytest.raises(OSError):
                socket.create_connection((other, port), timeout=3).close()

        # (e) rlpulse report while the sink runs.
        report = rlpulse(settings, "report")
        assert report.returncode == 0, report.stderr
        lines = [line.split() for line in report.stdout.splitlines()]
        assert ["spans", "11"] in lines and ["steps", "6"] in lines
        assert ["live-1", "1", "judge", "timeout", "2", "3", "0.6667"] in lines  # per term: judge failed 2 of 3

        pipeline.check_alive()  # the sink went on ingesting all along
        pipeline.stop()

    # (f) the sink has stopped: the endpoint file is gone and the CLI opens the store directly.
    assert not (store_dir / ENDPOINT_FILE).exists()
    assert query_json(settings, "SELECT count() AS n FROM rlpulse.spans FINAL") == [{"n": 11}]
