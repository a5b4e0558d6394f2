"""``rlpulse otlp-ingest`` restarted in the middle of a job that exports cumulative temporality: the
differencing state is rebuilt from the messages before the committed offset, so the steps after
the restart hold their own rollouts, not the run's whole count, and no step is published twice.
The job's training settings (resource attributes, seed 001) are the run's config, read by the saved
query ``run-config``: sent once, on the run's one RUN_START, the restart notwithstanding."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from aiokafka import AIOKafkaProducer
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from rlpulse.base.settings import Settings
from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.producers.otlp.ingest import ingest_group
from rlpulse.schemas.catalogue import OTLP_METRICS_TOPIC
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.read.queries import run_query, saved_sql
from rlpulse.sinks.store.clickhouse import open_reader
from tests.integration import until

pytestmark = [pytest.mark.integration, pytest.mark.full]

P = "akka.optimize.training."
RUN = "restarted"
BOUNDS = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0, 2.0, 5.0]
START = time.time_ns() - 60 * 10**9
# rewards of each step's rollouts: steps 1-2 before the restart, 3-4 after
REWARDS = {1: [0.0, 0.5, 1.0], 2: [0.25, 0.75], 3: [1.0, 1.0, 0.05, 3.0], 4: [0.5]}


# the job's training settings, on its resource as OTEL_RESOURCE_ATTRIBUTES or Resource.create would put them
SETTINGS = {P + "model": "Qwen/Qwen2.5-0.5B", P + "rl.num_generations": 8, "rlpulse.config.learning_rate": 1e-6,
            "rlpulse.config.use_vllm": True, "rlpulse.config.judge_api_key": "sk-live"}
CONFIG = [("judge_api_key", "***"), ("learning_rate", "1e-06"), ("model", "Qwen/Qwen2.5-0.5B"),
          ("rl.num_generations", "8"), ("use_vllm", "true")]


def _kv(attrs, key: str, value) -> None:
    kv = attrs.add()
    kv.key = key
    if isinstance(value, bool):
        kv.value.bool_value = value
    elif isinstance(value, int):
        kv.value.int_value = value
    elif isinstance(value, float):
        kv.value.double_value = value
    else:
        kv.value.string_value = value


def export(step: int) -> bytes:
    """The job's cumulative export after ``step``: the counter and the reward histogram since START."""
    import bisect

    request = ExportMetricsServiceRequest()
    group = request.resource_metrics.add()
    for key, value in ((P + "run.id", RUN), (P + "project", "otlp-restart"), (P + "run.attempt", 1),
                       ("service.instance.id", "job-0"), *SETTINGS.items()):
        _kv(group.resource.attributes, key, value)
    scope = group.scope_metrics.add()
    now = START + step * 10**9
    counter = scope.metrics.add()
    counter.name = P + "rl.step.count"
    counter.sum.is_monotonic, counter.sum.aggregation_temporality = True, 2
    point = counter.sum.data_points.add()
    point.as_int, point.start_time_unix_nano, point.time_unix_nano = step, START, now
    values = [x for s in range(1, step + 1) for x in REWARDS[s]]
    hist = scope.metrics.add()
    hist.name = P + "rl.rollout.reward"
    hist.histogram.aggregation_temporality = 2
    hp = hist.histogram.data_points.add()
    _kv(hp.attributes, P + "rl.term", "total")
    hp.start_time_unix_nano, hp.time_unix_nano = START, now
    hp.explicit_bounds.extend(BOUNDS)
    counts = [0] * (len(BOUNDS) + 1)
    for x in values:
        counts[bisect.bisect_left(BOUNDS, x)] += 1
    hp.bucket_counts.extend(counts)
    hp.count, hp.sum, hp.min, hp.max = len(values), sum(values), min(values), max(values)
    return request.SerializeToString()


async def _produce(settings: Settings, steps: list[int]) -> None:
    producer = AIOKafkaProducer(**settings.kafka_client_kwargs())
    await producer.start()
    try:
        for step in steps:
            await producer.send_and_wait(settings.topic(OTLP_METRICS_TOPIC), key=b"job-0", value=export(step))
    finally:
        await producer.stop()


def histograms(settings: Settings) -> list[tuple]:
    return until.query(settings, f"SELECT step, count, bucket_counts FROM $db.reward_histograms FINAL "
                                 f"WHERE run_id = '{RUN}' ORDER BY step") or []


@pytest.fixture(scope="module")
def ran(module_settings: Settings) -> Iterator[tuple[Settings, list[tuple], list[tuple], str]]:
    settings = module_settings
    ensure_topics(settings)
    pipeline = Pipeline(settings)
    try:
        pipeline.start(("otlp-ingest", "streams", "sink"))
        wait_groups_ready(settings, (settings.app_id, settings.sink_group, ingest_group(settings)), pipeline)
        asyncio.run(_produce(settings, [1, 2]))
        pipeline.wait_caught_up(until=lambda: len(histograms(settings)) == 2)
        pipeline.stop(("otlp-ingest",))
        pipeline.start(("otlp-ingest",))
        asyncio.run(_produce(settings, [3, 4]))
        pipeline.wait_caught_up(until=lambda: len(histograms(settings)) == 4)
        steps = until.query(settings, f"SELECT type, step, count() FROM $db.steps WHERE run_id = '{RUN}' "
                                      f"GROUP BY type, step ORDER BY type, step") or []
        log = (settings.home / "logs" / "otlp-ingest.log").read_text()
        store = open_reader(settings.clickhouse_dsn, owner="test")
        try:
            columns, config = run_query(store.client, saved_sql("run-config", {"run_id": RUN}, store.database),
                                        {"run_id": RUN})
        finally:
            store.close()
        assert columns == ["project", "run_id", "attempt", "key", "value"]
        yield settings, histograms(settings), steps, log, config
    finally:
        pipeline.stop()


def test_each_step_holds_its_own_rollouts_after_the_restart(ran) -> None:
    import bisect

    _, rows, _, _, _ = ran
    expected = []
    for step, values in REWARDS.items():
        counts = [0] * (len(BOUNDS) + 1)
        for x in values:
            counts[bisect.bisect_left(BOUNDS, x)] += 1
        expected.append((step, len(values), counts))
    assert [(s, c, list(b)) for s, c, b in rows] == expected


def test_no_step_is_published_twice_and_the_state_was_rebuilt(ran) -> None:
    _, _, steps, log, _ = ran
    # one RUN_START (the rebuilt state remembers the run; step -1 as the SDK's), one STEP per step, each once
    assert steps == [("RUN_START", -1, 1), ("STEP", 1, 1), ("STEP", 2, 1), ("STEP", 3, 1), ("STEP", 4, 1)]
    assert "metric state rebuilt from" in log and "(2 messages, 0 refused as before; 2 series)" in log


def test_the_jobs_training_settings_are_the_runs_config(ran) -> None:
    config = ran[4]
    assert config == [("otlp-restart", RUN, 1, key, value) for key, value in CONFIG]
