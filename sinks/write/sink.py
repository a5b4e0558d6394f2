"""The Kafka -> ClickHouse sink: check each message's framing, buffer it, and at each checkpoint
have ClickHouse decode the buffered containers in one insert per table.

Per message, on the hot path, only the container framing is read in Python (magic, header,
block sizes and sync markers: ``rlpulse.schemas.codec.read_header`` and ``blocks``), and its record
type is checked against the topic, its writer schema against the reader schema, and its size
against the sink's :class:`Limits` (``rlpulse.sinks.write.message_checks``). Anything that fails goes to the
dead-letter topic with the reason, and the sink goes on. No record is decoded here: ClickHouse decodes every table (see
``rlpulse.sinks.store.avro_sql``).

Two parts, as in quixstreams: a :class:`~rlpulse.sinks.write.checkpoint.Checkpoint` decides when to commit
and commits offsets only after every table's insert is in; a :class:`~rlpulse.sinks.write.writer.TableWriter`
writes one table's batch with its retry policy. A checkpoint is written in a task while the
poll loop waits; when an insert fails (ClickHouse busy, read-only, unreachable) or takes long,
the loop pauses every assigned partition and keeps calling ``getmany``, so the consumer stays in
its group however long the outage lasts, and resumes once the checkpoint is in. A stop
(SIGTERM) gives the checkpoint being written ``stop_grace`` seconds, then abandons it without
committing: the next sink reads those offsets again. Each insert has a time limit
(``insert_limit_s``, see ``rlpulse.sinks.write.writer``): a message whose insert runs past it is dead-lettered,
and an insert an engine cannot stop never holds a stop: the process exits without it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition

from rlpulse.base.settings import Settings
from rlpulse.schemas.catalogue import DLQ_TOPIC, sink_topics
from rlpulse.schemas.codec import DecodeError
from rlpulse.schemas.compression import install as bound_batches
from rlpulse.schemas.topics import topics_partitions
from rlpulse.sinks.store.avro_sql import Plans
from rlpulse.sinks.write.checkpoint import Checkpoint, Policy
from rlpulse.sinks.store.clickhouse import Store, table_columns
from rlpulse.sinks.write.content_bounds import Bounds
from rlpulse.sinks.write.dlq import queue_dead_letter, send_dead_letter
from rlpulse.sinks.write.message_checks import Limits, check_message
from rlpulse.sinks.write.writer import Backoff, Entry, TableWriter, inserter_for

log = logging.getLogger(__name__)

POLL_MESSAGES = 256
SLOW_FLUSH_S = 15.0  # a checkpoint still being written after this long is treated as stalled: pause and poll


@dataclass
class SinkStats:
    rows: dict[str, int] = field(default_factory=dict)
    dead_letters: int = 0
    checkpoints: int = 0
    retries: int = 0  # failed inserts retried
    pauses: int = 0  # times consumption was paused for a failing or slow checkpoint
    assignments: int = 0  # partition assignments received (1 = the group never rebalanced)
    abandoned: int = 0  # checkpoints given up uncommitted (stop or revocation during an outage)


class ClickHouseSink:
    """Consumes the raw and derived topics into the tables of ``store``."""

    def __init__(self, settings: Settings, store: Store, policy: Policy | None = None, limits: Limits | None = None,
                 backoff: Backoff | None = None, stop_grace: float = 5.0, max_poll_interval_ms: int = 300_000,
                 insert_limit_s: float = 30.0):
        self.settings = settings
        self.store = store
        self.policy = policy or Policy()
        self.limits = limits or Limits()
        self.stats = SinkStats()
        self._topics = {settings.topic(short): short for short in sink_topics(settings.sink_raw)}
        self._dlq = settings.topic(DLQ_TOPIC)
        self._plans = Plans(table_columns(store))
        # The spans' content caps (rlpulse.sinks.write.content_bounds): only the INSERT's SELECT changes.
        self._bounds = Bounds(settings.span_cap, settings.sink_content_max_chars)
        self._inserter = inserter_for(store, settings.faults, insert_limit_s)  # the faults the tests switch on, if any
        self.insert_left_running = False  # set at the stop: an insert the engine could not stop is still running
        self._backoff = backoff or Backoff()
        self._stop_grace = stop_grace
        self._max_poll_interval_ms = max_poll_interval_ms
        self._writers: dict[str, TableWriter] = {}
        self._checkpoint = Checkpoint(self.policy)
        self._lock = asyncio.Lock()  # one checkpoint written at a time
        self._flush: asyncio.Task | None = None  # the checkpoint being written
        self._flush_started = 0.0
        self._failing_since: float | None = None  # an insert of the checkpoint being written failed
        self._paused_at: float | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self.assigned = asyncio.Event()  # set once partitions are assigned (the bench times from here)
        self.committed: dict[TopicPartition, int] = {}  # what this sink has committed to its group

    # -- intake -------------------------------------------------------------------------------
    def check(self, msg: Any) -> tuple[str, Entry]:
        """The table and entry of a consumed message; DecodeError says why it cannot be inserted."""
        return check_message(msg, self._topics, self._plans, self.limits)

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
            writer = self._writers[table] = TableWriter(table, self._inserter, self._plans, self._reject,
                                                        self._backoff, self._on_retry, self._bounds)
        return writer

    async def _reject(self, msg: Any, reason: str) -> None:
        await send_dead_letter(self._producer, self._dlq, msg, reason)  # type: ignore[arg-type]
        self.stats.dead_letters += 1

    def _on_retry(self, table: str, tries: int, exc: BaseException) -> None:
        self.stats.retries += 1
        if self._failing_since is None:
            self._failing_since = time.monotonic()

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

    def _start_flush(self) -> None:
        self._flush = asyncio.create_task(self.checkpoint(), name="rlpulse-sink-checkpoint")
        self._flush_started = time.monotonic()

    def _stalled(self) -> bool:
        return self._failing_since is not None or time.monotonic() - self._flush_started > SLOW_FLUSH_S

    def _pause(self, consumer: AIOKafkaConsumer) -> None:
        """Stop fetching (getmany still runs, so the consumer stays in its group) until the checkpoint is in."""
        todo = consumer.assignment() - consumer.paused()
        if not todo:
            return
        consumer.pause(*todo)
        if self._paused_at is None:
            self._paused_at = time.monotonic()
            self.stats.pauses += 1
            log.warning("consumption paused on %d partitions: the checkpoint being written %s; its offsets stay "
                        "uncommitted and the sink stays in its group", len(todo),
                        "has a failing insert" if self._failing_since is not None else "is slow")

    async def _settle(self, consumer: AIOKafkaConsumer) -> None:
        """The checkpoint task ended: resume consumption; raise what it raised (cancelled: nothing)."""
        task, self._flush, self._failing_since = self._flush, None, None
        if self._paused_at is not None:
            paused = consumer.paused() & consumer.assignment()
            if paused:
                consumer.resume(*paused)
            log.info("consumption resumed after %.1fs paused (checkpoint %s)", time.monotonic() - self._paused_at,
                     "abandoned" if task is not None and task.cancelled() else "written")
            self._paused_at = None
        if task is not None and not task.cancelled():
            task.result()

    async def _abandon(self, why: str) -> None:
        """Cancel the checkpoint being written and forget what was read since: nothing of it is
        committed, so whoever owns the partitions next reads it again (the inserts' dedup tokens
        and the tables' keys absorb what did get in)."""
        task = self._flush
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})
        self._checkpoint = Checkpoint(self.policy)
        self.stats.abandoned += 1
        log.warning("checkpoint abandoned uncommitted (%s); its offsets will be read again", why)

    async def _wait_flush(self, consumer: AIOKafkaConsumer) -> None:
        """One turn of the loop while a checkpoint is written: wait for it; if it fails or drags on, keep polling paused."""
        task = self._flush
        assert task is not None
        if self._stalled() and not task.done():
            self._pause(consumer)
            # Nothing comes from paused partitions; a partition assigned since the pause may deliver.
            for messages in (await consumer.getmany(timeout_ms=200, max_records=POLL_MESSAGES)).values():
                for msg in messages:
                    await self._take(msg)
        else:
            await asyncio.wait({task}, timeout=0.2)
        if task.done() and self._flush is task:
            await self._settle(consumer)

    async def on_revoked(self) -> None:
        """Before partitions move: write and commit what was read; during an outage, give it up instead
        (waiting would hold up the whole group's rebalance for as long as ClickHouse refuses inserts)."""
        if self._flush is None and not self._checkpoint.empty:
            self._start_flush()
        task = self._flush
        while task is not None and not task.done():
            if self._stalled():
                await self._abandon("partitions revoked while an insert fails")
                return
            await asyncio.wait({task}, timeout=0.2)

    async def _shutdown(self, consumer: AIOKafkaConsumer) -> None:
        """Write and commit what was read, for at most ``stop_grace`` seconds; then give it up uncommitted."""
        deadline = time.monotonic() + self._stop_grace
        if self._flush is None and not self._checkpoint.empty:
            self._start_flush()
        while self._flush is not None:
            done, _ = await asyncio.wait({self._flush}, timeout=max(deadline - time.monotonic(), 0.0))
            if not done:
                await self._abandon(f"stopping, and the checkpoint was not written in {self._stop_grace:.0f}s")
            await self._settle(consumer)
            if not self._checkpoint.empty and time.monotonic() < deadline:
                self._start_flush()  # read from partitions assigned while the last one was written

    # -- the loop -----------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        # A compressed batch over the bound reaches _take as one stand-in message, dead-lettered (docs/security.md).
        bound_batches(self.settings.kafka_batch_max_bytes, self.settings.kafka_batch_max_ratio,
                      self.settings.kafka_batch_codecs)
        kafka = self.settings.kafka_client_kwargs()
        self._producer = AIOKafkaProducer(acks="all", **kafka)
        consumer = AIOKafkaConsumer(
            group_id=self.settings.sink_group, enable_auto_commit=False, auto_offset_reset="earliest",
            metadata_max_age_ms=30_000, max_poll_interval_ms=self._max_poll_interval_ms,
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
            await topics_partitions(consumer, self._topics)
            consumer.subscribe(list(self._topics), listener=_CheckpointOnRevoke(self))
            log.info("sink consuming %s into %s (database %s)", ", ".join(sorted(self._topics)), self.store.url,
                     self.store.database)
            while not stop.is_set():
                if self._flush is not None:
                    await self._wait_flush(consumer)
                    continue
                timeout = self._checkpoint.remaining() if not self._checkpoint.empty else 0.5
                # A bounded poll keeps a checkpoint near its row and byte limits (a poll may hold many fetches).
                batches = await consumer.getmany(timeout_ms=max(int(timeout * 1000), 10), max_records=POLL_MESSAGES)
                for messages in batches.values():
                    for msg in messages:
                        await self._take(msg)
                self._checkpoint.polled(sum(map(len, batches.values())), POLL_MESSAGES)
                if self._checkpoint.due():
                    self._start_flush()
            await self._shutdown(consumer)
        finally:
            if self._flush is not None and not self._flush.done():  # an error in the loop: commit nothing more
                self._flush.cancel()
                await asyncio.wait({self._flush})
            self.insert_left_running = not self._inserter.close()
            await self._producer.stop()
            await consumer.stop()


class _CheckpointOnRevoke(ConsumerRebalanceListener):
    """Before partitions move to another sink, write and commit what was read from them."""

    def __init__(self, sink: ClickHouseSink):
        self._sink = sink

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        if revoked:
            await self._sink.on_revoked()

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        self._sink.stats.assignments += 1
        log.info("partitions assigned (%d): %s", len(assigned),
                 ", ".join(sorted(f"{tp.topic}[{tp.partition}]" for tp in assigned)) or "none")
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
    st = sink.stats
    log.info("sink stopped: rows %s, dead letters %d, inserts retried %d, checkpoints abandoned uncommitted %d",
             st.rows, st.dead_letters, st.retries, st.abandoned)
    if sink.insert_left_running:
        # An engine in this process is stuck inside a statement: closing its store would wait on it
        # (for ever, for a block claiming 2**62 items). Nothing of its checkpoint was committed.
        log.error("sink exiting with an insert still running in the engine; its offsets were not committed")
        logging.shutdown()
        os._exit(0)
    return sink.stats


async def drain(settings: Settings, store: Store, policy: Policy | None = None, timeout: float = 300.0,
                **options: Any) -> tuple[SinkStats, float]:
    """Run a sink until it has committed every sink topic up to the end offsets it found at start.

    Returns the stats and the seconds from its partition assignment to that point (a backlog's
    drain time). Raises TimeoutError after ``timeout`` seconds. ``options`` go to ClickHouseSink.
    """
    probe = AIOKafkaConsumer(**settings.kafka_client_kwargs())
    await probe.start()
    try:
        tps = await topics_partitions(probe, [settings.topic(short) for short in sink_topics(settings.sink_raw)])
        end = {tp: off for tp, off in (await probe.end_offsets(tps)).items() if off > 0}
    finally:
        await probe.stop()
    sink = ClickHouseSink(settings, store, policy, **options)
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
