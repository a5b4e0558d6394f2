"""The Kafka -> ClickHouse sink: gather rows per table, insert in blocks, then commit offsets.

A checkpoint (as in quixstreams) flushes every table's buffer and only then commits the
consumer's offsets, so a crash between the two replays the range; the insert's
deduplication token and the ReplacingMergeTree key make that replay leave the same rows.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from clickhouse_connect.driver.exceptions import DataError, OperationalError

from rlpulse.settings import DLQ_TOPIC, SCHEMAS_TOPIC, Settings
from schemas.codec import Codec, DecodeError
from schemas.registry import SchemaResolver, topic_partitions
from sinks.clickhouse import Store
from sinks.dlq import send_dead_letter
from sinks.rows import TABLES, TOPIC_RECORDS

log = logging.getLogger(__name__)


@dataclass
class _Buffer:
    rows: list[list[Any]] = field(default_factory=list)
    messages: list[Any] = field(default_factory=list)  # the Kafka message of each row, for dead letters
    # (topic, partition) -> [first offset, last offset] of the messages in ``rows``
    ranges: dict[tuple[str, int], list[int]] = field(default_factory=dict)

    def add(self, row: list[Any], topic: str, partition: int, offset: int, message: Any = None) -> None:
        self.rows.append(row)
        self.messages.append(message)
        span = self.ranges.setdefault((topic, partition), [offset, offset])
        span[1] = offset

    def token(self, table: str) -> str:
        return table + ";" + ";".join(f"{t}:{p}:{a}-{b}" for (t, p), (a, b) in sorted(self.ranges.items()))

    def split(self) -> tuple["_Buffer", "_Buffer"]:
        halves = (_Buffer(), _Buffer())
        middle = len(self.rows) // 2
        for i, (row, msg) in enumerate(zip(self.rows, self.messages)):
            halves[i >= middle].add(row, msg.topic, msg.partition, msg.offset, msg)
        return halves


@dataclass
class SinkStats:
    rows: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dead_letters: int = 0
    checkpoints: int = 0


class ClickHouseSink:
    """Consumes the raw and derived topics into the tables of ``store``."""

    def __init__(self, settings: Settings, store: Store, batch_rows: int = 5000, flush_interval: float = 1.0):
        self.settings = settings
        self.store = store
        self.batch_rows = batch_rows
        self.flush_interval = flush_interval
        self.stats = SinkStats()
        self._topics = {settings.topic(short): short for short in TOPIC_RECORDS}
        self._buffers: dict[str, _Buffer] = defaultdict(_Buffer)
        self._buffered = 0
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        # Fault injection for the crash tests: SIGKILL this process after N inserts, before the commit.
        self._kill_after = int(os.environ.get("RLPULSE_FAULT_KILL_AFTER_INSERTS", "0"))
        self._inserts = 0

    async def run(self, stop: asyncio.Event) -> None:
        kafka = self.settings.kafka_client_kwargs()
        self._producer = AIOKafkaProducer(acks="all", **kafka)
        resolver = SchemaResolver(Codec(), self.settings.topic(SCHEMAS_TOPIC), kafka)
        consumer = AIOKafkaConsumer(
            group_id=self.settings.sink_group, enable_auto_commit=False, auto_offset_reset="earliest",
            max_poll_records=self.batch_rows, metadata_max_age_ms=30_000, **kafka,
        )
        producer = self._producer
        await consumer.start()
        await producer.start()
        self._consumer = consumer
        # Subscribing before the topics' metadata has reached this client (a topic created moments
        # ago) joins the group with no partitions, and aiokafka would only look again minutes later.
        for topic in self._topics:
            await topic_partitions(consumer, topic)
        consumer.subscribe(list(self._topics), listener=_CheckpointOnRevoke(self))
        log.info("sink consuming %s into %s (database %s)", ", ".join(sorted(self._topics)), self.store.url, self.store.database)
        last_checkpoint = time.monotonic()
        try:
            while not stop.is_set():
                batches = await consumer.getmany(timeout_ms=200, max_records=self.batch_rows)
                for tp, messages in batches.items():
                    for msg in messages:
                        await self._take(msg, resolver, producer)
                due = time.monotonic() - last_checkpoint >= self.flush_interval
                if self._buffered >= self.batch_rows or (due and batches) or (due and self._buffered):
                    await self.checkpoint()
                    last_checkpoint = time.monotonic()
            await self.checkpoint()
        finally:
            await producer.stop()
            await consumer.stop()

    async def _take(self, msg: Any, resolver: SchemaResolver, producer: AIOKafkaProducer) -> None:
        short = self._topics[msg.topic]
        try:
            decoded = await resolver.decode(msg.value)
            if decoded.name not in TOPIC_RECORDS[short]:
                raise DecodeError(f"record type {decoded.name} does not belong on topic {msg.topic}")
            spec = TABLES[decoded.name]
            row = spec.row(decoded.record)
        except DecodeError as exc:
            await send_dead_letter(producer, self.settings.topic(DLQ_TOPIC), msg, str(exc))
            self.stats.dead_letters += 1
            log.warning("dead letter from %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, exc)
            return
        self._buffers[spec.table].add(row, msg.topic, msg.partition, msg.offset, msg)
        self._buffered += 1

    async def checkpoint(self) -> None:
        """Insert every buffered row, then commit the offsets of everything consumed so far."""
        for table, buf in list(self._buffers.items()):
            if buf.rows:
                await self._insert(table, buf)
                self.stats.rows[table] += len(buf.rows)
        self._buffers.clear()
        self._buffered = 0
        if self._consumer is not None and self._consumer.assignment():
            await self._consumer.commit()
        self.stats.checkpoints += 1

    async def _insert(self, table: str, buf: _Buffer) -> None:
        """Insert ``buf``; retry while ClickHouse is unreachable; dead-letter the rows it rejects.

        Unreachable (an OperationalError) is retried with backoff for as long as it lasts, so
        nothing is dropped and the sink does not spin. Any other error is retried twice (a busy
        server), then the batch is split in halves until the rows ClickHouse rejects stand
        alone; those go to the dead-letter topic with the reason, and the rest are inserted.
        """
        spec = next(s for s in TABLES.values() if s.table == table)
        backoff, failures = 0.2, 0
        while True:
            try:
                columns = [list(column) for column in zip(*buf.rows)]  # column-oriented: no transpose in the driver
                await asyncio.to_thread(
                    self.store.client.insert, f"{self.store.database}.{table}", columns, column_names=list(spec.columns),
                    column_oriented=True, settings={"insert_deduplication_token": buf.token(table)},
                )
                self._inserts += 1
                if self._kill_after and self._inserts >= self._kill_after:
                    log.warning("fault injection: SIGKILL after %d inserts, before the offset commit", self._inserts)
                    os.kill(os.getpid(), signal.SIGKILL)
                return
            except OperationalError as exc:  # ClickHouse unreachable: keep the rows, back off, retry
                reason = exc
            except Exception as exc:
                failures += 1
                if failures > 2 or isinstance(exc, (DataError, ValueError, TypeError)):
                    await self._isolate(table, buf, exc)
                    return
                reason = exc
            log.warning("insert of %d rows into %s failed (%s: %s); retrying in %.1fs",
                        len(buf.rows), table, type(reason).__name__, str(reason).splitlines()[0][:200], backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)

    async def _isolate(self, table: str, buf: _Buffer, exc: Exception) -> None:
        if len(buf.rows) == 1:
            msg = buf.messages[0]
            reason = f"ClickHouse rejected the {table} row: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            await send_dead_letter(self._producer, self.settings.topic(DLQ_TOPIC), msg, reason)
            self.stats.dead_letters += 1
            self.stats.rows[table] -= 1
            log.warning("dead letter from %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, reason)
            return
        for half in buf.split():
            await self._insert(table, half)


class _CheckpointOnRevoke(ConsumerRebalanceListener):
    """Before partitions move to another sink, write and commit what was read from them."""

    def __init__(self, sink: ClickHouseSink):
        self._sink = sink

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        if revoked and self._sink._buffered:
            await self._sink.checkpoint()

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        pass


async def serve(settings: Settings, store: Store, batch_rows: int = 5000, flush_interval: float = 1.0) -> SinkStats:
    """Run the sink until SIGTERM or SIGINT, then write and commit what was read."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sink = ClickHouseSink(settings, store, batch_rows=batch_rows, flush_interval=flush_interval)
    await sink.run(stop)
    log.info("sink stopped: rows %s, dead letters %d", dict(sink.stats.rows), sink.stats.dead_letters)
    return sink.stats
