"""The Faust application: agents over the raw topics, timers that emit closed windows.

Faust's own windowed tables expire by wall clock and may never call ``on_window_close``
without a later event, so windows live in a plain table and a timer emits them.
Processing is at-least-once (``concurrency=1``); the ClickHouse writes are idempotent.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import faust

from rlpulse.settings import SCHEMAS_TOPIC, Settings
from schemas.codec import Codec, DecodeError
from schemas.registry import SchemaResolver
from streams.windows import NS, GraderFailures

log = logging.getLogger(__name__)

EMIT_INTERVAL_S = 0.5
WRITES = ("GraderFailureWindow", "Alert")  # schemas this app writes


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
        table_cleanup_interval=3600.0,  # our windows are cleaned by the agents, not by Faust
        broker_credentials=_credentials(settings),
    )
    codec = Codec()
    resolver = SchemaResolver(codec, settings.topic(SCHEMAS_TOPIC), settings.kafka_client_kwargs())

    def raw_topic(short: str) -> faust.TopicT:
        return app.topic(settings.topic(short), key_type=bytes, value_type=bytes,
                         key_serializer="raw", value_serializer="raw", partitions=settings.partitions)

    spans = raw_topic("spans")
    grader_out = raw_topic("grader-failures")
    schemas_topic = app.topic(settings.topic(SCHEMAS_TOPIC), key_serializer="raw", value_serializer="raw")

    windows_table = app.Table("grader-windows", default=None, partitions=settings.partitions)
    graders = GraderFailures(windows_table, settings.window, settings.allowed_lateness)
    emitted: set[str] = set()  # in memory only: after a restart, closed windows are emitted again (idempotent)
    last_cleanup: dict[int, int] = {}

    @app.task
    async def publish_schemas() -> None:
        for name in WRITES:
            fut = await schemas_topic.send(key=codec.fingerprint(name), value=codec.canonical(name).encode())
            await fut

    @app.agent(spans, concurrency=1)
    async def grader_failures(stream: faust.StreamT) -> None:
        async for event in stream.events():
            msg = event.message
            try:
                decoded = await resolver.decode(event.value)
            except DecodeError as exc:
                # The sink dead-letters every undecodable raw message; here it is only skipped.
                log.warning("skipping undecodable message %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, exc)
                continue
            now = clock()
            if graders.add(decoded.record, msg.partition, msg.offset, now) == "late":
                log.warning("late grader span dropped (%d so far): %s[%d]@%d", graders.dropped_late, msg.topic, msg.partition, msg.offset)
            _cleanup(msg.partition, now)

    def _cleanup(partition: int, now: int) -> None:
        # Deleting writes a changelog tombstone to the current event's partition, so only keys of
        # that partition are deleted, and only after the timer emitted them.
        if now - last_cleanup.get(partition, 0) < NS:
            return
        last_cleanup[partition] = now
        for key, value in graders.closed(now):
            if value["partition"] == partition and key in emitted:
                del windows_table[key]
                emitted.discard(key)

    @app.timer(interval=EMIT_INTERVAL_S)
    async def emit_closed_windows() -> None:
        now = clock()
        for key, value in graders.closed(now):
            if key in emitted:
                continue
            for record in graders.records(value, now):
                delivery = await grader_out.send(key=f"{record['run_id']}/{record['attempt']}".encode(),
                                                 value=codec.encode("GraderFailureWindow", record))
                await delivery  # delivered before the window may be deleted from the table
            emitted.add(key)

    return app


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
