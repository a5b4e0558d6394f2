"""Background sender: the bounded queue (``producers.queue``) drained to Kafka by one thread
running the transport (``producers.transport``) on its own asyncio loop.

Callers never wait on the network. The sender sleeps until a batch's worth is queued, a
linger timeout passes after the first event, or someone flushes; then it takes everything
queued, encodes it into containers and delivers them. While the broker is down it retries with
backoff and the queue's byte bound holds what waits.

Publishing a ready-made record (GPU samples, placements)::

    sender = Sender(settings); sender.start()
    sender.offer(Outgoing(settings.topic("hardware"), hw_id, "GpuSample", record))
    sender.close()
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping

from producers.events import queued_bytes
from producers.queue import UNSEQUENCED, Channel, EventQueue
from producers.transport import BATCH_RECORDS, MAX_MESSAGE_BYTES, Container, KafkaTransport
from rlpulse.settings import Settings
from schemas.codec import Codec

log = logging.getLogger(__name__)

DEFAULT_BUFFER_BYTES = 64 * 1024 * 1024
DEFAULT_LINGER_S = 0.05  # how long a partial batch waits for company before it is sent
ROUND_BATCHES = 20  # one round takes at most this many batches' worth, so acks free buffer bytes early


@dataclass(frozen=True)
class SenderConfig:
    buffer_bytes: int = DEFAULT_BUFFER_BYTES  # undelivered events past this are dropped and counted
    batch_records: int = BATCH_RECORDS  # records per container (one Kafka message), at most
    max_message_bytes: int = MAX_MESSAGE_BYTES  # the broker's message.max.bytes; containers stay below it
    linger_s: float = DEFAULT_LINGER_S
    producer_linger_ms: int = 5


@dataclass(frozen=True)
class Outgoing:
    """A ready-made record for ``Sender.offer``: topic, message key, record type and the record."""

    topic: str
    key: str
    schema: str
    record: Mapping[str, Any]


def _as_is(seq: int, record: Any) -> Any:
    return record


class Sender:
    """Thread-safe: publish from any thread; one background thread sends."""

    def __init__(self, settings: Settings, codec: Codec | None = None, buffer_bytes: int | None = None,
                 config: SenderConfig | None = None):
        config = config or SenderConfig()
        if buffer_bytes is not None:
            config = dataclasses.replace(config, buffer_bytes=buffer_bytes)
        self.config = config
        self.settings = settings
        self.codec = codec or Codec()
        self.queue = EventQueue(config.buffer_bytes, config.batch_records)
        self.transport = KafkaTransport(settings, self.codec, max_message_bytes=config.max_message_bytes,
                                        batch_records=config.batch_records, linger_ms=config.producer_linger_ms)
        self._flushing = 0  # flush() calls in progress: the sender does not linger meanwhile
        self._flush_lock = threading.Lock()
        self._closing = threading.Event()
        self._abort = threading.Event()  # close() gave up waiting: stop retrying
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._thread_main, name="rlpulse-sender", daemon=True)
        self._started = False

    # -- counters --------------------------------------------------------------------------
    @property
    def dropped(self) -> int:
        """Events dropped: the buffer was full, or (a bug) the record could not be encoded."""
        return self.queue.dropped

    @property
    def delivered(self) -> int:
        """Events the broker has acknowledged."""
        return self.queue.delivered

    @property
    def pending(self) -> int:
        """Events accepted and not yet delivered."""
        return self.queue.pending

    @property
    def buffer_bytes(self) -> int:
        return self.queue.buffer_bytes

    def max_record_bytes(self, schema: str, key: str) -> int:
        """The largest encoded ``schema`` record under ``key`` that fits in one message."""
        return self.transport.max_record_bytes(schema, key)

    # -- publishing ------------------------------------------------------------------------
    def offer(self, item: Outgoing) -> bool:
        """Queue a ready-made record without blocking; False (counted in ``dropped``) when the buffer is full.

        The record is checked against its schema here, so a bad one raises ValueError at the
        call, as does one that can never fit in a message. This path is for records that come
        seldom (hardware: one per GPU every few seconds); the SDK's hot calls use ``put``.
        """
        record = dict(item.record)
        # Encoding it once here names a bad field at the call and gives the exact size.
        size = len(self.codec.encode(item.schema, [record])) - self.transport.header_bytes(item.schema)
        limit = self.max_record_bytes(item.schema, item.key)
        if size > limit:
            raise ValueError(f"{item.schema} record of {size} bytes can never fit in one Kafka message "
                             f"(at most {limit} bytes for a record)")
        size = max(size, queued_bytes(record)) + len(item.key)  # held in memory as a dict until acknowledged
        return self.queue.put(UNSEQUENCED, Channel(item.topic, item.key, item.schema, _as_is), record, size)

    def queued_records(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(topic, key, record) of each event queued and not yet taken by the sender, built as it would send them."""
        return [(c.topic, c.key, c.build(seq, args)) for c, seq, _, args in self.queue.queued()]

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._call_soon(self._wakeup.set)

    def _call_soon(self, fn: Any) -> None:
        """Run ``fn`` on the sender's loop, from any thread."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(fn)
            except RuntimeError:  # the loop has closed: the sender is gone
                pass

    def flush(self, timeout: float = 30.0) -> int:
        """Wait until everything accepted so far is delivered; returns how many are still undelivered."""
        if not self._started:
            return self.pending
        with self._flush_lock:
            self._flushing += 1
        self._wake()
        try:
            return self.queue.wait_empty(time.monotonic() + timeout, self._thread.is_alive)
        finally:
            with self._flush_lock:
                self._flushing -= 1

    def close(self, timeout: float = 30.0) -> int:
        """Deliver what is buffered (up to ``timeout``), stop the thread; returns the undelivered count."""
        undelivered = self.flush(timeout)
        self._closing.set()
        if undelivered:
            self._abort.set()  # what is left stays undelivered: do not retry past the caller's timeout
            self._call_soon(self.transport.interrupt)
        self._wake()
        if self._started:
            self._thread.join(timeout=15.0)  # the producer's own stop may wait out its request timeout
        return self.pending if self._started else undelivered

    # -- background thread -----------------------------------------------------------------
    def _thread_main(self) -> None:
        try:
            asyncio.run(self._run())
        except Exception:  # never silently: flush() and close() notice the dead thread
            log.exception("telemetry sender stopped")
        finally:
            self.queue.notify()

    async def _run(self) -> None:
        self._wakeup = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self.queue.set_waker(self._wake)
        if not await self.transport.start(self._abort.is_set):
            return
        try:
            await self._drain()
        finally:
            self.queue.set_waker(lambda: None)
            await self.transport.stop()

    async def _drain(self) -> None:
        batch = self.config.batch_records
        while not self._abort.is_set():
            # Sleep until an event is queued (close() wakes it too; an empty queue has nothing
            # for a flush to hurry) ...
            if self.queue.arm(1):
                if self._closing.is_set():
                    return
                await self._sleep(None)
            # ... then linger for a batch's worth, unless someone is waiting for delivery.
            if not self._hurry() and self.queue.arm(batch):
                await self._sleep(self.config.linger_s, hurry=True)
            self.queue.disarm()
            items = self.queue.take(batch * ROUND_BATCHES)
            if items:
                containers, lost = self.transport.encode(items)
                if lost:
                    self.queue.done(0, len(lost), sum(lost))
                await self.transport.deliver(containers, self._delivered, self._abort.is_set)

    def _hurry(self) -> bool:
        return bool(self._flushing) or self._closing.is_set()

    async def _sleep(self, timeout: float | None, hurry: bool = False) -> None:
        """Wait for a wake-up (or ``timeout``); with ``hurry``, not at all while a flush or close waits."""
        assert self._wakeup is not None
        self._wakeup.clear()
        if self._closing.is_set() or (hurry and self._flushing):
            return
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _delivered(self, containers: list[Container], lost: list[int]) -> None:
        self.queue.done(sum(len(c.items) for c in containers), len(lost),
                        sum(c.size for c in containers) + sum(lost))

