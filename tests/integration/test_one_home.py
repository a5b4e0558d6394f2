"""One home: a bare ``rlpulse`` (no RLPULSE_* in the environment, run from another folder) uses the
checkout's ``.rlpulse``, as every ``make`` target does.

``make test`` starts the shared broker with ``make services-up``; the first test checks a bare
``rlpulse services status`` reports it as started by rlpulse (it never stops it). The second is
the issue's acceptance: ``rlpulse demo`` and then a bare ``rlpulse query --saved failures-by-cause``
answer with the same rows. The demo writes into the checkout's store, as ``make demo`` does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
HOME = REPO / ".rlpulse"


def bare(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``rlpulse ARGS`` as a user types it in a fresh shell: no RLPULSE_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLPULSE_", "XDG_DATA_HOME"))}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "rlpulse.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def test_bare_status_sees_the_broker_make_started(tmp_path: Path) -> None:
    if not (HOME / "kafka" / "broker.pid").exists():
        pytest.skip(f"no broker started from {HOME} (make test starts one with make services-up)")
    run = bare("services", "status", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == f"rlpulse home: {HOME} (RLPULSE_HOME overrides it)"
    pid = int((HOME / "kafka" / "broker.pid").read_text())
    assert lines[1] == f"broker started by rlpulse: running (pid {pid}, log: {HOME / 'kafka' / 'broker.log'})"
    assert lines[2] == "127.0.0.1:9092: a Kafka broker answers"
    up = bare("services", "up", cwd=tmp_path)  # agrees too: nothing to start, nothing refused
    assert up.returncode == 0 and f"already running on 127.0.0.1:9092 (pid {pid}" in up.stdout, up.stdout + up.stderr


def test_demo_then_a_bare_saved_query_answers_with_the_demos_rows(tmp_path: Path) -> None:
    if not (HOME / "kafka" / "broker.pid").exists():
        pytest.skip(f"no broker started from {HOME} (make test starts one with make services-up)")
    demo = bare("demo", cwd=REPO, timeout=400)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert f"report from ClickHouse (chdb://{HOME / 'clickhouse'}, database rlpulse)" in demo.stdout
    project = re.search(r"simulating 3 training runs of project (\S+)", demo.stdout).group(1)
    # the demo's own table: run_id, attempt, cause, failures, graded, failure_rate
    printed: dict[tuple[str, str], int] = {}
    for line in demo.stdout.splitlines():
        cells = line.split()
        if len(cells) == 6 and cells[0].startswith(f"{project}-run") and cells[2].isalpha():
            printed[(cells[0], cells[2])] = int(cells[3])
    assert len({run for run, _ in printed}) == 3, demo.stdout

    query = bare("query", "--saved", "failures-by-cause", "--param", "since=2000-01-01 00:00:00",
                 "--param", "until=2100-01-01 00:00:00", "--format", "json", cwd=tmp_path)
    assert query.returncode == 0, query.stderr
    answered: dict[tuple[str, str], int] = {}
    for row in json.loads(query.stdout):
        if row["project"] == project:
            answered[(row["run_id"], row["cause"])] = answered.get((row["run_id"], row["cause"]), 0) + row["failures"]
    assert answered == printed
