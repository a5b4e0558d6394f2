"""Background sender: a buffer bounded in bytes, drained to Kafka by one thread running aiokafka.

The training thread only validates, encodes and enqueues (``offer``); it never waits on the
network. An event that would take the buffer past its byte budget is dropped and counted. An
event counts against the budget until the broker has acknowledged it, so while the broker is
down the budget bounds everything undelivered, and a failed send is retried with backoff until
the broker is back.
"""

from __future__ import annotations

import asyncio
import collections
import logging
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
DEFAULT_BUFFER_BYTES = 64 * 1024 * 1024
DROP_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class Outgoing:
    topic: str
    key: str
    schema: str
    record: dict[str, Any]


class Sender:
    """Thread-safe: ``offer`` from any thread; one background thread sends."""

    def __init__(self, settings: Settings, codec: Codec | None = None, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                 batch: int = 500):
        self._settings = settings
        self._codec = codec or Codec()
        self.buffer_bytes = buffer_bytes
        self._queue: collections.deque[tuple[str, bytes, bytes]] = collections.deque()
        self._batch = batch
        self._lock = threading.Condition()
        self._pending = 0  # offered and not yet delivered
        self._pending_bytes = 0
        self.dropped = 0
        self.delivered = 0
        self._last_drop_log = 0.0
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name="rlpulse-sender", daemon=True)
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def offer(self, item: Outgoing) -> bool:
        """Encode and enqueue without blocking; False (counted in ``dropped``) when over the byte budget.

        A record that does not fit its schema raises ValueError naming the field.
        """
        value = self._codec.encode(item.schema, item.record)
        key = item.key.encode()
        size = len(value) + len(key)
        with self._lock:
            if self._pending_bytes + size > self.buffer_bytes:
                self.dropped += 1
                now = time.monotonic()
                if now - self._last_drop_log >= DROP_LOG_INTERVAL_S:
                    self._last_drop_log = now
                    log.warning("telemetry buffer full (%d bytes undelivered): %d events dropped so far",
                                self._pending_bytes, self.dropped)
                return False
            self._queue.append((item.topic, key, value))
            self._pending += 1
            self._pending_bytes += size
        return True

    @property
    def pending(self) -> int:
        """Events offered and not yet delivered."""
        return self._pending

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

    async def _start_producer(self) -> AIOKafkaProducer | None:
        backoff = 0.1
        while not self._closing.is_set():
            producer = AIOKafkaProducer(acks="all", linger_ms=5, request_timeout_ms=10_000,
                                        **self._settings.kafka_client_kwargs())
            try:
                await producer.start()
                await publish_schemas(producer, self._settings.topic(SCHEMAS_TOPIC), self._codec, WRITER_SCHEMAS)
                return producer
            except Exception as exc:
                await producer.stop()
                log.warning("Kafka not reachable at %s (%s); retrying in %.1fs", self._settings.kafka_bootstrap,
                            type(exc).__name__, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
        return None

    async def _run(self) -> None:
        producer = await self._start_producer()
        if producer is None:
            return
        try:
            while not (self._closing.is_set() and not self._queue):
                items = self._take_batch()
                if not items:
                    await asyncio.sleep(0.01)
                    continue
                await self._send_batch(producer, items)
        finally:
            await producer.stop()

    def _take_batch(self) -> list[tuple[str, bytes, bytes]]:
        items = []
        with self._lock:
            while self._queue and len(items) < self._batch:
                items.append(self._queue.popleft())
        return items

    async def _send_batch(self, producer: AIOKafkaProducer, items: list[tuple[str, bytes, bytes]]) -> None:
        backoff = 0.1
        while items:
            results = await asyncio.gather(*(_send_one(producer, *item) for item in items), return_exceptions=True)
            failed = [item for item, result in zip(items, results) if isinstance(result, Exception)]
            self._done([item for item, result in zip(items, results) if not isinstance(result, Exception)])
            if failed:
                error = next(r for r in results if isinstance(r, Exception))
                log.warning("%d events not delivered (%s); retrying in %.1fs", len(failed), type(error).__name__, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            items = failed

    def _done(self, delivered: list[tuple[str, bytes, bytes]]) -> None:
        with self._lock:
            self.delivered += len(delivered)
            self._pending -= len(delivered)
            self._pending_bytes -= sum(len(k) + len(v) for _, k, v in delivered)
            self._lock.notify_all()


async def _send_one(producer: AIOKafkaProducer, topic: str, key: bytes, value: bytes) -> None:
    delivery = await producer.send(topic, value=value, key=key)
    await delivery
