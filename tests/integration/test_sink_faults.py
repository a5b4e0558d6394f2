"""At-least-once into ClickHouse, exactly once through the saved queries: a sink killed with
SIGKILL between an insert and its offset commit, and a full replay of every offset, leave every
saved query's answer and every table's deduplicated rows unchanged; a row ClickHouse rejects is
isolated, dead-lettered with ClickHouse's reason, and the rest lands.

Containers are produced directly (codec + aiokafka) for every table the saved queries read,
and ``rlpulse sink`` runs as a child process, as a user runs it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import pytest

from rlpulse.pipeline import Pipeline, settings_env
from rlpulse.settings import Settings
from schemas.catalogue import TABLES
from schemas.topics import ensure_topics
from sinks.clickhouse import open_store
from sinks.dlq import read_dead_letters
# The sibling module by its own name: pytest puts tests/integration on sys.path (no __init__.py there).
from test_sink_avro import (CODEC, NOW, PROJECT, RUN, TOPIC_OF, counts, ident, publish, rows, run_sink,
                            samples, span, step)

pytestmark = pytest.mark.integration

SAVED = {
    "stalled-runs": [],
    "failures-by-cause": ["since=2020-01-01 00:00:00", "until=2100-01-01 00:00:00"],
    "reward-percentiles": [f"run_id={RUN}", "attempt=1"],
    "clipped-ratio-trend": [f"run_id={RUN}", "attempt=1"],
    "gpu-utilization-by-run": [f"run_id={RUN}"],
    "span-tree": [f"run_id={RUN}", "attempt=1", "rollout_id=s1-r3"],
}


def workload() -> list[tuple[str, bytes]]:
    """Several messages per table, over two run keys, so a checkpoint holds many inserts."""
    data = samples()
    messages = [(TOPIC_OF[name], CODEC.encode(name, records)) for name, records in data.items()
                if name not in ("StepStats", "RewardHistogram")]  # those come per step below
    for s in range(1, 4):  # three steps of figures, histograms and a span tree of rollout s1-r3
        messages.append(("step-stats", CODEC.encode("StepStats", [dict(data["StepStats"][0], step=s, clipped=s,
                                                                       clipped_ratio=s / 4)])))
        messages.append(("reward-histograms", CODEC.encode("RewardHistogram", [dict(
            data["RewardHistogram"][0], step=s, bucket_counts=[s, 2, 1, 0], count=s + 3)])))
        messages.append(("spans", CODEC.encode("Span", [span(10 * s + i, parent_span_id=(10 * s).to_bytes(8, "big") if i else None)
                                                        for i in range(3)])))
        messages.append(("steps", CODEC.encode("Step", [step(100 + s)])))
    for minute in range(3):
        messages.append(("grader-failures", CODEC.encode("GraderFailureWindow", [
            ident(term="judge", cause=cause, window_start_ns=NOW - (minute + 2) * 60 * 10**9,
                  window_end_ns=NOW - (minute + 1) * 60 * 10**9, failures=minute + 1, graded=10, emitted_at_ns=NOW)
            for cause in ("timeout", "unreadable")])))
        messages.append(("hardware", CODEC.encode("GpuSample", [dict(data["GpuSample"][0], time_ns=NOW + (minute + 1) * 10**9,
                                                                     gpu_utilization=0.5 + minute / 10)])))
    return messages


def saved_answers(settings: Settings) -> dict:
    answers = {}
    for name, params in SAVED.items():
        args = [a for p in params for a in ("--param", p)]
        run = subprocess.run([sys.executable, "-m", "rlpulse.cli", "query", "--saved", name, "--format", "json", *args],
                             env=settings_env(settings), capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        answers[name] = json.loads(run.stdout)
    return answers


def killed_then_restarted(settings: Settings) -> None:
    """``rlpulse sink`` dies by SIGKILL right after its first insert; a second one takes over."""
    with Pipeline(settings) as pipeline:
        pipeline.start(("sink",), extra_env={"RLPULSE_FAULT_KILL_AFTER_INSERTS": "1"})
        assert pipeline.procs["sink"].wait(120) == -signal.SIGKILL
        pipeline.procs.clear()
        pipeline.start(("sink",))
        pipeline.wait_caught_up(0)
        pipeline.stop()


def test_sigkill_between_insert_and_commit_and_a_replay_lose_and_double_nothing(settings: Settings, rewind_sink) -> None:
    ensure_topics(settings)
    messages = workload()
    publish(settings, messages[::2], key=f"{PROJECT}/{RUN}")
    publish(settings, messages[1::2], key=f"{PROJECT}/other-run")  # the other partition, most likely
    expected = {table: 0 for table in TABLES.values()}
    for _, value in messages:  # every event has its own natural key here
        decoded = CODEC.decode(value)
        expected[TABLES[decoded.name]] += len(decoded.records)

    killed_then_restarted(settings)  # from an empty store: the first insert is in, its offsets are not
    first = saved_answers(settings)
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        assert counts(store, final=True) == expected  # nothing lost, nothing doubled
    assert len(first["reward-percentiles"]) == 3 and len(first["clipped-ratio-trend"]) == 3
    assert len(first["gpu-utilization-by-run"]) == 1 and len(first["span-tree"]) == 11
    assert [row["key"] for row in first["stalled-runs"]] == [f"{RUN}/1"]
    assert {(r["cause"], r["failures"], r["graded"]) for r in first["failures-by-cause"]} >= {("timeout", 9, 40), ("unreadable", 6, 30)}

    rewind_sink()  # every offset again, and again killed after one insert
    killed_then_restarted(settings)
    assert saved_answers(settings) == first
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        assert counts(store, final=True) == expected
        for table in TABLES.values():
            store.client.command(f"OPTIMIZE TABLE {store.database}.{table} FINAL")
        assert counts(store, final=False) == expected


def test_a_row_clickhouse_rejects_is_dead_lettered_alone_and_the_rest_lands(settings: Settings) -> None:
    """A Step with attempt -1 is valid Avro but does not fit the UInt32 column: its message alone goes to the DLQ."""
    ensure_topics(settings)
    good = [("steps", CODEC.encode("Step", [step(10 * m + i) for i in range(5)])) for m in range(7)]
    bad = ("steps", CODEC.encode("Step", [step(100), dict(step(101), attempt=-1)]))
    publish(settings, good[:4] + [bad] + good[4:])
    stats = run_sink(settings)
    assert stats.dead_letters == 1 and stats.rows == {"steps": 35}
    letters = asyncio.run(read_dead_letters(settings.kafka_client_kwargs(), settings.topic("dlq")))
    assert len(letters) == 1 and letters[0]["source"].endswith("@4")
    assert "ClickHouse rejected the steps rows" in letters[0]["reason"] and "UInt32" in letters[0]["reason"]
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        got = [r["sequence_id"] for r in rows(store, "steps", "sequence_id")]
    assert got == [10 * m + i for m in range(7) for i in range(5)]
