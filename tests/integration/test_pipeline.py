"""SDK -> Kafka -> Faust -> sink -> ClickHouse, through the commands a user runs.

``rlpulse streams`` and ``rlpulse sink`` run as child processes against the backend's broker
and ClickHouse; the test publishes a known set of events with the SDK and then checks the
exact rows in ClickHouse, the dead letter of a poison message, and that replaying every
offset leaves the same rows.
"""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaProducer

from rlpulse.producers import TrainingTelemetry
from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.schemas.settings import Settings
from rlpulse.schemas.topics import ensure_topics, read_topic
from rlpulse.sinks.clickhouse import open_store
from tests.integration import until

pytestmark = pytest.mark.integration

POISON = b"\x00\x01 this is not Avro"

# (run, attempt) -> steps -> rollouts -> {term: outcome}
WORKLOAD = {
    ("runA", 1): [
        {"a0": {"judge": "ok", "format": "ok"},
         "a1": {"judge": "timeout", "format": "ok"},
         "a2": {"judge": "timeout", "format": "unreadable"},
         "a3": {"judge": "unavailable", "format": "ungradable"}},
        {"a4": {"judge": "ok", "format": "ungradable"}},
    ],
    ("runB", 2): [
        {"b0": {"judge": "timeout"}},
    ],
}
CAUSES = ("timeout", "unavailable", "unreadable", "ungradable")


def expected_failures() -> dict[tuple[str, int, str, str], tuple[int, int]]:
    """(run, attempt, term, cause) -> (failures, graded), zero counts included."""
    graded: dict = {}
    failed: dict = {}
    for (run, attempt), steps in WORKLOAD.items():
        for rollouts in steps:
            for outcomes in rollouts.values():
                for term, outcome in outcomes.items():
                    graded[(run, attempt, term)] = graded.get((run, attempt, term), 0) + 1
                    if outcome != "ok":
                        failed[(run, attempt, term, outcome)] = failed.get((run, attempt, term, outcome), 0) + 1
    return {(r, a, t, c): (failed.get((r, a, t, c), 0), n) for (r, a, t), n in graded.items() for c in CAUSES}


def publish_workload(settings: Settings) -> None:
    for (run, attempt), steps in WORKLOAD.items():
        with TrainingTelemetry(project="itest", run_id=run, attempt=attempt, trainer="rl", settings=settings) as tel:
            for step, rollouts in enumerate(steps):
                for rollout_id, outcomes in rollouts.items():
                    for term, outcome in outcomes.items():
                        tel.grader(step=step, rollout_id=rollout_id, term=term, outcome=outcome, duration_s=0.5,
                                   score=0.9 if outcome == "ok" else None)
                    tel.rollout(step=step, rollout_id=rollout_id, reward=0.8, term_shares={"judge": 0.5, "format": 0.3},
                                completion_tokens=1024 if rollout_id == "a2" else 300, max_tokens=1024)
                tel.step_completed(step=step, tokens=1000, duration_s=2.0, mfu=0.4)
            assert tel.flush(30) == 0


async def _produce_raw(settings: Settings, short: str, key: bytes, value: bytes) -> None:
    producer = AIOKafkaProducer(**settings.kafka_client_kwargs())
    await producer.start()
    try:
        await producer.send_and_wait(settings.topic(short), key=key, value=value)
    finally:
        await producer.stop()


async def _read_all(settings: Settings, short: str) -> list:
    return await read_topic(settings.kafka_client_kwargs(), settings.topic(short))


def workload_in(settings: Settings):
    """The condition the pipeline tests wait for: the workload's rows and its failure windows in
    ClickHouse (every run ended with RUN_END, so its windows close as its last message is read)."""
    return until.counts(settings, {
        "spans": 17, "steps": 7, "SELECT sum(graded) FROM $db.grader_failures FINAL WHERE cause = 'timeout'": 11})


def snapshot(settings: Settings) -> dict:
    """Everything the test checks, read from ClickHouse with SQL."""
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        db, q = store.database, store.client.query
        return {
            "spans_by_kind": dict(q(f"SELECT kind, count() FROM {db}.spans FINAL GROUP BY kind").result_rows),
            "spans_raw": q(f"SELECT count() FROM {db}.spans").result_rows[0][0],
            "children_of_rollouts": q(
                f"SELECT count() FROM {db}.spans AS g FINAL INNER JOIN (SELECT span_id, run_id FROM {db}.spans FINAL "
                f"WHERE kind = 'ROLLOUT') AS r ON g.parent_span_id = r.span_id AND g.run_id = r.run_id WHERE g.kind = 'GRADER'"
            ).result_rows[0][0],
            "sequence": q(
                f"SELECT run_id, attempt, count(), uniqExact(sequence_id), min(sequence_id), max(sequence_id) "
                f"FROM {db}.spans FINAL GROUP BY run_id, attempt ORDER BY run_id"
            ).result_rows,
            "clipped": q(f"SELECT rollout_id FROM {db}.spans FINAL WHERE clipped ORDER BY rollout_id").result_rows,
            "steps": q(
                f"SELECT run_id, attempt, type, step, step_count FROM {db}.steps FINAL ORDER BY run_id, time_ns"
            ).result_rows,
            "failures": {
                (r, a, t, c): (f, g)
                for r, a, t, c, f, g in q(
                    f"SELECT run_id, attempt, term, cause, sum(failures), sum(graded) FROM {db}.grader_failures FINAL "
                    f"GROUP BY run_id, attempt, term, cause"
                ).result_rows
            },
        }


def test_sdk_to_clickhouse_exact_rows_failures_by_cause_dead_letter_and_replay(settings: Settings, rewind_sink) -> None:
    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        asyncio.run(_produce_raw(settings, "spans", b"bad", POISON))
        publish_workload(settings)
        pipeline.wait_caught_up(until=workload_in(settings))
        pipeline.stop()

    first = snapshot(settings)
    assert first["spans_by_kind"] == {"ROLLOUT": 6, "GRADER": 11}
    assert first["spans_raw"] == 17
    assert first["children_of_rollouts"] == 11  # every grader span names its rollout as parent
    # sequence ids are 1..n without gaps or repeats per (run, attempt)
    assert first["sequence"] == [("runA", 1, 15, 15, 1, 15), ("runB", 2, 2, 2, 1, 2)]
    assert first["clipped"] == [("a2",)]
    assert first["steps"] == [
        ("runA", 1, "RUN_START", -1, 0), ("runA", 1, "STEP", 0, 1), ("runA", 1, "STEP", 1, 2), ("runA", 1, "RUN_END", -1, 2),
        ("runB", 2, "RUN_START", -1, 0), ("runB", 2, "STEP", 0, 1), ("runB", 2, "RUN_END", -1, 1),
    ]
    assert first["failures"] == expected_failures()

    # The poison message went to the dead-letter topic with its reason and source, bytes intact.
    [dead] = asyncio.run(_read_all(settings, "dlq"))
    headers = dict(dead.headers)
    assert dead.value == POISON and dead.key == b"bad"
    assert headers["rlpulse.source.topic"] == settings.topic("spans").encode()
    assert headers["rlpulse.source.offset"] == b"0"
    assert b"too short for an Avro container" in headers["rlpulse.reason"]

    # Replaying every offset through the sink leaves the same rows.
    rewind_sink()
    with Pipeline(settings) as pipeline:
        pipeline.start(("sink",))
        pipeline.wait_caught_up(0)
        pipeline.stop()
    again = snapshot(settings)
    # Re-read batches may be cut at other offsets than the first time, so the raw table can hold
    # a second copy until ClickHouse merges; FINAL (ReplacingMergeTree on the natural key) reads one.
    assert {k: v for k, v in again.items() if k != "spans_raw"} == {k: v for k, v in first.items() if k != "spans_raw"}
