"""Backlogs, replays and duplicates through the real broker, streams and sink.

* Jobs publish before the streams and the sink ever started (the SDK creates the topics), with
  event times ten minutes in the past and an allowed lateness of 2 s: every figure is exact,
  because lateness is judged on the run's event time, not on the processor's clock.
* A worker started on topics with a different partition count exits non-zero naming them.
* A message sent twice by the producer, and every message redelivered to the worker that
  replaces one killed before it committed, change no figure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import signal
import subprocess
import sys
import time

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from rlpulse.producers import TrainingTelemetry
from rlpulse.pipeline import Pipeline, lag, settings_env
from rlpulse.base.settings import Settings
from rlpulse.schemas.catalogue import RAW_TOPICS, run_key
from rlpulse.schemas.codec import Codec
from rlpulse.schemas.topics import ensure_topics, read_topic
from rlpulse.sinks.store.clickhouse import open_store
from rlpulse.streams.histograms import reward_bucket
from tests.integration import until

pytestmark = [pytest.mark.integration, pytest.mark.full]  # backlogs, crashes and redeliveries: make test-all

NS = 1_000_000_000
CAUSES = ("timeout", "unavailable", "unreadable", "ungradable")


def backlog_settings(settings: Settings) -> Settings:
    return dataclasses.replace(settings, window=10.0, allowed_lateness=2.0, heartbeat_interval=1.0)


class PastClock:
    """Event times ten minutes ago, advancing 50 ms per event: a job that ran long before the streams."""

    def __init__(self) -> None:
        self.t = time.time_ns() - 600 * NS

    def __call__(self) -> int:
        self.t += 50_000_000
        return self.t


def publish_backlog(settings: Settings, runs: int = 3, steps: int = 4, per_step: int = 12) -> dict:
    """Publish with the SDK and return the truth: failures by cause, rollouts and clipped per step, buckets."""
    rng = random.Random(11)
    truth: dict = {"failures": {}, "steps": {}, "buckets": {}}
    for r in range(runs):
        run_id = f"b{r}"
        with TrainingTelemetry(project="bk", run_id=run_id, settings=settings, clock=PastClock()) as tel:
            for step in range(steps):
                clipped, buckets = 0, [0] * 15
                for i in range(per_step):
                    rid = f"{run_id}-{step}-{i}"
                    outcome = rng.choice(("ok", "ok") + CAUSES)
                    tel.grader(step=step, rollout_id=rid, term="judge", outcome=outcome, duration_s=0.5)
                    if outcome != "ok":
                        key = (run_id, outcome)
                        truth["failures"][key] = truth["failures"].get(key, 0) + 1
                    reward = round(rng.uniform(-0.2, 1.5), 2)
                    tokens = rng.choice((100, 500, 1000))
                    clipped += tokens >= 1000
                    buckets[reward_bucket(reward)] += 1
                    tel.rollout(step=step, rollout_id=rid, reward=reward, completion_tokens=tokens, max_tokens=1000)
                tel.step_completed(step=step, tokens=1000, duration_s=1.0)
                truth["steps"][(run_id, step)] = (per_step, clipped)
                truth["buckets"][(run_id, step)] = buckets
            assert tel.flush(30) == 0
    return truth


def read_figures(settings: Settings) -> dict:
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        db, q = store.database, store.client.query
        return {
            "failures": {(r, c): n for r, c, n in q(
                f"SELECT run_id, cause, sum(failures) FROM {db}.grader_failures FINAL WHERE failures > 0 "
                f"GROUP BY run_id, cause").result_rows},
            "steps": {(r, s): (n, c) for r, s, n, c in q(
                f"SELECT run_id, step, rollouts, clipped FROM {db}.step_stats FINAL").result_rows},
            "buckets": {(r, s): list(b) for r, s, b in q(
                f"SELECT run_id, step, bucket_counts FROM {db}.reward_histograms FINAL WHERE term = 'total'").result_rows},
            "alerts": sorted(q(f"SELECT rule, key, state, first_seen_ns FROM {db}.alerts FINAL").result_rows),
        }


def test_a_backlog_published_before_the_streams_ever_started_is_exact(settings: Settings) -> None:
    settings = backlog_settings(settings)
    truth = publish_backlog(settings)  # no topic exists yet: the SDK creates them
    time.sleep(settings.allowed_lateness + 1)  # the backlog is older than the lateness by any clock
    with Pipeline(settings) as pipeline:
        pipeline.start()
        pipeline.wait_caught_up(until=until.counts(settings, {"step_stats": len(truth["steps"])}))  # every run ended
        pipeline.stop()
    figures = read_figures(settings)
    assert figures["failures"] == truth["failures"]
    assert figures["steps"] == truth["steps"]
    assert figures["buckets"] == truth["buckets"]


def test_a_worker_on_topics_with_other_partition_counts_exits_naming_them(settings: Settings) -> None:
    async def create_spans_with_one_partition() -> None:
        admin = AIOKafkaAdminClient(**settings.kafka_client_kwargs())
        await admin.start()
        try:  # as the broker would auto-create it on a first publish
            await admin.create_topics([NewTopic(settings.topic("spans"), 1, 1)])
        finally:
            await admin.close()

    asyncio.run(create_spans_with_one_partition())
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "rlpulse.cli", "streams"], env=settings_env(settings),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"{settings.topic('spans')} has 1" in done.stderr and f"{settings.topic('steps')} has 2" in done.stderr
    assert "Traceback" not in done.stderr
    assert time.monotonic() - started < 60


async def _publish_twice(settings: Settings) -> None:
    """Every message sent twice, as a producer retry after a lost acknowledgement would."""
    codec = Codec()
    producer = AIOKafkaProducer(**settings.kafka_client_kwargs())
    await producer.start()
    t0 = time.time_ns() - 300 * NS
    ident = {"project": "dup", "run_id": "d1", "attempt": 1, "stage": ""}
    key = run_key("dup", "d1").encode()
    try:
        for step in range(2):
            spans = []
            for i in range(10):
                t = t0 + (step * 10 + i) * NS // 10
                seq = step * 20 + 2 * i + 1
                spans.append(dict(ident, time_ns=t, trace_id=b"t" * 16, span_id=b"%08d" % seq, name="grader judge",
                                  kind="GRADER", start_time_ns=t - NS, end_time_ns=t, status="ERROR", term="judge",
                                  outcome="timeout" if i % 2 else "ok", step=step, sequence_id=seq, writer_id="w"))
                spans.append(dict(ident, time_ns=t, trace_id=b"t" * 16, span_id=b"%08d" % (seq + 1), name="rollout",
                                  kind="ROLLOUT", start_time_ns=t - NS, end_time_ns=t, status="OK", step=step,
                                  reward=0.5, clipped=i < 3, sequence_id=seq + 1, writer_id="w"))
            step_event = dict(ident, time_ns=t0 + (step * 10 + 10) * NS // 10, type="STEP", trainer="rl", step=step,
                              step_count=step + 1, writer_id="w", sequence_id=step + 1)
            for _ in range(2):
                await producer.send_and_wait(settings.topic("spans"), key=key, value=codec.encode("Span", spans))
                await producer.send_and_wait(settings.topic("steps"), key=key, value=codec.encode("Step", [step_event]))
        end = dict(ident, time_ns=t0 + 30 * NS // 10, type="RUN_END", trainer="rl", step_count=2, writer_id="w", sequence_id=3)
        await producer.send_and_wait(settings.topic("steps"), key=key, value=codec.encode("Step", [end]))
    finally:
        await producer.stop()


def _read_topic_records(settings: Settings, short: str) -> list[dict]:
    codec = Codec()
    return [r for m in asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic(short)))
            for r in codec.decode(m.value).records]


def test_duplicate_sends_and_a_redelivery_after_a_crash_change_no_figure(settings: Settings) -> None:
    settings = backlog_settings(settings)
    ensure_topics(settings)
    asyncio.run(_publish_twice(settings))
    with Pipeline(settings) as pipeline:
        # The first worker never commits (a commit interval longer than it lives), then dies with
        # SIGKILL: its replacement gets every message again, on top of the state it left.
        pipeline.start(("sink",))
        pipeline.start(("streams",), extra_env={"RLPULSE_STREAMS_COMMIT_INTERVAL": "600s"})
        deadline = time.monotonic() + 120
        while len(_read_topic_records(settings, "step-stats")) < 2:
            assert time.monotonic() < deadline, "the first worker emitted no step figures"
            pipeline.check_alive()
            time.sleep(0.5)
        first_alerts = _read_topic_records(settings, "alerts")
        pipeline.stop(("streams",), sig=signal.SIGKILL)
        assert sum(lag(settings, settings.app_id, RAW_TOPICS).values()) > 0  # nothing was committed
        pipeline.start(("streams",))
        pipeline.wait_caught_up(until=until.counts(settings, {"step_stats": 2}))  # the run ended (RUN_END)
        pipeline.stop()
    figures = read_figures(settings)
    assert figures["failures"] == {("d1", "timeout"): 10}
    assert figures["steps"] == {("d1", 0): (10, 3), ("d1", 1): (10, 3)}
    # the redelivered messages were skipped by their sequence marks: nothing was emitted again
    assert len(_read_topic_records(settings, "step-stats")) == 2
    assert _read_topic_records(settings, "alerts") == first_alerts
