"""Expected failures, through the real CLI: one or two lines saying what is wrong and what to do,
a non-zero exit, and never a traceback.

Each case runs ``python -m rlpulse.cli`` in a subprocess, as a user would, against a fresh chDB
store in ``tmp_path``, a closed port standing in for a broker or a ClickHouse server that is not
running, or (Ctrl-C) the shared broker under a fresh topic prefix.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlpulse.base.settings import Settings
from rlpulse.sinks.store.clickhouse import migrate, open_store

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[3]
T0 = (time.time_ns() // 1_000_000_000 - 3600) * 1_000_000_000  # an hour ago: inside the tables' TTL


def _closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(store: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPULSE_")}
    return {**env, "RLPULSE_CLICKHOUSE_URL": store, "RLPULSE_HOME": str(Path(store.removeprefix("chdb://")).parent),
            "PYTHONPATH": str(REPO), **extra}


def rlpulse(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rlpulse.cli", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def failed(run: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """stderr of a run that failed as a user should see it: exit ``code``, one or two lines, no traceback."""
    assert "Traceback" not in run.stderr + run.stdout, run.stderr
    assert run.returncode == code, (run.returncode, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 2, run.stderr
    return run.stderr


@pytest.fixture
def empty(tmp_path: Path) -> str:
    return f"chdb://{tmp_path / 'ch'}"


@pytest.fixture
def seeded(tmp_path: Path) -> str:
    """A migrated store with one step of run r1 in project p."""
    url = f"chdb://{tmp_path / 'ch'}"
    with open_store(url, owner="test") as store:
        migrate(store)
        store.client.insert("rlpulse.steps", [["p", "r1", 1, T0, "STEP", "rl", 0]],
                            column_names=["project", "run_id", "attempt", "time_ns", "type", "trainer", "step"])
    return url


NO_DATA = "has no data yet ({why}). Run `rlpulse demo`, or the pipeline (`rlpulse streams`, `rlpulse sink`)"


@pytest.mark.parametrize("args, code, phrases", [
    (["report"], 1, [NO_DATA.format(why="no database rlpulse")]),
    (["report", "r1", "--html", "out.html"], 1, [NO_DATA.format(why="no database rlpulse")]),
    (["query", "SELECT count() FROM rlpulse.spans"], 1, [NO_DATA.format(why="no database rlpulse")]),
    (["query", "SELEC 1"], 1, ["rlpulse query: ClickHouse refused the query: syntax error at line 1, col 7, near '1' "
                               "(SYNTAX_ERROR)"]),
    (["query", "SELECT nope()"], 1, ["rlpulse query: ClickHouse refused the query: Function with name `nope` does not "
                                     "exist", "(UNKNOWN_FUNCTION)\n"]),
    (["query", "--saved", "nope"], 2, ["rlpulse query: no saved query 'nope'; available: ", "failures-by-cause"]),
    (["query", "--saved", "clipped-ratio-trend", "--param", "run_id=r1", "--param", "attempt=x"], 1,
     ["rlpulse query: ClickHouse refused the query: --param attempt=x is not a valid UInt32; give a UInt32, "
      "e.g. --param attempt=1"]),
    (["query", "--saved", "failures-by-cause", "--param", "since=yesterday", "--param", "until=2030-01-01"], 1,
     ["--param since=yesterday is not a valid DateTime64(3, 'UTC')", "e.g. --param since='2026-01-31 12:00:00'"]),
    (["query", "--saved", "clipped-ratio-trend", "--param", "run_id=r1"], 2,
     ["rlpulse query: saved query clipped-ratio-trend needs --param for: attempt (UInt32)"]),
    (["query", "SELECT {n:UInt32} + 1"], 2, ["rlpulse query: the query needs --param NAME=VALUE for: n (UInt32)"]),
    (["query", "SELECT 1", "--param", "oops"], 2, ["rlpulse query: --param 'oops': expected name=value"]),
])
def test_empty_store_and_bad_queries(empty: str, args: list[str], code: int, phrases: list[str]) -> None:
    err = failed(rlpulse(_env(empty), *args), code)
    for phrase in phrases:
        assert phrase in err


@pytest.mark.parametrize("args, phrase", [
    (["report", "nope", "--html", "out.html"], "rlpulse report: no rows name run 'nope' in chdb://{store}. Latest runs: r1"),
    (["report", "--project", "nope"], "rlpulse report: no rows of project 'nope' in chdb://{store}. Latest projects: p"),
])
def test_report_names_what_there_is(seeded: str, tmp_path: Path, args: list[str], phrase: str) -> None:
    err = failed(rlpulse(_env(seeded), *args))
    assert phrase.format(store=tmp_path / "ch") in err
    assert not (REPO / "out.html").exists()


def test_a_migrated_store_without_rows_has_no_data_yet(empty: str) -> None:
    with open_store(empty, owner="test") as store:
        migrate(store)
    err = failed(rlpulse(_env(empty), "report"))
    assert f"rlpulse report: {empty} {NO_DATA.format(why='its tables are empty')}" in err


def test_a_held_store_names_its_holder(empty: str) -> None:
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom rlpulse.sinks.store.clickhouse import open_store\n"
                               f"s = open_store({empty!r}, owner='the test holder')\nprint('held', flush=True)\n"
                               "sys.stdin.read()"],
                              env=_env(empty), cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for command in (["migrate"], ["query", "SELECT 1"], ["report"]):
            err = failed(rlpulse(_env(empty), *command))
            assert (f"rlpulse {command[0]}: the chDB store {empty.removeprefix('chdb://')} is open in pid {holder.pid} "
                    "(the test holder); chDB allows one process per store. Stop that process") in err
    finally:
        holder.stdin.close()
        holder.wait(30)


@pytest.mark.parametrize("command", [["query", "SELECT 1"], ["report"], ["migrate"]])
def test_a_clickhouse_server_that_does_not_answer(empty: str, command: list[str]) -> None:
    port = _closed_port()
    err = failed(rlpulse(_env(empty), *command, "--clickhouse-url", f"http://u:secret@127.0.0.1:{port}/rlpulse"))
    assert (f"rlpulse {command[0]}: cannot connect to ClickHouse at http://u:***@127.0.0.1:{port}/rlpulse: "
            "connection refused (is the server running, on that host and port?). Check RLPULSE_CLICKHOUSE_URL") in err
    assert "secret" not in err


@pytest.mark.parametrize("command", [["simulate"], ["alerts", "--once"], ["dlq"], ["dlq", "replay"], ["sink"],
                                     ["streams"]])
def test_no_broker_fails_fast_in_one_line(empty: str, command: list[str]) -> None:
    port = _closed_port()
    started = time.monotonic()
    run = rlpulse(_env(empty), *command, "--bootstrap", f"127.0.0.1:{port}", timeout=60)
    assert time.monotonic() - started < 30
    err = failed(run)
    assert err.strip() == (f"rlpulse {command[0]}: no Kafka broker answers at 127.0.0.1:{port}. Start the local one "
                           "with `rlpulse services up` (or `make services-up`), or point --bootstrap / "
                           "RLPULSE_KAFKA_BOOTSTRAP at yours")


def test_status_without_a_broker_says_how_to_start_one(empty: str) -> None:
    port = _closed_port()
    run = rlpulse(_env(empty), "status", "--bootstrap", f"127.0.0.1:{port}")
    assert run.returncode == 3 and "Traceback" not in run.stderr + run.stdout, run.stderr
    assert f"127.0.0.1:{port}: no Kafka broker answers\nstart it with `rlpulse services up`" in run.stdout


def test_output_piped_to_head_exits_quietly(empty: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "rlpulse.cli", "query", "SELECT number FROM system.numbers LIMIT 1000"],
                            env=_env(empty), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line, as after `| head -0`: every write fails
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141
    assert err == ""


def test_ctrl_c_exits_130_without_a_traceback(settings: Settings, tmp_path: Path) -> None:
    env = _env(settings.clickhouse_dsn, RLPULSE_KAFKA_BOOTSTRAP=settings.kafka_bootstrap,
               RLPULSE_TOPIC_PREFIX=settings.topic_prefix)
    # SIGINT as a terminal gives it: a shell that starts jobs in the background (CI=true bash .ci/run &)
    # leaves SIGINT ignored in its children, and Python then never turns it into KeyboardInterrupt.
    proc = subprocess.Popen([sys.executable, "-m", "rlpulse.cli", "simulate", "--runs", "50", "--steps", "400"],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert "published" in proc.stdout.readline()  # it is under way
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err + out
    assert err.strip().splitlines()[-1] == "rlpulse simulate: interrupted"
