"""Secrets nowhere: with a Kafka SASL password, a TLS key password, a ClickHouse password and a
webhook token set, the pipeline runs a stalling workload whose alert is posted to a webhook that
fails once; then every command a user runs (status, query, report, watch, dlq, alerts, every
``--help``, and the commands that fail on a ClickHouse URL with a password) prints none of them, no
process rlpulse starts has one in its command line, and no file under the home holds one.

The local broker is PLAINTEXT: it ignores the SASL and TLS key passwords, which the settings still
carry everywhere (the children's environment, the SDK), so a leak would show.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from rlpulse.producers.simulators.simulator import SimConfig, simulate
from rlpulse.cli import build_parser
from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.store.endpoint_file import ENDPOINT_FILE
from tests.integration import until
from tests.integration.sinks.alerts.test_alert_feed import Receiver

pytestmark = [pytest.mark.integration, pytest.mark.full]  # security: make test-all
REPO = Path(__file__).resolve().parents[3]

KAFKA_PASSWORD = "kafka-PW-Zq81xsec"
KEY_PASSWORD = "tlskey-PW-77abcsec"
CH_PASSWORD = "S3cr3t-CH-91xz"
HOOK_TOKEN = "T0KEN-SECRET-4f2a9"
HOOK_PASSWORD = "H00kPass-SECRET-e3"
HOOK_SIG = "Q-SECRET-SIG-51"
SECRETS = (KAFKA_PASSWORD, KEY_PASSWORD, CH_PASSWORD, HOOK_TOKEN, HOOK_PASSWORD, HOOK_SIG)


def _children(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += parents.get(p, [])
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _leaks(text: str, secrets: tuple[str, ...] = SECRETS) -> list[str]:
    return [s for s in secrets if s in text]


class Cli:
    """``rlpulse`` commands as a user runs them, every output kept for the final grep."""

    def __init__(self, settings: Settings):
        self.env = {**settings_env(settings), "PYTHONPATH": str(REPO)}
        self.outputs: list[tuple[str, str]] = []  # (command, stdout + stderr)

    def __call__(self, *args: str, env: dict[str, str] | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
        run = subprocess.run([sys.executable, "-m", "rlpulse.cli", *args], env={**self.env, **(env or {})},
                             capture_output=True, text=True, timeout=timeout)
        self.outputs.append((" ".join(args)[:200], run.stdout + run.stderr))
        return run


def test_no_secret_in_any_log_output_command_line_or_file(settings: Settings, monkeypatch, caplog) -> None:
    if not settings.clickhouse_dsn.startswith("chdb://"):
        pytest.skip("the local backend's chDB store (the containers backend's server URL has a password of its own)")
    settings = dataclasses.replace(settings, kafka_sasl_password=KAFKA_PASSWORD, kafka_ssl_key_password=KEY_PASSWORD,
                                   kafka_sasl_username="rlpulse-user", stall_after=3.0, silent_after=60.0,
                                   heartbeat_interval=1.0)
    store_dir = Path(urlsplit(settings.clickhouse_dsn).path)
    cli = Cli(settings)
    receiver = Receiver(fail_first=1)  # the webhook answers 503 once, then 200
    hook = f"http://hookuser:{HOOK_PASSWORD}@127.0.0.1:{receiver.server.server_port}/hooks/{HOOK_TOKEN}?sig={HOOK_SIG}"
    ensure_topics(settings)
    caplog.set_level(logging.DEBUG)  # the SDK and the simulator run in this process: all their log lines
    try:
        with Pipeline(settings) as pipeline:
            pipeline.start()
            wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)

            # The children got the secrets through the environment (owner-only), not the command line.
            for name, proc in pipeline.procs.items():
                environ = Path(f"/proc/{proc.pid}/environ").read_bytes().decode(errors="replace")
                assert KAFKA_PASSWORD in environ and KEY_PASSWORD in environ, name
                for pid in _children(proc.pid):
                    assert _leaks(_cmdline(pid)) == [], (name, pid, _cmdline(pid))

            progress: list[str] = []
            truth = simulate(settings, SimConfig(project="sec", runs=2, steps=2, rollouts_per_step=4, stall_s=5.0, seed=3),
                             progress=progress.append)
            pipeline.wait_caught_up(until=until.counts(settings, {  # the stalled run's episode, as queried below
                "spans": truth.spans, "SELECT count() FROM $db.alerts FINAL WHERE rule = 'stalled_run'": 2}))
            pipeline.check_alive()
            endpoint = json.loads((store_dir / ENDPOINT_FILE).read_text())
            assert _leaks(json.dumps(endpoint)) == []  # the endpoint file: its own password only

            # Commands while the sink runs (reads go through its endpoint).
            # (status in the home of the broker that runs, so it goes on to the consumer lag)
            status = cli("status", env={"RLPULSE_HOME": str(Settings.load({}).home)})
            assert status.returncode == 0 and f"consumer group {settings.sink_group}: lag" in status.stdout, status.stdout
            spans = cli("query", "SELECT count() AS n FROM rlpulse.spans FINAL", "--format", "json", "-v")
            assert spans.returncode == 0 and json.loads(spans.stdout)[0]["n"] > 0, spans.stderr
            fired = cli("query", "SELECT rule, state FROM rlpulse.alerts FINAL WHERE rule = 'stalled_run' ORDER BY state",
                        "--format", "csv")
            assert fired.stdout.split() == ["rule,state", "stalled_run,FIRING", "stalled_run,RESOLVED"], fired.stdout
            assert cli("report").returncode == 0
            assert cli("watch", "--once", "--all").returncode == 0
            assert cli("dlq").returncode == 0

            # The alert feed posts both transitions through the failing-once webhook, given by environment...
            feed = subprocess.Popen([sys.executable, "-m", "rlpulse.cli", "alerts", "--once", "--from-beginning", "-v"],
                                    env={**cli.env, "RLPULSE_ALERTS_WEBHOOK": hook}, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            deadline = time.monotonic() + 60
            while feed.poll() is None and time.monotonic() < deadline:
                for pid in _children(feed.pid):
                    assert _leaks(_cmdline(pid)) == [], _cmdline(pid)
                time.sleep(0.2)
            out, _ = feed.communicate(timeout=60)
            cli.outputs.append(("alerts (webhook from the environment)", out))
            assert feed.returncode == 0, out
            # every alert the pipeline raised is posted once (the first attempt fails once, on purpose)
            alerts = int(cli("query", "SELECT count() FROM rlpulse.alerts FINAL", "--format", "csv").stdout.split()[-1])
            assert alerts >= 2 and receiver.requests >= alerts + 1 and len(receiver.received) == alerts, out
            assert "webhook http://127.0.0.1:" in out  # the origin only
            # ... and on the command line (the user's choice to show it to `ps`; the output still hides it).
            again = cli("alerts", "--once", "--from-beginning", "--group", f"{settings.topic_prefix}-again",
                        "--webhook", hook)
            assert again.returncode == 0, again.stderr

            # A ClickHouse server that refuses the password (the read endpoint, which wants another one),
            # and one that does not answer: one line each, the password masked.
            port = urlsplit(endpoint["url"]).port
            for url in (f"http://rlpulse:{CH_PASSWORD}@127.0.0.1:{port}/rlpulse",
                        f"http://default:{CH_PASSWORD}@127.0.0.1:1/rlpulse"):
                for args in (("query", "SELECT 1"), ("report",), ("migrate",), ("watch", "--once")):
                    failed = cli(*args, "--clickhouse-url", url)
                    assert failed.returncode == 1, (args, failed.stdout, failed.stderr)
                    assert "***" in failed.stderr or "authentication" in failed.stderr or "watch" in args[0], failed.stderr
                    failed = cli(*args, env={"RLPULSE_CLICKHOUSE_URL": url})
                    assert failed.returncode == 1, (args, failed.stderr)
            sink = cli("sink", "--clickhouse-url", f"http://default:{CH_PASSWORD}@127.0.0.1:1/rlpulse", timeout=60)
            assert sink.returncode == 1 and "default:***@127.0.0.1:1" in sink.stderr, sink.stderr
            # An error from a server that took the password (the endpoint's own, in the URL) shows no password either.
            own = f"http://rlpulse:{endpoint['password']}@127.0.0.1:{port}/rlpulse"
            bad_sql = cli("query", "SELECT no_such_column FROM rlpulse.spans", "--clickhouse-url", own)
            assert bad_sql.returncode == 1 and "no_such_column" in bad_sql.stderr, bad_sql.stderr
            assert endpoint["password"] not in bad_sql.stderr

            pipeline.stop()
    finally:
        receiver.close()

    # Every --help, with the secrets in the environment.
    for var, value in cli.env.items():
        if var.startswith("RLPULSE_"):
            monkeypatch.setenv(var, value)
    monkeypatch.setenv("RLPULSE_ALERTS_WEBHOOK", hook)
    parser = build_parser()
    commands = sorted(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert {"streams", "sink", "alerts", "query", "report", "status", "services"} <= set(commands)
    for args in ([], *([c] for c in commands)):
        text = io.StringIO()
        with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
            parser.parse_args([*args, "--help"])
        assert "usage: rlpulse" in text.getvalue()
        cli.outputs.append((f"{' '.join(args)} --help", text.getvalue()))

    # The grep: every output, every log line of this process, every file under the home.
    for command, output in cli.outputs:
        assert _leaks(output) == [], (command, output[-2000:])
        assert endpoint["password"] not in output or command.startswith("query SELECT no_such"), command
    logged = "\n".join(r.getMessage() for r in caplog.records) + "\n".join(progress)
    assert _leaks(logged) == []
    files = [p for p in settings.home.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.name == "sink.log" for p in files) and any(p.name == "streams.log" for p in files)
    leaking = {str(p): _leaks(p.read_bytes().decode(errors="replace"), SECRETS + (endpoint["password"],)) for p in files}
    assert {p: found for p, found in leaking.items() if found} == {}
