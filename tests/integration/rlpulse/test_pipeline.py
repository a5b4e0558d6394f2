"""SDK -> Kafka -> Faust -> sink -> ClickHouse, through the commands a user runs.

One pipeline for the module (``rlpulse streams`` and ``rlpulse sink`` as child processes on the
backend's broker and ClickHouse) takes one workload, and each test reads what it needs of it:

* the SDK's training runs: exact rows, sequence ids, failures by cause, and a poison message that
  goes to the dead-letter topic with its reason and source;
* the GPU poller's real code over a fake NVML: its figures, the placement that joins them to the
  run, the XID and hardware-slowdown alerts; and a process holding four GPUs: four placements
  and four rows of the saved query ``gpu-utilization-by-run``;
* a job that traces with the plain OpenTelemetry API: its span tree.

The last test replays every offset through the sink again: the same rows.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any
from collections.abc import Iterator

import pytest
from aiokafka import AIOKafkaProducer
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Status, StatusCode

from rlpulse.pipeline import Pipeline, rewind, settings_env, wait_groups_ready
from rlpulse.producers import TrainingTelemetry
from rlpulse.producers.pollers.gpu_poller import GpuPoller, Placement
from rlpulse.producers.sdk.sender import Sender
from rlpulse.schemas.catalogue import SINK_TOPICS, TABLES
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics, read_topic
from rlpulse.sinks.store.clickhouse import open_store
from rlpulse.schemas.enums import FAILURE_CAUSES
from tests.fake_nvml import FakeNvml
from tests.integration import until

pytestmark = pytest.mark.integration

POISON = b"\x00\x01 this is not Avro"
GiB = 1 << 30

# (run, attempt) -> steps -> rollouts -> {term: outcome}
WORKLOAD = {
    ("runA", 1): [
        {"a0": {"judge": "ok", "format": "ok"},
         "a1": {"judge": "timeout", "format": "error"},  # error: the grader raised
         "a2": {"judge": "timeout", "format": "unreadable"},
         "a3": {"judge": "unavailable", "format": "ungradable"}},
        {"a4": {"judge": "ok", "format": "ungradable"}},
    ],
    ("runB", 2): [
        {"b0": {"judge": "timeout"}},
    ],
}
CAUSES = FAILURE_CAUSES  # every cause has a row per window, zero counts included
FOUR_GPUS = ["GPU-4a", "GPU-4b", "GPU-4c", "GPU-4d"]
UTIL = {"GPU-4a": 10, "GPU-4b": 35, "GPU-4c": 60, "GPU-4d": 95}  # percent, as NVML reports it
POWER_W = {"GPU-4a": 110, "GPU-4b": 220, "GPU-4c": 330, "GPU-4d": 440}


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


def workload_in(settings: Settings):
    """What a test of ``publish_workload`` waits for: its rows and its failure windows in ClickHouse
    (every run ended with RUN_END, so its windows close as its last message is read)."""
    return until.counts(settings, {
        "SELECT count() FROM $db.spans FINAL WHERE project = 'itest'": 17,
        "SELECT count() FROM $db.steps FINAL WHERE project = 'itest'": 7,
        "SELECT sum(graded) FROM $db.grader_failures FINAL WHERE project = 'itest' AND cause = 'timeout'": 11})


async def _produce_raw(settings: Settings, short: str, key: bytes, value: bytes) -> None:
    producer = AIOKafkaProducer(**settings.kafka_client_kwargs())
    await producer.start()
    try:
        await producer.send_and_wait(settings.topic(short), key=key, value=value)
    finally:
        await producer.stop()


def poll_gpu(settings: Settings, sender: Sender) -> None:
    """One GPU through the poller: an export (mean 200 W, throttle mask 0x9: a hardware slowdown),
    an XID published at once by the watch thread, then an export without the slowdown."""
    fake = FakeNvml(["GPU-int-1"])
    for power_w, mask in ((100, 0x1), (200, 0x9), (300, 0x1)):
        fake.push(0, power_mw=power_w * 1000, temp_c=55, util_gpu=80, util_memory=30, mem_used=40 * GiB,
                  mem_total=80 * GiB, sm_clock=1400, throttle=mask)
    poller = GpuPoller(fake, sender.offer, settings, host="h1", placement=Placement(run_id="gpu-run", project="g"),
                       xid_wait_ms=20)
    assert poller.open()
    for _ in range(3):
        poller.sample()
    delivered = sender.delivered
    poller.export()
    assert poller.start_xid_watch()
    fake.xid(0, 79)
    deadline = time.monotonic() + 10
    while sender.delivered < delivered + 3 and time.monotonic() < deadline:  # sample, placement, XID sample
        time.sleep(0.05)
    fake.push(0, power_mw=100_000, throttle=0x0)  # the slowdown is over
    poller.sample()
    poller.export()
    poller.close()


def poll_four_gpus(settings: Settings, sender: Sender) -> None:
    """A process holding four GPUs: two exports, each GPU's placement and sample sharing a time_ns."""
    fake = FakeNvml(list(FOUR_GPUS))
    for i, hw_id in enumerate(FOUR_GPUS):
        fake.push(i, util_gpu=UTIL[hw_id], power_mw=POWER_W[hw_id] * 1000)
    poller = GpuPoller(fake, sender.offer, settings, host="h4", placement=Placement(run_id="four-gpus", project="g", rank=0))
    assert poller.open()
    for _ in range(2):
        poller.sample()
        poller.export()
    poller.close()


def traced_job(settings: Settings) -> None:
    """Seed 000's tree: a ROLLOUT entry span with LLM and TOOL children, then a REWARD entry span."""
    with TrainingTelemetry(project="otel", run_id="tr", attempt=2, settings=settings) as tel:
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(tel.span_exporter()))
        tracer = provider.get_tracer("agent")
        with tracer.start_as_current_span("process", attributes={"rlpulse.kind": "ROLLOUT", "rlpulse.rollout_id": "ro-1",
                                                                 "rlpulse.step": 4}):
            with tracer.start_as_current_span("chat", attributes={"rlpulse.kind": "LLM", "gen_ai.usage.output_tokens": 57}):
                pass
            with tracer.start_as_current_span("tool:search", attributes={"rlpulse.kind": "TOOL"}) as tool:
                with tracer.start_as_current_span("http", attributes={"http.status": 503}) as http:
                    http.set_status(Status(StatusCode.ERROR, "upstream down"))
                tool.set_attribute("retried", True)
        with tracer.start_as_current_span("score", attributes={"rlpulse.kind": "REWARD", "rlpulse.rollout_id": "ro-1",
                                                               "rlpulse.reward": 0.75}):
            with tracer.start_as_current_span("judge", attributes={"rlpulse.kind": "LLM"}):
                pass
        provider.shutdown()  # exports what the batch processor holds
        assert tel.flush(30) == 0


@pytest.fixture(scope="module")
def ran(module_settings: Settings) -> Iterator[Settings]:
    """The module's pipeline: every workload above published, everything in ClickHouse, stopped."""
    settings = module_settings
    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        asyncio.run(_produce_raw(settings, "spans", b"bad", POISON))
        publish_workload(settings)
        traced_job(settings)
        sender = Sender(settings)
        sender.start()
        poll_gpu(settings, sender)
        poll_four_gpus(settings, sender)
        assert sender.close(30) == 0
        assert sender.delivered == 5 + 16  # GPU-int-1: 3 samples, a placement per export; 2 x 4 x (sample + placement)
        workload = workload_in(settings)
        gpus = until.counts(settings, {
            "SELECT count() FROM $db.gpu_samples FINAL WHERE hw_id = 'GPU-int-1'": 3,
            "SELECT count() FROM $db.gpu_samples FINAL WHERE hw_id LIKE 'GPU-4%'": 8,
            "SELECT count() FROM $db.alerts FINAL WHERE key = 'GPU-int-1'": 3,  # the GPU's alerts come with its samples
            "SELECT count() FROM $db.spans FINAL WHERE project = 'otel'": 6})
        pipeline.wait_caught_up(until=lambda: workload() and gpus())
        pipeline.stop()
    yield settings


def snapshot(settings: Settings) -> dict:
    """Everything the SDK workload's tests check, read from ClickHouse with SQL."""
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        db, q = store.database, store.client.query
        itest = "project = 'itest'"
        return {
            "spans_by_kind": dict(q(f"SELECT kind, count() FROM {db}.spans FINAL WHERE {itest} GROUP BY kind").result_rows),
            "spans_raw": q(f"SELECT count() FROM {db}.spans WHERE {itest}").result_rows[0][0],
            "children_of_rollouts": q(
                f"SELECT count() FROM {db}.spans AS g FINAL INNER JOIN (SELECT span_id, run_id FROM {db}.spans FINAL "
                f"WHERE kind = 'ROLLOUT' AND {itest}) AS r ON g.parent_span_id = r.span_id AND g.run_id = r.run_id "
                f"WHERE g.kind = 'GRADER'"
            ).result_rows[0][0],
            "sequence": q(
                f"SELECT run_id, attempt, count(), uniqExact(sequence_id), min(writer_sequence), max(writer_sequence) "
                f"FROM {db}.spans FINAL WHERE {itest} GROUP BY run_id, attempt ORDER BY run_id"
            ).result_rows,
            "clipped": q(f"SELECT rollout_id FROM {db}.spans FINAL WHERE clipped AND {itest} ORDER BY rollout_id").result_rows,
            "steps": q(
                f"SELECT run_id, attempt, type, step, step_count FROM {db}.steps FINAL WHERE {itest} ORDER BY run_id, time_ns"
            ).result_rows,
            "failures": {
                (r, a, t, c): (f, g)
                for r, a, t, c, f, g in q(
                    f"SELECT run_id, attempt, term, cause, sum(failures), sum(graded) FROM {db}.grader_failures FINAL "
                    f"WHERE {itest} GROUP BY run_id, attempt, term, cause"
                ).result_rows
            },
        }


def table_counts(settings: Settings) -> dict[str, int]:
    """Rows per table, one per key (FINAL)."""
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        return {t: store.client.query(f"SELECT count() FROM {store.database}.{t} FINAL").result_rows[0][0]
                for t in TABLES.values()}


@pytest.fixture(scope="module")
def first(ran: Settings) -> dict[str, Any]:
    """What the pipeline wrote, before any test replays it."""
    return {"snapshot": snapshot(ran), "counts": table_counts(ran)}


def test_sdk_events_are_the_exact_rows(first: dict[str, Any]) -> None:
    rows = first["snapshot"]
    assert rows["spans_by_kind"] == {"ROLLOUT": 6, "GRADER": 11}
    assert rows["spans_raw"] == 17
    assert rows["children_of_rollouts"] == 11  # every grader span names its rollout as parent
    # sequence ids are 1..n without gaps or repeats per (run, attempt)
    assert rows["sequence"] == [("runA", 1, 15, 15, 1, 15), ("runB", 2, 2, 2, 1, 2)]
    assert rows["clipped"] == [("a2",)]
    assert rows["steps"] == [
        ("runA", 1, "RUN_START", -1, 0), ("runA", 1, "STEP", 0, 1), ("runA", 1, "STEP", 1, 2), ("runA", 1, "RUN_END", -1, 2),
        ("runB", 2, "RUN_START", -1, 0), ("runB", 2, "STEP", 0, 1), ("runB", 2, "RUN_END", -1, 1),
    ]


def test_failures_by_cause_from_the_streams(first: dict[str, Any]) -> None:
    assert first["snapshot"]["failures"] == expected_failures()


def test_the_poison_message_is_dead_lettered_with_its_reason_and_source(ran: Settings) -> None:
    [dead] = asyncio.run(read_topic(ran.kafka_client_kwargs(), ran.topic("dlq")))
    headers = dict(dead.headers)
    assert dead.value == POISON and dead.key == b"bad"  # bytes intact
    assert headers["rlpulse.source.topic"] == ran.topic("spans").encode()
    assert headers["rlpulse.source.offset"] == b"0"
    assert b"too short for an Avro container" in headers["rlpulse.reason"]


def test_poller_figures_placement_and_alerts(ran: Settings) -> None:
    with open_store(ran.clickhouse_dsn, owner="test") as store:
        q, db = store.client.query, store.database
        samples = q(f"SELECT power_w, throttle_reasons, xid_errors, xid_last, memory_utilization FROM {db}.gpu_samples FINAL "
                    f"WHERE hw_id = 'GPU-int-1' ORDER BY time_ns").result_rows
        runs = q(f"SELECT DISTINCT p.run_id FROM {db}.gpu_samples AS s FINAL INNER JOIN {db}.placements AS p FINAL "
                 f"ON s.hw_id = p.hw_id WHERE s.hw_id = 'GPU-int-1'").result_rows
        alerts = q(f"SELECT rule, state FROM {db}.alerts FINAL WHERE key = 'GPU-int-1' ORDER BY rule, state").result_rows
    assert samples[0] == (200.0, 0x9, 0, None, 0.5)  # the export: means, OR of masks, latest
    assert samples[1][2:4] == (1, 79)  # the XID, counted from zero
    assert samples[-1][1:4] == (0x0, 1, 79)
    assert runs == [("gpu-run",)]
    assert alerts == [("hw_slowdown", "FIRING"), ("hw_slowdown", "RESOLVED"), ("xid", "FIRING")]


def test_four_gpus_of_one_process_are_four_placements_and_four_utilisation_rows(ran: Settings) -> None:
    with open_store(ran.clickhouse_dsn, owner="test") as store:
        q, db = store.client.query, store.database
        store.client.command(f"OPTIMIZE TABLE {db}.placements FINAL")  # what a background merge would do
        placements = q(f"SELECT hw_id, `index`, role, rank, count() FROM {db}.placements FINAL WHERE run_id = 'four-gpus' "
                       "GROUP BY hw_id, `index`, role, rank ORDER BY hw_id").result_rows
        times = q(f"SELECT uniqExact(time_ns), count() FROM {db}.placements FINAL WHERE run_id = 'four-gpus'").result_rows
    assert placements == [(hw_id, i, "trainer", 0, 2) for i, hw_id in enumerate(FOUR_GPUS)]
    assert times == [(2, 8)]

    run = subprocess.run([sys.executable, "-m", "rlpulse.cli", "query", "--saved", "gpu-utilization-by-run",
                          "--param", "run_id=four-gpus", "--format", "json"],
                         env=settings_env(ran), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = [(r["hw_id"], r["role"], r["rank"], r["samples"], r["mean_gpu_utilization"], r["mean_power_w"])
           for r in json.loads(run.stdout)]
    assert got == [(hw_id, "trainer", 0, 2, UTIL[hw_id] / 100, float(POWER_W[hw_id])) for hw_id in FOUR_GPUS]


def test_an_opentelemetry_span_tree_is_rebuilt_from_clickhouse(ran: Settings) -> None:
    with open_store(ran.clickhouse_dsn, owner="test") as store:
        db = store.database
        rows = store.client.query(f"""
            SELECT sequence_id, span_id, parent_span_id, name, kind, rollout_id, step, status, status_message,
                   reward, attributes, start_time_ns
            FROM {db}.spans FINAL WHERE run_id = 'tr' AND attempt = 2 ORDER BY sequence_id""").result_rows
    by_id = {r[1]: r for r in rows}

    def depth(row) -> int:
        return 0 if row[2] is None else 1 + depth(by_id[row[2]])

    tree = [(depth(r), r[3], r[4]) for r in rows]
    # sequence order is start order: the tree reads top-down like the code that made it
    assert tree == [(0, "process", "ROLLOUT"), (1, "chat", "LLM"), (1, "tool:search", "TOOL"), (2, "http", "CUSTOM"),
                    (0, "score", "REWARD"), (1, "judge", "LLM")]
    assert [r[0] for r in rows] == sorted(set(r[0] for r in rows))  # unique, the start order (the exporter's start times)
    assert [r[11] for r in rows] == sorted(r[11] for r in rows)
    assert {r[5] for r in rows} == {"ro-1"}  # children take their entry span's rollout id
    http, score = by_id[rows[3][1]], rows[4]
    assert (http[7], http[8], http[10]["http.status"]) == ("ERROR", "upstream down", "503")
    assert rows[0][6] == 4 and score[9] == 0.75 and by_id[rows[2][1]][10]["retried"] == "true"


def test_replaying_every_offset_through_the_sink_leaves_the_same_rows(ran: Settings, first: dict[str, Any]) -> None:
    """Last in the module: it writes to the store the other tests read (the same rows, if it passes)."""
    rewind(ran, ran.sink_group, SINK_TOPICS)
    with Pipeline(ran) as pipeline:
        pipeline.start(("sink",))
        pipeline.wait_caught_up(0)
        pipeline.stop()
    again = snapshot(ran)
    # Re-read batches may be cut at other offsets than the first time, so the raw table can hold
    # a second copy until ClickHouse merges; FINAL (ReplacingMergeTree on the natural key) reads one.
    assert {k: v for k, v in again.items() if k != "spans_raw"} == {
        k: v for k, v in first["snapshot"].items() if k != "spans_raw"}
    assert table_counts(ran) == first["counts"]
