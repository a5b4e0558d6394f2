"""One home, one address: ``rlpulse services up`` records in the home the address of the broker it
started, and a bare ``rlpulse`` (no --bootstrap, no RLPULSE_KAFKA_BOOTSTRAP) run with that home
finds that broker on whatever port it listens.

Two homes are checked:

* a home of this module's own under tmp, whose broker is started once by ``rlpulse services up``
  on a free port that is not 9092 (the only time the address is given); after that every command
  gets RLPULSE_HOME and no other RLPULSE_* variable: ``services status``, ``services up``,
  ``demo``, then ``query --saved`` (which answers with the demo's rows) and ``status``, and last
  ``services down``, which stops the broker and forgets the address;
* the checkout's own ``.rlpulse``, whose broker ``make test`` starts with ``make services-up`` on
  whatever address the run gives it (CI may give 127.0.0.1:29092): a bare ``services status``
  with no RLPULSE_* at all reports that broker (it is never stopped here).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path
from collections.abc import Iterator

import pytest

from rlpulse.base.settings import broker_address_file, recorded_bootstrap

pytestmark = [pytest.mark.integration, pytest.mark.full]  # a broker of its own, and `rlpulse demo`
REPO = Path(__file__).resolve().parents[3]
CHECKOUT_HOME = REPO / ".rlpulse"


def bare(*args: str, cwd: Path, home: Path | None = None, timeout: float = 120,
         **extra: str) -> subprocess.CompletedProcess[str]:
    """``rlpulse ARGS`` as a user types it in a fresh shell: no RLPULSE_* variables but RLPULSE_HOME
    when ``home`` is given (and ``extra``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLPULSE_", "XDG_DATA_HOME"))}
    env["PYTHONPATH"] = str(REPO)
    if home is not None:
        env["RLPULSE_HOME"] = str(home)
    env.update(extra)
    return subprocess.run([sys.executable, "-m", "rlpulse.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def _free_port_pair() -> int:
    """A port p other than 9092 with p and p + 1 free (the broker's listener and its controller's)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port in (9091, 9092) or port >= 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two free neighbouring ports for the test's broker")


class Home:
    def __init__(self, path: Path, port: int):
        self.path, self.port = path, port
        self.address = f"127.0.0.1:{port}"

    def run(self, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return bare(*args, cwd=cwd, home=self.path, timeout=timeout)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Home]:
    """A home under tmp whose broker `rlpulse services up` started on a free port (not 9092)."""
    if shutil.which("java") is None or shutil.which("mvn") is None:
        pytest.skip("the one-home tests start a broker of their own: the local Kafka broker needs java and mvn on PATH")
    h = Home(tmp_path_factory.mktemp("home") / ".rlpulse", _free_port_pair())
    cwd = h.path.parent
    up = bare("services", "up", cwd=cwd, home=h.path, timeout=300, RLPULSE_KAFKA_BOOTSTRAP=h.address)
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"broker up on {h.address}" in up.stdout
    try:
        yield h
    finally:
        h.run("services", "down", cwd=cwd, timeout=120)  # a no-op when the last test stopped it


def test_up_records_the_address_in_the_home_owner_only(home: Home) -> None:
    record = broker_address_file(home.path)
    assert record.read_text() == f"{home.address}\n"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert recorded_bootstrap(home.path) == home.address


def test_bare_services_status_and_up_find_the_broker_their_home_started(home: Home, tmp_path: Path) -> None:
    pid = int((home.path / "kafka" / "broker.pid").read_text())
    run = home.run("services", "status", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines() == [
        f"rlpulse home: {home.path} (RLPULSE_HOME overrides it)",
        f"broker address: {home.address} (recorded in {home.path / 'kafka' / 'bootstrap'} by `rlpulse services up`)",
        f"broker started by rlpulse: running (pid {pid}, log: {home.path / 'kafka' / 'broker.log'})",
        f"{home.address}: a Kafka broker answers",
    ]
    up = home.run("services", "up", cwd=tmp_path)  # agrees too: nothing to start, nothing refused
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"Kafka 3.9.1 broker already running on {home.address} (pid {pid}" in up.stdout



def test_bare_demo_then_a_bare_saved_query_answers_with_the_demos_rows(home: Home, tmp_path: Path) -> None:
    demo = home.run("demo", cwd=REPO, timeout=400)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert f"local services: Kafka at {home.address}" in demo.stdout
    assert f"report from ClickHouse (chdb://{home.path / 'clickhouse'}, database rlpulse)" in demo.stdout
    project = re.search(r"simulating 3 training runs of project (\S+)", demo.stdout).group(1)
    # the demo's own table: run_id, attempt, term, cause, failures, graded, failure_rate (per term: summed here)
    printed: dict[tuple[str, str], int] = {}
    for line in demo.stdout.splitlines():
        cells = line.split()
        if len(cells) == 7 and cells[0].startswith(f"{project}-run") and cells[3].isalpha():
            printed[(cells[0], cells[3])] = printed.get((cells[0], cells[3]), 0) + int(cells[4])
    assert len({run for run, _ in printed}) == 3, demo.stdout

    # the demo ends saying what to open next; its saved query, run as printed, answers with its rows
    assert "== open next ==" in demo.stdout, demo.stdout[-2000:]
    assert re.search(r"^  \S*rlpulse ui$", demo.stdout, re.MULTILINE), demo.stdout[-2000:]
    assert f"rlpulse watch --project {project} --metric loss --metric kl" in demo.stdout
    printed_query = re.search(r"rlpulse query --saved failures-by-cause --param since='([^']+)' --param until='([^']+)'",
                              demo.stdout)
    assert printed_query, demo.stdout[-2000:]
    query = home.run("query", "--saved", "failures-by-cause", "--param", f"since={printed_query.group(1)}",
                     "--param", f"until={printed_query.group(2)}", "--format", "json", cwd=tmp_path)
    assert query.returncode == 0, query.stderr
    answered: dict[tuple[str, str], int] = {}
    for row in json.loads(query.stdout):
        if row["project"] == project:
            answered[(row["run_id"], row["cause"])] = answered.get((row["run_id"], row["cause"]), 0) + row["failures"]
    assert answered == printed

    # `rlpulse status` (after the demo: on a broker without the topics it would ask for lag on
    # topics the broker then auto-creates with one partition) reads the same broker's groups.
    lag = home.run("status", cwd=tmp_path)
    assert lag.returncode == 0, lag.stdout + lag.stderr
    assert f"{home.address}: a Kafka broker answers" in lag.stdout
    # one line per group, caught up after the demo (its partitions come with --detail)
    assert re.search(r"^consumer group rlpulse-streams: lag 0, \d+ partitions? \(3 topics\), \d+ members?$", lag.stdout,
                     re.MULTILINE), lag.stdout
    assert re.search(r"^consumer group rlpulse-sink: lag 0, \d+ partitions? \(10 topics\), \d+ members?$", lag.stdout,
                     re.MULTILINE), lag.stdout
    assert not re.search(r"^  \S+\[\d+\]", lag.stdout, re.MULTILINE), lag.stdout


def test_bare_down_stops_that_broker_and_forgets_its_address(home: Home, tmp_path: Path) -> None:
    """The last test of the module's home: it stops that home's broker."""
    pid = int((home.path / "kafka" / "broker.pid").read_text())
    down = home.run("services", "down", cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"Kafka broker (pid {pid}) stopped" in down.stdout
    assert not broker_address_file(home.path).exists()
    after = home.run("services", "status", cwd=tmp_path)
    assert after.returncode == 3, after.stdout + after.stderr
    assert after.stdout.splitlines()[1] == ("broker address: 127.0.0.1:9092 (no broker recorded in this home: "
                                            "--bootstrap, the environment, else the default)")


def test_bare_status_in_the_checkout_sees_the_broker_make_started(tmp_path: Path) -> None:
    if not (CHECKOUT_HOME / "kafka" / "broker.pid").exists():
        pytest.skip(f"no broker started from {CHECKOUT_HOME} (make test starts one with make services-up)")
    address = recorded_bootstrap(CHECKOUT_HOME)
    assert address is not None, f"`rlpulse services up` recorded no address in {CHECKOUT_HOME}"
    run = bare("services", "status", cwd=tmp_path)  # no RLPULSE_* at all, from another folder
    assert run.returncode == 0, run.stdout + run.stderr
    pid = int((CHECKOUT_HOME / "kafka" / "broker.pid").read_text())
    assert run.stdout.splitlines()[:4] == [
        f"rlpulse home: {CHECKOUT_HOME} (RLPULSE_HOME overrides it)",
        f"broker address: {address} (recorded in {CHECKOUT_HOME / 'kafka' / 'bootstrap'} by `rlpulse services up`)",
        f"broker started by rlpulse: running (pid {pid}, log: {CHECKOUT_HOME / 'kafka' / 'broker.log'})",
        f"{address}: a Kafka broker answers",
    ]
