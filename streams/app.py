"""The Faust application: three agents, wall-clock ticks, and the timers that emit.

* ``spans`` agent (stage 1): grader outcomes into tumbling windows and rollouts into partial
  step figures, both per source partition with replayed offsets skipped. A timer emits
  closed windows to ``grader-failures`` and changed partials to ``step-partials``.
* ``runs`` agent (stage 2, keyed by run/attempt): merges step partials into step stats and
  histograms, merges grader windows, detects stalls, evaluates the alert rules.
* ``hardware`` agent (keyed by GPU): XID and throttle alerts.

Faust's windowed tables expire by wall clock and may never call ``on_window_close``
without a later event, so windows live in plain tables. A Faust table can only be written
while an event of the key's partition is processed, so wall-clock logic (stalls, step and
window completion) runs on tick messages that a timer sends to every partition of the
``ticks`` topic. Processing is at-least-once (``concurrency=1``): every stage either skips
replayed offsets or merges by replacement, and the ClickHouse writes are idempotent.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import faust

from rlpulse.settings import SCHEMAS_TOPIC, Settings
from schemas.codec import Codec, DecodeError
from schemas.registry import SchemaResolver
from streams.alerting import AlertBook, forget_run, grader_failure_rate, hardware, hardware_tick, step_rules
from streams.merge import GraderWindowMerger, StepMerger
from streams.stall import StallDetector
from streams.state import TABLES, PartitionView
from streams.steps import StepPartials, histogram_records, length_record, step_stats
from streams.windows import NS, GraderFailures

log = logging.getLogger(__name__)

EMIT_INTERVAL_S = 0.5  # stage 1 emits closed windows and changed partials this often
TICK_INTERVAL_S = 0.5  # wall-clock ticks to every partition
SETTLE_S = 1.5  # stage 2 waits this long after the last change before a step or window counts as settled
WRITES = ("GraderFailureWindow", "GraderWindow", "StepPartial", "StepStats", "RewardHistogram", "CompletionLengthHistogram", "Alert")


def create_app(settings: Settings, clock: Callable[[], int] = time.time_ns) -> faust.App:
    datadir = settings.home / "faust" / settings.app_id
    datadir.mkdir(parents=True, exist_ok=True)
    app = faust.App(
        settings.app_id,
        broker=f"kafka://{settings.kafka_bootstrap}",
        store="memory://",
        topic_partitions=settings.partitions,
        processing_guarantee="at_least_once",
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
        datadir=str(datadir),
        table_cleanup_interval=3600.0,  # our state is cleaned by the processors, not by Faust
        broker_credentials=_credentials(settings),
        # A killed worker's partitions move to its replacement after this long (Faust's default is 60 s).
        broker_session_timeout=10.0,
        broker_heartbeat_interval=3.0,
    )
    codec = Codec()
    resolver = SchemaResolver(codec, settings.topic(SCHEMAS_TOPIC), settings.kafka_client_kwargs())
    out = _Outputs(app, settings, codec)

    def topic(*shorts: str) -> faust.TopicT:
        return app.topic(*(settings.topic(s) for s in shorts), key_type=bytes, value_type=bytes,
                         key_serializer="raw", value_serializer="raw", partitions=settings.partitions)

    def table(name: str) -> faust.Table:
        assert name in TABLES, f"add {name!r} to streams.state.TABLES so its changelog is created up front"
        return app.Table(name, default=None, partitions=settings.partitions)

    async def decode(event: faust.EventT) -> dict[str, Any] | None:
        msg = event.message
        try:
            return (await resolver.decode(event.value)).record
        except DecodeError as exc:
            # The sink dead-letters every undecodable raw message; here it is only skipped.
            log.warning("skipping undecodable message %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, exc)
            return None

    # -- stage 1: spans ------------------------------------------------------------------
    windows_table, partials_table = table("grader-windows"), table("step-partials")
    graders = GraderFailures(windows_table, settings.window, settings.allowed_lateness)
    partials = StepPartials(partials_table, retention_s=max(10 * settings.allowed_lateness, 60.0))
    emitted: set[str] = set()  # closed windows sent; in memory, so a restart sends them again (idempotent)
    sent: dict[str, int] = {}  # partial -> offset it was last sent at; empty after a restart, so all are re-sent
    last_cleanup: dict[int, int] = {}

    @app.agent(topic("spans"), concurrency=1)
    async def spans(stream: faust.StreamT) -> None:
        async for event in stream.events():
            record = await decode(event)
            if record is None:
                continue
            msg, now = event.message, clock()
            if graders.add(record, msg.partition, msg.offset, now) == "late":
                log.warning("late grader span dropped (%d so far): %s[%d]@%d", graders.dropped_late, msg.topic, msg.partition, msg.offset)
            if partials.add(record, msg.partition, msg.offset, now) == "late":
                log.warning("late rollout dropped (%d so far): %s[%d]@%d", partials.dropped_late, msg.topic, msg.partition, msg.offset)
            if now - last_cleanup.get(msg.partition, 0) >= NS:
                last_cleanup[msg.partition] = now
                _cleanup_stage1(msg.partition, now)

    def _cleanup_stage1(partition: int, now: int) -> None:
        # Only keys of the event's partition, and only what the timer has already sent.
        for key, value in graders.closed(now):
            if value["partition"] == partition and key in emitted:
                del windows_table[key]
                emitted.discard(key)
        for key in partials.expired(now, partition):
            if sent.get(key) == partials_table[key]["offset"]:
                partials.forget(key)
                sent.pop(key, None)

    @app.timer(interval=EMIT_INTERVAL_S)
    async def emit_stage1() -> None:
        now = clock()
        for key, value in graders.closed(now):
            if key not in emitted:
                for record in graders.records(value, now):
                    await out.send("grader-failures", record, "GraderFailureWindow")
                emitted.add(key)
        for key, value in sorted(partials_table.items()):
            if value is not None and sent.get(key) != value["offset"]:
                await out.send("step-partials", StepPartials.record(value, now), "StepPartial")
                sent[key] = value["offset"]

    # -- wall-clock ticks ----------------------------------------------------------------
    ticks = topic("ticks")

    @app.timer(interval=TICK_INTERVAL_S)
    async def tick() -> None:
        for partition in range(settings.partitions):
            await ticks.send(key=b"tick", value=b"", partition=partition)

    # -- stage 2: runs -------------------------------------------------------------------
    merge_table, stall_table, rules_table, alerts_table = table("step-merge"), table("stalls"), table("step-rules"), table("run-alerts")
    thresholds = settings.alerts
    lateness = max(settings.allowed_lateness, SETTLE_S)
    retention = max(10 * settings.allowed_lateness, 60.0)

    class RunPartition:
        """The processors of one partition of the run-keyed topics, over that partition's state."""

        def __init__(self, p: int):
            self.book = AlertBook(PartitionView(alerts_table, p))
            self.steps = StepMerger(PartitionView(merge_table, p), SETTLE_S, lateness, retention)
            self.windows = GraderWindowMerger(PartitionView(merge_table, p), SETTLE_S, retention)
            # Ages count from no earlier than this partition's first event in this process (after
            # recovery and any rebalance wait), so our own downtime never looks like a stalled job.
            self.stalls = StallDetector(PartitionView(stall_table, p), self.book, settings.stall_after,
                                        settings.silent_after, resumed_ns=clock())
            self.rules = PartitionView(rules_table, p)

    run_parts: dict[int, RunPartition] = {}

    @app.agent(topic("steps", "step-partials", "grader-failures", "ticks"), concurrency=1)
    async def runs(stream: faust.StreamT) -> None:
        async for event in stream.events():
            msg, now = event.message, clock()
            part = run_parts.setdefault(msg.partition, RunPartition(msg.partition))
            short = msg.topic[len(settings.topic_prefix) + 1:]
            alerts: list[dict[str, Any]] = []
            if short == "ticks":
                alerts += part.stalls.tick(now)
                for merged, first in part.steps.tick(now):
                    stats = step_stats(merged, complete=True, emitted_at_ns=now)
                    await out.send("step-stats", stats, "StepStats")
                    for record in histogram_records(merged, now):
                        await out.send("reward-histograms", record, "RewardHistogram")
                    await out.send("length-histograms", length_record(merged, now), "CompletionLengthHistogram")
                    if first:
                        alerts += step_rules(part.book, part.rules, stats, thresholds, now)
                while part.steps.forgotten:  # an ended run's step-rule state goes with its merge record
                    _, run_id, attempt = part.steps.forgotten.pop()
                    forget_run(part.rules, run_id, attempt)
                for window in part.windows.tick(now):
                    await out.send("grader-windows", window, "GraderWindow")
                    alerts += grader_failure_rate(part.book, window, thresholds, now)
            else:
                record = await decode(event)
                if record is None:
                    continue
                if short == "steps":
                    part.steps.on_step_event(record, now)
                    alerts += part.stalls.observe(record, now)
                elif short == "step-partials":
                    part.steps.on_partial(record, now)
                elif short == "grader-failures":
                    part.windows.on_row(record, now)
            for alert in alerts:
                await out.alert(alert)

    # -- hardware ------------------------------------------------------------------------
    hw_state_table, hw_alerts_table = table("gpus"), table("gpu-alerts")

    @app.agent(topic("hardware", "ticks"), concurrency=1)
    async def gpus(stream: faust.StreamT) -> None:
        async for event in stream.events():
            msg, now = event.message, clock()
            book = AlertBook(PartitionView(hw_alerts_table, msg.partition))
            state = PartitionView(hw_state_table, msg.partition)
            if msg.topic == settings.topic("ticks"):
                alerts = hardware_tick(book, state, thresholds, now)
            else:
                record = await decode(event)
                if record is None or "throttle_reasons" not in record:  # placements carry no figures
                    continue
                alerts = hardware(book, state, record, thresholds, now)
            for alert in alerts:
                await out.alert(alert)

    @app.task
    async def publish_schemas() -> None:
        await out.publish_schemas()

    return app


class _Outputs:
    """Encodes and sends records to the derived topics, waiting for each delivery."""

    def __init__(self, app: faust.App, settings: Settings, codec: Codec):
        self._codec = codec
        self._settings = settings
        self._topics = {
            short: app.topic(settings.topic(short), key_serializer="raw", value_serializer="raw")
            for short in ("grader-failures", "grader-windows", "step-partials", "step-stats", "reward-histograms", "length-histograms",
                          "alerts", SCHEMAS_TOPIC)
        }

    async def send(self, short: str, record: dict[str, Any], schema: str) -> None:
        key = f"{record['run_id']}/{record['attempt']}".encode()
        delivery = await self._topics[short].send(key=key, value=self._codec.encode(schema, record))
        await delivery  # delivered before the state that produced it may be deleted

    async def alert(self, alert: dict[str, Any]) -> None:
        log.info("alert %s %s %s: %s", alert["rule"], alert["state"], alert["key"], alert["summary"])
        delivery = await self._topics["alerts"].send(key=alert["key"].encode(), value=self._codec.encode("Alert", alert))
        await delivery

    async def publish_schemas(self) -> None:
        for name in WRITES:
            delivery = await self._topics[SCHEMAS_TOPIC].send(key=self._codec.fingerprint(name), value=self._codec.canonical(name).encode())
            await delivery


def _credentials(settings: Settings) -> object | None:
    """Faust's form of the Kafka security settings (None for PLAINTEXT)."""
    protocol = settings.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return None
    ssl_context = None
    if protocol in ("SSL", "SASL_SSL"):
        from aiokafka.helpers import create_ssl_context

        ssl_context = create_ssl_context(cafile=settings.kafka_ssl_cafile or None)
    if protocol == "SSL":
        return faust.SSLCredentials(ssl_context)
    return faust.SASLCredentials(
        username=settings.kafka_sasl_username, password=settings.kafka_sasl_password,
        mechanism=settings.kafka_sasl_mechanism or "PLAIN", ssl_context=ssl_context,
    )


def run_worker(settings: Settings, loglevel: str = "INFO") -> None:
    """Run the Faust worker in this process until SIGTERM/SIGINT."""
    app = create_app(settings)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()
