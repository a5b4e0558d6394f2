"""``rlpulse retention`` on a real store: rows past their TTL go, a project's own TTL
removes that project's rows only, what was set reads back, and a store a sink holds is refused
with the fix named while it is still shown through the sink's read endpoint.

Spans and steps of two projects, ten days old and fresh, go through the real broker and the sink
into chDB; the command runs as a user runs it (``python -m rlpulse.cli``), and each count is taken
after ``OPTIMIZE TABLE … FINAL``, so a row left only because no merge ran yet would show.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from rlpulse.cli import main as cli_main
from rlpulse.pipeline import Pipeline, settings_env
from rlpulse.schemas.codec import Codec
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.store import retention
from rlpulse.sinks.store.clickhouse import Store, open_reader, open_store
from rlpulse.sinks.write.sink import drain
from tests.integration import until

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[4]
CODEC = Codec()
DAY_NS = 86_400 * 10**9
NOW = time.time_ns()
OLD = NOW - 10 * DAY_NS
HOSTILE = "evil'; DROP TABLE rlpulse.spans; --\nproject"


def span(project: str, seq: int, end_ns: int) -> dict:
    return dict(project=project, run_id="r1", attempt=1, stage="train", time_ns=end_ns, trace_id=bytes(16),
                span_id=seq.to_bytes(8, "big"), parent_span_id=None, name="rollout", kind="ROLLOUT",
                start_time_ns=end_ns - 1000, end_time_ns=end_ns, status="OK", status_message="", rollout_id=f"r{seq}",
                attempt_id="a", sequence_id=seq, writer_id="w", step=1, attributes={}, term=None, outcome=None,
                score=None, judge_input_tokens=None, judge_output_tokens=None, reward=0.5, term_shares={},
                completion_tokens=10, max_tokens=20, clipped=False, sample_id=None)


def step_event(project: str, seq: int, time_ns: int) -> dict:
    return dict(project=project, run_id="r1", attempt=1, stage="train", time_ns=time_ns, type="STEP", trainer="rl",
                step=seq, step_count=seq, tokens=1, duration_s=1.0, throughput=1.0, mfu=None, dropped_events=0,
                writer_id="w", sequence_id=seq)


async def publish(settings: Settings) -> None:
    producer = AIOKafkaProducer(**settings.kafka_client_kwargs())
    await producer.start()
    try:
        for project in ("a", "b", HOSTILE):
            spans = [span(project, 1, OLD), span(project, 2, OLD), span(project, 3, NOW)]
            steps = [step_event(project, 1, OLD), step_event(project, 2, NOW)]
            key = f"{project}/r1".encode()
            await producer.send_and_wait(settings.topic("spans"), CODEC.encode("Span", spans), key=key)
            await producer.send_and_wait(settings.topic("steps"), CODEC.encode("Step", steps), key=key)
    finally:
        await producer.stop()


def cli(settings: Settings, *args: str) -> subprocess.CompletedProcess:
    """``rlpulse retention ARGS`` as a user runs it: a process of its own, given the settings in its environment."""
    return subprocess.run([sys.executable, "-m", "rlpulse.cli", "retention", *args], env=settings_env(settings),
                          cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.fixture
def run(settings: Settings, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """``rlpulse retention ARGS`` in this process (the same main, without a second interpreter's start-up)."""
    for name, value in settings.env().items():
        monkeypatch.setenv(name, value)

    def call(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        code = cli_main(["retention", *args])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    return call


def counts(store: Store, table: str) -> dict[str, tuple[int, int]]:
    """project -> (old rows, fresh rows), after a merge forced with OPTIMIZE … FINAL."""
    db = store.database
    store.client.command(f"OPTIMIZE TABLE {db}.{table} FINAL")
    time_column = retention.TIME_COLUMNS[table]
    rows = store.client.query(f"SELECT project, countIf({time_column} < now() - INTERVAL 1 DAY), "
                              f"countIf({time_column} >= now() - INTERVAL 1 DAY) FROM {db}.{table} GROUP BY project").result_rows
    return {p: (old, fresh) for p, old, fresh in rows}


@pytest.fixture
def stored(settings: Settings) -> Settings:
    ensure_topics(settings)
    asyncio.run(publish(settings))
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        from rlpulse.sinks.store.clickhouse import migrate

        migrate(store)
        stats, _ = asyncio.run(drain(settings, store, timeout=120))
    assert stats.rows == {"spans": 9, "steps": 6}
    return settings


def test_each_tables_time_column_is_the_one_its_ttl_counts_from(stored: Settings) -> None:
    with open_store(stored.clickhouse_dsn, owner="test") as store:
        found = {r.table: r for r in retention.read(store)}
    assert set(found) == set(retention.TIME_COLUMNS)  # every table's migrated TTL parses as ours
    assert {t: r.default_days for t, r in found.items()} == {
        t: 90 if t in retention.RAW_TABLES else 365 for t in retention.TIME_COLUMNS}


def test_a_projects_ttl_removes_its_rows_only_then_the_default_the_rest(stored: Settings, run) -> None:
    with open_store(stored.clickhouse_dsn, owner="test") as store:
        assert counts(store, "spans") == {"a": (2, 1), "b": (2, 1), HOSTILE: (2, 1)}
    done = run("set", "--table", "spans", "--days", "5", "--project", "a")
    assert done.returncode == 0, done.stderr
    assert "spans: project a kept 5 days" in done.stdout
    done = run("set", "--table", "spans", "--days", "30", "--project", HOSTILE)
    assert done.returncode == 0, done.stderr
    with open_store(stored.clickhouse_dsn, owner="test") as store:
        assert counts(store, "spans") == {"a": (0, 1), "b": (2, 1), HOSTILE: (2, 1)}
        assert counts(store, "steps") == {"a": (1, 1), "b": (1, 1), HOSTILE: (1, 1)}  # another table: untouched
    # The default now below ten days: b's old rows go, the hostile project keeps its own 30 days.
    done = run("set", "--table", "spans", "--days", "3")
    assert done.returncode == 0, done.stderr
    with open_store(stored.clickhouse_dsn, owner="test") as store:
        assert counts(store, "spans") == {"a": (0, 1), "b": (0, 1), HOSTILE: (2, 1)}
        [spans] = [r for r in retention.read(store) if r.table == "spans"]
        assert (spans.default_days, spans.projects) == (3, {"a": 5, HOSTILE: 30})
        assert store.client.query(f"EXISTS TABLE {store.database}.spans").result_rows == [(1,)]
    shown = run()
    assert shown.returncode == 0, shown.stderr
    line = next(x for x in shown.stdout.splitlines() if x.startswith("spans "))
    assert "3 days" in line and "a: 5 days" in line and "evil'; DROP TABLE rlpulse.spans; --\\nproject: 30 days" in line
    # Cleared, the hostile project follows the default again (3 days): its old rows go too.
    done = run("clear", "--table", "spans", "--project", HOSTILE)
    assert done.returncode == 0, done.stderr
    with open_store(stored.clickhouse_dsn, owner="test") as store:
        assert counts(store, "spans") == {"a": (0, 1), "b": (0, 1), HOSTILE: (0, 1)}
    done = run("clear", "--table", "spans")  # the default back to RLPULSE_TTL_RAW_DAYS
    assert done.returncode == 0, done.stderr
    with open_store(stored.clickhouse_dsn, owner="test") as store:
        [spans] = [r for r in retention.read(store) if r.table == "spans"]
    assert (spans.default_days, spans.projects) == (90, {"a": 5})


def test_a_ttl_set_by_hand_is_shown_and_left_alone(stored: Settings, run) -> None:
    with open_store(stored.clickhouse_dsn, owner="test") as store:
        store.client.command(f"ALTER TABLE {store.database}.alerts MODIFY TTL toDateTime(time) + INTERVAL 2 MONTH")
    done = run("set", "--table", "alerts", "--days", "3")
    assert done.returncode == 1 and "was not written by rlpulse retention" in done.stderr
    shown = run()
    line = next(x for x in shown.stdout.splitlines() if x.startswith("alerts "))
    assert "set by hand" in line and line.endswith("toDateTime(time) + toIntervalMonth(2)")


@pytest.mark.full  # starts a sink: make test-all, keeping make test within 6 minutes
def test_while_a_sink_holds_the_store_retention_is_shown_and_a_change_names_the_fix(stored: Settings) -> None:
    with Pipeline(stored) as pipeline:
        pipeline.start(("sink",))
        pipeline.wait_caught_up(until=until.counts(stored, {"spans": 9}))
        shown = cli(stored, "--project", "a")
        changed = cli(stored, "set", "--table", "spans", "--days", "5")
        with open_reader(stored.clickhouse_dsn, owner="test") as store:
            assert store.endpoint is not None  # read through the sink's endpoint
            [spans] = [r for r in retention.read(store) if r.table == "spans"]
        pipeline.stop()
    assert shown.returncode == 0, shown.stderr
    assert any(x.startswith("spans ") and "90 days" in x for x in shown.stdout.splitlines())
    assert changed.returncode == 1
    assert "rlpulse sink" in changed.stderr and "Stop the sink, run this again, then start the sink" in changed.stderr
    assert spans.default_days == 90  # nothing changed
