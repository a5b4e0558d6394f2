"""The Kafka side of the sender: queued events -> Avro containers -> acknowledged messages.

Events are grouped by (topic, key, record type) and each group becomes one or more Avro
Object Container Files (``schemas.codec.Codec.encode``) of up to ``batch_records`` records,
always below ``max_message_bytes``. All of a round's containers are handed to the producer
first and their delivery futures awaited together; failed ones are sent again, in their
order, with backoff. The producer is idempotent (``acks=all``) and lz4-compressed.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (InvalidProducerIdMapping, MessageSizeTooLargeError, OutOfOrderSequenceNumber,
                             RecordTooLargeError, UnknownProducerId)

from rlpulse.producers.queue import Item
from rlpulse.schemas.settings import Settings
from rlpulse.schemas.catalogue import RAW_TOPICS
from rlpulse.schemas.codec import Codec
from rlpulse.schemas.kafka_check import connection_problem, scrub
from rlpulse.schemas.topics import ensure_topics_async

log = logging.getLogger(__name__)

# Errors after which the broker refuses this producer's idempotent sequence for good: only a new producer helps.
PRODUCER_LOST = (OutOfOrderSequenceNumber, UnknownProducerId, InvalidProducerIdMapping)

MAX_MESSAGE_BYTES = 1024 * 1024  # the broker's default message.max.bytes is 1 MiB (+12)
BATCH_RECORDS = 1000
# A Kafka record batch header plus one record's framing (aiokafka's own estimate is 61 + 21 +
# varints); kept generous so a container we accept is never refused by the producer.
KAFKA_OVERHEAD = 256
BLOCK_OVERHEAD = 32  # a container block's record count, byte size and sync marker
REFUSED_RETRY_S = 30.0  # between attempts while the broker refuses our credentials or certificate


@dataclass
class Container:
    topic: str
    key: bytes
    schema: str
    items: list[Item]  # the queue's items, kept until acknowledged (they count in its budget)
    value: bytes = b""

    @property
    def size(self) -> int:
        return sum(item[2] for item in self.items)


class KafkaTransport:
    """Owns the aiokafka producer; runs on the sender thread's event loop."""

    def __init__(self, settings: Settings, codec: Codec | None = None, *, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 batch_records: int = BATCH_RECORDS, linger_ms: int = 5):
        self.settings = settings
        self.codec = codec or Codec()
        self.max_message_bytes = max_message_bytes
        self.batch_records = batch_records
        self.linger_ms = linger_ms
        self._headers: dict[str, int] = {}
        self.producer: AIOKafkaProducer | None = None
        self._topics_ready = False
        self._interrupted = asyncio.Event()  # cuts a backoff short when the sender gives up
        self.refused: str | None = None  # why the broker refuses our credentials or certificate, while it does
        self.refusals = 0  # connection attempts the broker refused so

    def adopt(self, previous: "KafkaTransport") -> None:
        """Take over what ``previous`` learnt (topics created, header sizes): a new thread's transport."""
        self._topics_ready = previous._topics_ready
        self._headers = dict(previous._headers)
        self.refused, self.refusals = previous.refused, previous.refusals

    def interrupt(self) -> None:
        """End any backoff wait now (call on the transport's loop)."""
        self._interrupted.set()

    async def _backoff(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._interrupted.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    # -- sizes -----------------------------------------------------------------------------
    def header_bytes(self, schema: str) -> int:
        """Bytes of a container of ``schema`` with no records (its header carries the schema)."""
        size = self._headers.get(schema)
        if size is None:
            size = self._headers[schema] = len(self.codec.encode(schema, []))
        return size

    def max_record_bytes(self, schema: str, key: str) -> int:
        """The largest encoded record of ``schema`` under ``key`` that still fits in one message."""
        return self.max_message_bytes - self.header_bytes(schema) - len(key.encode()) - KAFKA_OVERHEAD - BLOCK_OVERHEAD

    # -- encoding --------------------------------------------------------------------------
    def encode(self, items: list[Item]) -> tuple[list[Container], list[int]]:
        """Group ``items`` and encode each group's containers; returns them and the sizes of items given up on.

        Records are built one container at a time, so at most one container's record dicts
        exist at once. A record that cannot be built or encoded (a bug, never a caller's bad
        argument, which the call refused) is logged and given up on instead of blocking the rest.
        """
        groups: dict[tuple[str, str, str], list[Item]] = {}
        for item in items:
            group = groups.get(item[0].group)
            if group is None:
                group = groups[item[0].group] = []
            group.append(item)
        out: list[Container] = []
        lost: list[int] = []
        for (topic, key, schema), group in groups.items():
            key_bytes = key.encode()
            budget = self.max_message_bytes - self.header_bytes(schema) - len(key_bytes) - KAFKA_OVERHEAD
            start = used = 0
            for i, item in enumerate(group):  # cut by count and by the estimated bytes
                if i > start and (i - start >= self.batch_records or used + item[2] > budget):
                    self._encode_into(out, Container(topic, key_bytes, schema, group[start:i]), lost)
                    start, used = i, 0
                used += item[2]
            if start < len(group):
                self._encode_into(out, Container(topic, key_bytes, schema, group[start:]), lost)
        return out, lost

    def _encode_into(self, out: list[Container], c: Container, lost: list[int]) -> None:
        """Build and encode ``c``; halve it while it is over the limit or holds a record that does not encode."""
        records, good = [], []
        for item in c.items:
            try:
                records.append(item[0].build(item[1], item[3]))
                good.append(item)
            except Exception:
                log.exception("could not build a %s record; dropped", c.schema)
                lost.append(item[2])
        if not good:
            return
        c.items = good
        try:
            c.value = self.codec.encode(c.schema, records)
            fits = len(c.value) + len(c.key) + KAFKA_OVERHEAD <= self.max_message_bytes
            error = None if fits else f"{len(c.value)} bytes encoded, over the {self.max_message_bytes}-byte message limit"
        except ValueError as exc:
            error = str(exc)
        if error is None:
            out.append(c)
        else:
            self._halve(out, c, lost, error)

    def _halve(self, out: list[Container], c: Container, lost: list[int], error: str) -> None:
        if len(c.items) == 1:
            log.error("a %s record for %s could not be sent (%s); dropped", c.schema, c.topic, error)
            lost.append(c.items[0][2])
            return
        half = len(c.items) // 2
        for part in (c.items[:half], c.items[half:]):
            self._encode_into(out, Container(c.topic, c.key, c.schema, part), lost)

    # -- the producer ----------------------------------------------------------------------
    def producer_kwargs(self) -> dict[str, Any]:
        return dict(
            acks="all", enable_idempotence=True,  # a retry inside the producer never duplicates or reorders
            compression_type="lz4", linger_ms=self.linger_ms,
            max_batch_size=self.max_message_bytes, max_request_size=self.max_message_bytes,
            request_timeout_ms=10_000, **self.settings.kafka_client_kwargs())

    async def start(self, stopping: Callable[[], bool]) -> bool:
        """Create the topics (once) and start the producer, retrying with backoff; False if stopped first."""
        backoff = 0.1
        while not stopping():
            producer = None
            try:
                if not self._topics_ready:
                    # Before the first send: a topic the broker auto-creates gets its default
                    # partition count, which the streams then refuse (see schemas.topics).
                    await ensure_topics_async(self.settings)
                    self._topics_ready = True
                producer = AIOKafkaProducer(**self.producer_kwargs())
                await producer.start()
                for short in RAW_TOPICS:  # fresh topics: learn their leaders before the first send
                    await producer.partitions_for(self.settings.topic(short))
                self.producer = producer
                self.refused = None
                return True
            except Exception as exc:
                if producer is not None:
                    await producer.stop()
                # aiokafka says only "Unable to bootstrap": ask the broker why once, with our settings.
                problem = await connection_problem(self.settings)
                if problem is not None and problem.refused:
                    # A wrong password or certificate stays wrong: say so once, clearly, and retry
                    # rarely (the credentials may be fixed on the broker's side); never crash the job.
                    self.refusals += 1
                    if problem.message != self.refused:
                        log.error("telemetry cannot be delivered, events wait in the buffer: %s (retrying every %.0fs)",
                                  problem.message, REFUSED_RETRY_S)
                    self.refused = problem.message
                    await self._backoff(REFUSED_RETRY_S)
                    continue
                log.warning("Kafka not reachable at %s (%s: %s); retrying in %.1fs", self.settings.kafka_bootstrap,
                            type(exc).__name__, scrub(str(exc), self.settings), backoff)
                await self._backoff(backoff)
                backoff = min(backoff * 2, 5.0)
        return False

    async def _renew(self, stopping: Callable[[], bool]) -> bool:
        """Replace a producer whose idempotence state the broker no longer accepts; False if stopped first.

        After a broker restart with batches in flight, the broker may refuse the producer's next
        sequence number for good (aiokafka #1017): retrying on the same producer would fail for
        ever while the buffer fills. A new producer gets a new id. What the broker had already
        written of the resent batches comes twice; the streams' sequence marks and the tables'
        keys make that change nothing.
        """
        log.warning("the broker no longer accepts this producer's sequence numbers; starting a new producer")
        old, self.producer = self.producer, None
        if old is not None:
            try:
                await asyncio.wait_for(old.stop(), 2.0)
            except Exception:  # its pending batches fail with it; the caller resends them
                pass
        return await self.start(stopping)

    async def stop(self) -> None:
        """Stop the producer; after interrupt() only briefly, since its flush may wait for a broker that is down."""
        if self.producer is not None:
            producer, self.producer = self.producer, None
            try:
                await asyncio.wait_for(producer.stop(), 2.0 if self._interrupted.is_set() else None)
            except asyncio.TimeoutError:
                log.warning("Kafka producer did not stop within 2s; abandoning what it still held")

    async def deliver(self, containers: list[Container], on_done: Callable[[list[Container], list[int]], None],
                      stopping: Callable[[], bool]) -> list[Container]:
        """Send all, await the acknowledgements together, resend failures in order with backoff.

        ``on_done(delivered, lost_sizes)`` is called as containers are acknowledged (or given up
        on). Returns what is still undelivered when ``stopping()`` turned true.
        """
        assert self.producer is not None
        backoff = 0.1
        todo = containers
        while todo:
            futures = []
            error: BaseException | None = None
            for c in todo:
                try:  # send() only queues in the producer; it waits when a partition's batch is full
                    futures.append(await self.producer.send(c.topic, value=c.value, key=c.key))
                except Exception as exc:  # e.g. the producer's buffer stayed full: resend from here
                    error = exc
                    break
            acks = asyncio.ensure_future(asyncio.gather(*futures, return_exceptions=True))
            # The idempotent producer retries a batch until the broker takes it: while the broker
            # is down only interrupt() (the caller gave up) ends this wait.
            interrupted = asyncio.ensure_future(self._interrupted.wait())
            await asyncio.wait((acks, interrupted), return_when=asyncio.FIRST_COMPLETED)
            interrupted.cancel()
            if not acks.done():
                acks.cancel()
                return todo
            results = acks.result()
            delivered, failed, lost = [], [], []
            for c, result in zip(todo, results):
                if not isinstance(result, BaseException):
                    delivered.append(c)
                elif isinstance(result, (MessageSizeTooLargeError, RecordTooLargeError)):
                    split: list[Container] = []  # the broker's limit is below ours: halve and resend
                    self._halve(split, c, lost, f"the broker refused {len(c.value)} bytes as too large")
                    failed.extend(split)
                else:
                    error = error or result
                    failed.append(c)
            failed.extend(todo[len(futures):])
            on_done(delivered, lost)
            if not failed:
                return []
            if stopping():
                return failed
            if error is not None:
                log.warning("%d telemetry messages not delivered (%s: %s); retrying in %.1fs", len(failed),
                            type(error).__name__, error, backoff)
                await self._backoff(backoff)
                backoff = min(backoff * 2, 5.0)
                if any(isinstance(r, PRODUCER_LOST) for r in results) and not await self._renew(stopping):
                    return failed
            todo = failed
        return []
