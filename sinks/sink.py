"""The Kafka -> ClickHouse sink: check each message's framing, buffer it, and at each checkpoint
have ClickHouse decode the buffered containers in one insert per table.

Per message, on the hot path, only the container framing is read in Python (magic, header,
block sizes and sync markers: ``schemas.codec.read_header`` and ``blocks``), and its record
type is checked against the topic and its writer schema against the reader schema. Anything
that fails goes to the dead-letter topic with the reason, and the sink goes on. No record is
decoded here: ClickHouse decodes every table (see ``sinks.avro_sql``).

Two parts, as in quixstreams: a :class:`~sinks.checkpoint.Checkpoint` decides when to commit
and commits offsets only after every table's insert is in; a :class:`~sinks.writer.TableWriter`
writes one table's batch with its retry policy.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition

from rlpulse.settings import Settings
from schemas.catalogue import BY_SHORT, DLQ_TOPIC, SINK_TOPICS, TABLES
from schemas.codec import DecodeError, blocks, read_header
from schemas.topics import topic_partitions
from sinks.avro_sql import IncompatibleSchema, Plans
from sinks.checkpoint import Checkpoint, Policy
from sinks.clickhouse import Store, table_columns
from sinks.dlq import queue_dead_letter, send_dead_letter
from sinks.writer import Entry, Inserter, TableWriter

log = logging.getLogger(__name__)

# Container codecs ClickHouse's Avro input reads.
CODECS = ("null", "deflate", "snappy")
POLL_MESSAGES = 256


@dataclass
class SinkStats:
    rows: dict[str, int] = field(default_factory=dict)
    dead_letters: int = 0
    checkpoints: int = 0


class ClickHouseSink:
    """Consumes the raw and derived topics into the tables of ``store``."""

    def __init__(self, settings: Settings, store: Store, policy: Policy | None = None):
        self.settings = settings
        self.store = store
        self.policy = policy or Policy()
        self.stats = SinkStats()
        self._topics = {settings.topic(short): short for short in SINK_TOPICS}
        self._dlq = settings.topic(DLQ_TOPIC)
        self._plans = Plans(table_columns(store))
        self._inserter = Inserter(store)
        self._writers: dict[str, TableWriter] = {}
        self._checkpoint = Checkpoint(self.policy)
        self._lock = asyncio.Lock()  # the poll loop and the rebalance listener both checkpoint
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self.assigned = asyncio.Event()  # set once partitions are assigned (the bench times from here)
        self.committed: dict[TopicPartition, int] = {}  # what this sink has committed to its group

    # -- intake -------------------------------------------------------------------------------
    def check(self, msg: Any) -> tuple[str, Entry]:
        """The table and entry of a consumed message; DecodeError says why it cannot be inserted."""
        if not msg.value:
            raise DecodeError("empty message (no value)")
        header = read_header(msg.value)
        allowed = BY_SHORT[self._topics[msg.topic]].records
        if header.name not in allowed:
            raise DecodeError(f"record type {header.name} does not belong on topic {msg.topic} (it carries {', '.join(allowed)})")
        if header.codec not in CODECS:
            raise DecodeError(f"Avro container codec {header.codec!r} is not one of {', '.join(CODECS)}")
        records = sum(count for count, _ in blocks(msg.value, header))  # walks every sync marker
        table = TABLES[header.name]
        try:
            self._plans.plan(table, header.name, header.schema_json)
        except IncompatibleSchema as exc:
            raise DecodeError(f"{header.name} writer schema does not resolve into the reader schema: {exc}") from None
        return table, Entry(msg, header, records)

    async def _take(self, msg: Any) -> None:
        try:
            table, entry = self.check(msg)
        except DecodeError as exc:
            log.warning("dead letter from %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, exc)
            delivery = await queue_dead_letter(self._producer, self._dlq, msg, str(exc))  # type: ignore[arg-type]
            self._checkpoint.skip(msg, delivery)
            self.stats.dead_letters += 1
            return
        self._checkpoint.add(table, entry)

    # -- checkpoints --------------------------------------------------------------------------
    def _writer(self, table: str) -> TableWriter:
        writer = self._writers.get(table)
        if writer is None:
            writer = self._writers[table] = TableWriter(table, self._inserter, self._plans, self._reject)
        return writer

    async def _reject(self, msg: Any, reason: str) -> None:
        await send_dead_letter(self._producer, self._dlq, msg, reason)  # type: ignore[arg-type]
        self.stats.dead_letters += 1

    async def _write(self, table: str, entries: list[Entry]) -> None:
        writer = self._writer(table)
        before = writer.rows
        await writer.write(entries)
        self.stats.rows[table] = self.stats.rows.get(table, 0) + writer.rows - before

    async def checkpoint(self) -> None:
        """Insert everything buffered, then commit the offsets of everything consumed so far."""
        async with self._lock:
            current, self._checkpoint = self._checkpoint, Checkpoint(self.policy)
            if current.empty or self._consumer is None:
                return
            started = time.monotonic()
            self.committed.update(await current.commit(self._write, self._consumer))
            self.stats.checkpoints += 1
            log.debug("checkpoint: %d rows, %.1f MB, %d partitions in %.3fs", current.rows, current.bytes / 1e6,
                      len(current.offsets), time.monotonic() - started)

    # -- the loop -----------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        kafka = self.settings.kafka_client_kwargs()
        self._producer = AIOKafkaProducer(acks="all", **kafka)
        consumer = AIOKafkaConsumer(
            group_id=self.settings.sink_group, enable_auto_commit=False, auto_offset_reset="earliest",
            metadata_max_age_ms=30_000,
            # Messages are containers of hundreds of records: fetch several per partition per
            # round trip, or the fetch size, not ClickHouse, limits a backlog's drain rate.
            max_partition_fetch_bytes=4 * 1024 * 1024, fetch_max_bytes=16 * 1024 * 1024, **kafka,
        )
        await consumer.start()
        await self._producer.start()
        self._consumer = consumer
        try:
            # Subscribing before the topics' metadata has reached this client (a topic created moments
            # ago) joins the group with no partitions, and aiokafka would only look again minutes later.
            for topic in self._topics:
                await topic_partitions(consumer, topic)
            consumer.subscribe(list(self._topics), listener=_CheckpointOnRevoke(self))
            log.info("sink consuming %s into %s (database %s)", ", ".join(sorted(self._topics)), self.store.url,
                     self.store.database)
            while not stop.is_set():
                timeout = self._checkpoint.remaining() if not self._checkpoint.empty else 0.5
                # A bounded poll keeps a checkpoint near its row and byte limits (a poll may hold many fetches).
                batches = await consumer.getmany(timeout_ms=max(int(timeout * 1000), 10), max_records=POLL_MESSAGES)
                for messages in batches.values():
                    for msg in messages:
                        await self._take(msg)
                if self._checkpoint.due():
                    await self.checkpoint()
            await self.checkpoint()
        finally:
            self._inserter.close()
            await self._producer.stop()
            await consumer.stop()


class _CheckpointOnRevoke(ConsumerRebalanceListener):
    """Before partitions move to another sink, write and commit what was read from them."""

    def __init__(self, sink: ClickHouseSink):
        self._sink = sink

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        if revoked:
            await self._sink.checkpoint()

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        if assigned:
            self._sink.assigned.set()


async def serve(settings: Settings, store: Store, batch_rows: int = 100_000, flush_interval: float = 1.0,
                max_bytes: int = 64 * 1024 * 1024, stop: asyncio.Event | None = None) -> SinkStats:
    """Run the sink until SIGTERM or SIGINT (or ``stop``), then write and commit what was read.

    A checkpoint is due at ``batch_rows`` records, ``max_bytes`` of messages, or ``flush_interval``
    seconds after its first message, whichever comes first.
    """
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    sink = ClickHouseSink(settings, store, Policy(max_rows=batch_rows, max_bytes=max_bytes, interval=flush_interval))
    await sink.run(stop)
    log.info("sink stopped: rows %s, dead letters %d", sink.stats.rows, sink.stats.dead_letters)
    return sink.stats


async def drain(settings: Settings, store: Store, policy: Policy | None = None, timeout: float = 300.0) -> tuple[SinkStats, float]:
    """Run a sink until it has committed every sink topic up to the end offsets it found at start.

    Returns the stats and the seconds from its partition assignment to that point (a backlog's
    drain time). Raises TimeoutError after ``timeout`` seconds.
    """
    probe = AIOKafkaConsumer(**settings.kafka_client_kwargs())
    await probe.start()
    try:
        tps = [tp for short in SINK_TOPICS for tp in await topic_partitions(probe, settings.topic(short))]
        end = {tp: off for tp, off in (await probe.end_offsets(tps)).items() if off > 0}
    finally:
        await probe.stop()
    sink = ClickHouseSink(settings, store, policy)
    stop = asyncio.Event()
    task = asyncio.create_task(sink.run(stop))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    started = None
    try:
        while started is None or any(sink.committed.get(tp, 0) < off for tp, off in end.items()):
            if started is None and sink.assigned.is_set():
                started = loop.time()
            if task.done():
                task.result()  # the sink failed: raise its error
                raise RuntimeError("the sink stopped before it caught up")
            if loop.time() > deadline:
                left = {f"{tp.topic}[{tp.partition}]": off - sink.committed.get(tp, 0) for tp, off in end.items()}
                raise TimeoutError(f"sink did not catch up in {timeout:.0f}s; lag {left}")
            await asyncio.sleep(0.02)
        elapsed = loop.time() - started  # type: ignore[operator]
    finally:
        stop.set()
        await task
    return sink.stats, elapsed
