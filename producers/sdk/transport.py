"""``KafkaTransport``: the sender's transport (``rlpulse.producers.sdk.delivery.Transport``) to Kafka.

It owns one aiokafka producer on the sender thread's event loop: idempotent (``acks=all``, so a
retry inside the producer never duplicates or reorders), lz4-compressed. Before its first send it
creates the topics (a topic the broker auto-created would get its default partition count,
which the streams refuse). A round's messages are all handed to the producer first and their
acknowledgements awaited together; what to resend, and when, is ``rlpulse.producers.sdk.delivery``'s.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from collections.abc import Callable, Sequence

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (InvalidProducerIdMapping, MessageSizeTooLargeError, OutOfOrderSequenceNumber,
                             RecordTooLargeError, UnknownProducerId)

from rlpulse.producers.sdk.containers import MAX_MESSAGE_BYTES
from rlpulse.producers.sdk.delivery import Message, MessageTooLarge
from rlpulse.schemas import lz4_level
from rlpulse.schemas.catalogue import RAW_TOPICS
from rlpulse.base.kafka_check import connection_problem, scrub
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics_async

log = logging.getLogger(__name__)

# Errors after which the broker refuses this producer's idempotent sequence for good: only a new producer helps.
PRODUCER_LOST = (OutOfOrderSequenceNumber, UnknownProducerId, InvalidProducerIdMapping)
TOO_LARGE = (MessageSizeTooLargeError, RecordTooLargeError)
REFUSED_RETRY_S = 30.0  # between attempts while the broker refuses our credentials or certificate


class KafkaTransport:
    """Owns the aiokafka producer; runs on the sender thread's event loop."""

    def __init__(self, settings: Settings, *, max_message_bytes: int = MAX_MESSAGE_BYTES, linger_ms: int = 5):
        self.settings = settings
        self.max_message_bytes = max_message_bytes
        self.linger_ms = linger_ms
        self.producer: AIOKafkaProducer | None = None
        self._topics_ready = False
        self._interrupted = asyncio.Event()  # cuts a backoff short when the sender gives up
        self.refused: str | None = None  # why the broker refuses our credentials or certificate, while it does
        self.refusals = 0  # connection attempts the broker refused so far

    def renew(self) -> KafkaTransport:
        """A new thread's transport: a producer of its own, and what this one learnt (topics created, refusals)."""
        fresh = KafkaTransport(self.settings, max_message_bytes=self.max_message_bytes, linger_ms=self.linger_ms)
        fresh._topics_ready = self._topics_ready
        fresh.refused, fresh.refusals = self.refused, self.refusals
        return fresh

    def interrupt(self) -> None:
        """End any backoff wait now (call on the transport's loop)."""
        self._interrupted.set()

    async def _backoff(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._interrupted.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    # -- the producer ----------------------------------------------------------------------
    def producer_kwargs(self) -> dict[str, Any]:
        return dict(
            acks="all", enable_idempotence=True,  # a retry inside the producer never duplicates or reorders
            compression_type="lz4", linger_ms=self.linger_ms,
            max_batch_size=self.max_message_bytes, max_request_size=self.max_message_bytes,
            request_timeout_ms=10_000, **self.settings.kafka_client_kwargs())

    async def start(self, stopping: Callable[[], bool]) -> bool:
        """Create the topics (once) and start the producer, retrying with backoff; False if stopped first.

        At once when the producer runs; after one was dropped (``send``), a new one.
        """
        if self.producer is not None:
            return True
        backoff = 0.1
        while not stopping():
            producer = None
            try:
                if not self._topics_ready:
                    # Before the first send: a topic the broker auto-creates gets its default
                    # partition count, which the streams then refuse (see rlpulse.schemas.topics).
                    await ensure_topics_async(self.settings)
                    self._topics_ready = True
                lz4_level.install()  # lz4's fast mode, not aiokafka's level 9 (rlpulse.schemas.lz4_level)
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

    async def close(self) -> None:
        """Stop the producer; after interrupt() only briefly, since its flush may wait for a broker that is down."""
        if self.producer is not None:
            producer, self.producer = self.producer, None
            try:
                await asyncio.wait_for(producer.stop(), 2.0 if self._interrupted.is_set() else None)
            except asyncio.TimeoutError:
                log.warning("Kafka producer did not stop within 2s; abandoning what it still held")

    async def send(self, messages: Sequence[Message]) -> list[BaseException | None]:
        """Hand all of ``messages`` to the producer, then await their acknowledgements together."""
        assert self.producer is not None
        futures = []
        error: BaseException | None = None
        for m in messages:
            try:  # send() only queues in the producer; it waits when a partition's batch is full
                futures.append(await self.producer.send(m.topic, value=m.value, key=m.key))
            except Exception as exc:  # e.g. the producer's buffer stayed full: resend from here
                error = exc
                break
        acks = await asyncio.gather(*futures, return_exceptions=True)
        if any(isinstance(r, PRODUCER_LOST) for r in acks):
            await self._drop_producer()
        results: list[BaseException | None] = [
            None if not isinstance(r, BaseException) else MessageTooLarge(str(r)) if isinstance(r, TOO_LARGE) else r
            for r in acks]
        return results + [error] * (len(messages) - len(futures))

    async def _drop_producer(self) -> None:
        """Drop a producer whose idempotence state the broker no longer accepts; ``start`` makes a new one.

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
            except Exception:  # its pending batches fail with it; the sender resends them
                pass
