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
from aiokafka.errors import MessageSizeTooLargeError, RecordTooLargeError

from producers.queue import Item
from rlpulse.settings import Settings
from schemas.catalogue import RAW_TOPICS
from schemas.codec import Codec
from schemas.topics import ensure_topics_async

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1024 * 1024  # the broker's default message.max.bytes is 1 MiB (+12)
BATCH_RECORDS = 1000
# A Kafka record batch header plus one record's framing (aiokafka's own estimate is 61 + 21 +
# varints); kept generous so a container we accept is never refused by the producer.
KAFKA_OVERHEAD = 256
BLOCK_OVERHEAD = 32  # a container block's record count, byte size and sync marker


@dataclass
class Container:
    topic: str
    key: bytes
    schema: str
    records: list[dict[str, Any]]  # kept until acknowledged: a too-large refusal re-splits them
    sizes: list[int]  # each record's bytes in the queue's accounting
    value: bytes = b""

    @property
    def size(self) -> int:
        return sum(self.sizes)


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
        """Build, group and encode ``items``; returns the containers and the sizes of items given up on.

        A record that cannot be built or encoded (a bug, never the caller's bad argument, which
        the call refused) is logged and given up on instead of blocking everything after it.
        """
        groups: dict[tuple[str, str, str], tuple[list[dict[str, Any]], list[int]]] = {}
        lost: list[int] = []
        for channel, seq, size, args in items:
            try:
                record = channel.build(seq, args)
            except Exception:
                log.exception("could not build a %s record; dropped", channel.schema)
                lost.append(size)
                continue
            group = groups.get(channel.group)
            if group is None:
                group = groups[channel.group] = ([], [])
            group[0].append(record)
            group[1].append(size)
        out: list[Container] = []
        for (topic, key, schema), (records, sizes) in groups.items():
            key_bytes = key.encode()
            budget = self.max_message_bytes - self.header_bytes(schema) - len(key_bytes) - KAFKA_OVERHEAD
            start = used = 0
            for i, size in enumerate(sizes):  # cut by count and by the estimated bytes
                if i > start and (i - start >= self.batch_records or used + size > budget):
                    self._encode_into(out, Container(topic, key_bytes, schema, records[start:i], sizes[start:i]), lost)
                    start, used = i, 0
                used += size
            if start < len(records):
                self._encode_into(out, Container(topic, key_bytes, schema, records[start:], sizes[start:]), lost)
        return out, lost

    def _encode_into(self, out: list[Container], c: Container, lost: list[int]) -> None:
        """Encode ``c``; halve it while it is over the limit or holds a record that does not encode."""
        try:
            c.value = self.codec.encode(c.schema, c.records)
            fits = len(c.value) + len(c.key) + KAFKA_OVERHEAD <= self.max_message_bytes
            error = None if fits else f"{len(c.value)} bytes encoded, over the {self.max_message_bytes}-byte message limit"
        except ValueError as exc:
            error = str(exc)
        if error is None:
            out.append(c)
        elif len(c.records) == 1:
            log.error("a %s record for %s could not be sent (%s); dropped", c.schema, c.topic, error)
            lost.append(c.sizes[0])
        else:
            half = len(c.records) // 2
            for part in (slice(None, half), slice(half, None)):
                self._encode_into(out, Container(c.topic, c.key, c.schema, c.records[part], c.sizes[part]), lost)

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
                return True
            except Exception as exc:
                if producer is not None:
                    await producer.stop()
                log.warning("Kafka not reachable at %s (%s: %s); retrying in %.1fs", self.settings.kafka_bootstrap,
                            type(exc).__name__, exc, backoff)
                await self._backoff(backoff)
                backoff = min(backoff * 2, 5.0)
        return False

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
                elif isinstance(result, (MessageSizeTooLargeError, RecordTooLargeError)) :
                    failed.extend(self._split(c, lost))  # the broker's limit is below ours: halve and resend
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
            todo = failed
        return []

    def _split(self, c: Container, lost: list[int]) -> list[Container]:
        if len(c.records) == 1:
            log.error("the broker refused a %s record of %d bytes as too large; dropped", c.schema, len(c.value))
            lost.append(c.sizes[0])
            return []
        out: list[Container] = []
        half = len(c.records) // 2
        for part in (slice(None, half), slice(half, None)):
            self._encode_into(out, Container(c.topic, c.key, c.schema, c.records[part], c.sizes[part]), lost)
        return out
