"""Background sender: a bounded buffer drained to Kafka by one thread running aiokafka.

The training thread only validates and enqueues (``offer``); it never waits on the network.
A full buffer drops the event and counts it. A failed send is retried with backoff, so what
is buffered is delivered once the broker is back.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaProducer

from rlpulse.settings import SCHEMAS_TOPIC, Settings
from schemas.codec import Codec
from schemas.registry import publish_schemas

log = logging.getLogger(__name__)

# Schemas this sender may write; published once, before the first message.
WRITER_SCHEMAS = ("Span", "Step", "GpuSample", "Placement")


@dataclass(frozen=True)
class Outgoing:
    topic: str
    key: str
    schema: str
    record: dict[str, Any]


class Sender:
    """Thread-safe: ``offer`` from any thread; one background thread sends."""

    def __init__(self, settings: Settings, codec: Codec | None = None, max_events: int = 100_000, batch: int = 500):
        self._settings = settings
        self._codec = codec or Codec()
        self._queue: queue.Queue[Outgoing] = queue.Queue(maxsize=max_events)
        self._batch = batch
        self._lock = threading.Condition()
        self._pending = 0  # offered and not yet delivered (or given up on)
        self.dropped = 0
        self.delivered = 0
        self.failed = 0  # could not be encoded: a bug, logged with the reason
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name="rlpulse-sender", daemon=True)
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def offer(self, item: Outgoing) -> bool:
        """Enqueue without blocking; False (and counted in ``dropped``) when the buffer is full."""
        with self._lock:
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self.dropped += 1
                return False
            self._pending += 1
        return True

    def flush(self, timeout: float = 30.0) -> int:
        """Wait until everything offered so far is delivered; returns how many are still undelivered."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending > 0 and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(min(left, 0.1))
            return self._pending

    def close(self, timeout: float = 30.0) -> int:
        """Deliver what is buffered (up to ``timeout``), stop the thread; returns the undelivered count."""
        undelivered = self.flush(timeout)
        self._closing.set()
        if self._started:
            self._thread.join(timeout=5.0)
        return undelivered

    # -- background thread -----------------------------------------------------------------
    def _thread_main(self) -> None:
        asyncio.run(self._run())

    async def _start_producer(self) -> AIOKafkaProducer:
        backoff = 0.1
        while True:
            producer = AIOKafkaProducer(acks="all", linger_ms=5, **self._settings.kafka_client_kwargs())
            try:
                await producer.start()
                await publish_schemas(producer, self._settings.topic(SCHEMAS_TOPIC), self._codec, WRITER_SCHEMAS)
                return producer
            except Exception as exc:
                await producer.stop()
                if self._closing.is_set():
                    raise
                log.warning("Kafka not reachable at %s (%s); retrying in %.1fs", self._settings.kafka_bootstrap, type(exc).__name__, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _run(self) -> None:
        try:
            producer = await self._start_producer()
        except Exception:
            return
        try:
            while not (self._closing.is_set() and self._queue.empty()):
                items = self._take_batch()
                if not items:
                    await asyncio.sleep(0.01)
                    continue
                await self._send_batch(producer, items)
        finally:
            await producer.stop()

    def _take_batch(self) -> list[Outgoing]:
        items: list[Outgoing] = []
        while len(items) < self._batch:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return items

    async def _send_batch(self, producer: AIOKafkaProducer, items: list[Outgoing]) -> None:
        encoded = []
        for item in items:
            try:
                encoded.append((item.topic, item.key.encode(), self._codec.encode(item.schema, item.record)))
            except ValueError as exc:
                log.error("dropping %s event that does not encode: %s", item.schema, exc)
                self._done(failed=1)
        backoff = 0.1
        while encoded:
            results = await asyncio.gather(*(_send_one(producer, *e) for e in encoded), return_exceptions=True)
            retry = [e for e, r in zip(encoded, results) if isinstance(r, Exception)]
            self._done(delivered=len(encoded) - len(retry))
            if retry:
                log.warning("%d events not delivered (%s); retrying in %.1fs", len(retry), type(next(r for r in results if isinstance(r, Exception))).__name__, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            encoded = retry

    def _done(self, delivered: int = 0, failed: int = 0) -> None:
        with self._lock:
            self.delivered += delivered
            self.failed += failed
            self._pending -= delivered + failed
            self._lock.notify_all()


async def _send_one(producer: AIOKafkaProducer, topic: str, key: bytes, value: bytes) -> None:
    delivery = await producer.send(topic, value=value, key=key)
    await delivery
