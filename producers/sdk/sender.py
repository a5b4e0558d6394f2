"""Background sender: the bounded queue (``rlpulse.producers.sdk.queue``) drained by one thread through a
transport (``rlpulse.producers.sdk.delivery.Transport``: Kafka by default, ``rlpulse.producers.sdk.transport``; or an
``InMemoryTransport`` for tests and dry runs, ``rlpulse.producers.sdk.memory``) on its own asyncio loop.

Callers never wait on the network. The sender sleeps until a batch's worth is queued, a
linger timeout passes after the first event, or someone flushes; then it takes everything
queued, encodes it into containers (``rlpulse.producers.sdk.containers``) and delivers them
(``rlpulse.producers.sdk.delivery``). While the transport fails it retries with backoff and the queue's
byte bound holds what waits.

The thread runs while the sender is open. After ``close()`` (or in a process forked from one
that had started it) the next event starts a thread again, which delivers what is queued and,
once the sender is closed, stops when the queue is empty: a span an OpenTelemetry batch
processor exports after the job closed its telemetry is delivered, not left on a dead queue.
At interpreter exit, ``rlpulse.producers.sdk.process`` delivers what open senders hold, bounded in time.

Publishing a ready-made record (GPU samples, placements)::

    sender = Sender(settings); sender.start()
    sender.offer(Outgoing(settings.topic("hardware"), hw_id, "GpuSample", record))
    sender.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

from rlpulse.producers.sdk import process
from rlpulse.producers.sdk.containers import BATCH_RECORDS, MAX_MESSAGE_BYTES, Container, Encoder
from rlpulse.producers.sdk.delivery import Delivery, Transport
from rlpulse.producers.sdk.events import Check, check_fields, queued_bytes, record_checks
from rlpulse.producers.sdk.queue import UNSEQUENCED, Channel, EventQueue
from rlpulse.producers.sdk.transport import KafkaTransport
from rlpulse.schemas.codec import Codec
from rlpulse.base.settings import Settings

log = logging.getLogger(__name__)

DEFAULT_BUFFER_BYTES = 64 * 1024 * 1024
DEFAULT_LINGER_S = 0.05  # how long a partial batch waits for company before it is sent
EXIT_TIMEOUT_S = 10.0  # at interpreter exit, how long an open sender may take to deliver what it holds
ROUND_BATCHES = 20  # one round takes at most this many batches' worth, so acks free buffer bytes early


@dataclass(frozen=True)
class SenderConfig:
    buffer_bytes: int = DEFAULT_BUFFER_BYTES  # undelivered events past this are dropped and counted
    batch_records: int = BATCH_RECORDS  # records per container (one Kafka message), at most
    max_message_bytes: int = MAX_MESSAGE_BYTES  # the broker's message.max.bytes; containers stay below it
    linger_s: float = DEFAULT_LINGER_S
    producer_linger_ms: int = 5
    exit_timeout_s: float = EXIT_TIMEOUT_S  # bound on delivering the buffer when the interpreter exits


@dataclass(frozen=True)
class Outgoing:
    """A ready-made record for ``Sender.offer``: topic, message key, record type and the record."""

    topic: str
    key: str
    schema: str
    record: Mapping[str, Any]


def _as_is(seq: int, record: Any) -> Any:
    return record


class _DaemonThreads(concurrent.futures.ThreadPoolExecutor):
    """The sender loop's executor (asyncio resolves a broker's host name in it): a daemon thread a job.

    The default executor refuses work once the interpreter is exiting, which is when the exit
    handler delivers the buffer: a broker named ``kafka:9092`` could then never be reached. (A
    ThreadPoolExecutor only because asyncio insists on one; its pool is never used.)
    """

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def work() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # handed to the awaiting coroutine
                    future.set_exception(exc)

        threading.Thread(target=work, name="rlpulse-resolve", daemon=True).start()
        return future


class Sender:
    """Thread-safe: publish from any thread; one background thread sends through ``transport``
    (a ``KafkaTransport`` for ``settings`` when none is given)."""

    def __init__(self, settings: Settings, codec: Codec | None = None, buffer_bytes: int | None = None,
                 config: SenderConfig | None = None, transport: Transport | None = None):
        config = config or SenderConfig()
        if buffer_bytes is not None:
            config = dataclasses.replace(config, buffer_bytes=buffer_bytes)
        self.config = config
        self.settings = settings
        self.codec = codec or Codec()
        self.encoder = Encoder(self.codec, config.max_message_bytes, config.batch_records)
        self._checks: dict[str, dict[str, tuple[Check, bool]]] = {}
        self.queue = EventQueue(config.buffer_bytes, config.batch_records)
        self.transport: Transport = transport or KafkaTransport(
            settings, max_message_bytes=config.max_message_bytes, linger_ms=config.producer_linger_ms)
        self._delivery = Delivery(self.transport, self.encoder)
        self._fresh_thread_state()
        self._started = False  # start() was called: delivery is on (until then events only queue)
        self._closed = False  # close() was called: a thread started by a later event stops once the queue is empty
        self._pid = os.getpid()
        process.track(self)

    def _fresh_thread_state(self) -> None:
        """Locks, events and the thread handle: new in a forked child, never taken over from the parent."""
        self._flushing = 0  # flush() calls in progress: the sender does not linger meanwhile
        self._flush_lock = threading.Lock()
        self._closing = threading.Event()  # deliver what is queued, then stop
        self._abort = threading.Event()  # the current thread's: close() gave up waiting, stop retrying
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

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
    def refused(self) -> str | None:
        """Why the broker refuses our credentials or certificate (logged once), while it does; else None."""
        return self.transport.refused

    @property
    def buffer_bytes(self) -> int:
        return self.queue.buffer_bytes

    @property
    def running(self) -> bool:
        """A sender thread of this process is alive."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def max_record_bytes(self, schema: str, key: str) -> int:
        """The largest encoded ``schema`` record under ``key`` that fits in one message."""
        return self.encoder.max_record_bytes(schema, key)

    def check(self, schema: str, record: Mapping[str, Any], complete: bool = True) -> None:
        """Raise ValueError naming the field when ``record`` does not fit its Avro schema (NaN, infinity,
        an int beyond its range, a lone surrogate, a wrong type; a missing field if ``complete``)."""
        checks = self._checks.get(schema)
        if checks is None:
            checks = self._checks[schema] = record_checks(self.codec.schema(schema))
        check_fields(checks, record, complete)

    # -- publishing ------------------------------------------------------------------------
    def offer(self, item: Outgoing) -> bool:
        """Queue a ready-made record without blocking; False (counted in ``dropped``) when the buffer is full.

        The record is checked against its schema here, so a bad one raises ValueError at the
        call, as does one that can never fit in a message. This path is for records that come
        seldom (hardware: one per GPU every few seconds); the SDK's hot calls use ``put``.
        """
        record = dict(item.record)
        self.check(item.schema, record)
        # Encoding it once here gives the exact size (and catches what the checks do not know).
        size = len(self.codec.encode(item.schema, [record])) - self.encoder.header_bytes(item.schema)
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
        """Turn delivery on: start the thread now (again after ``close()``, until the next close)."""
        self._started = True
        self._closed = False
        self._closing.clear()
        self.queue.set_starter(self._launch, start_now=True)

    def _launch(self) -> object | None:
        """Start a sender thread; the queue calls this under its lock, when no thread drains it.

        Returns the thread's token (its abort event), or None when no thread could start.
        """
        abort = threading.Event()
        delivery = Delivery(self.transport.renew(), self.encoder)
        thread = threading.Thread(target=self._thread_main, args=(delivery, abort), name="rlpulse-sender",
                                  daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # e.g. at interpreter shutdown: what is queued waits for the next try
            log.warning("telemetry sender thread could not start (%s); %d events wait", exc, self.queue.pending)
            return None
        self._abort, self.transport, self._delivery, self._thread = abort, delivery.transport, delivery, thread
        process.on_sender_started()
        return abort

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
        if not self.running:  # events left by a close() that gave up: a thread delivers them now
            self.queue.set_starter(self._launch, start_now=False)
        with self._flush_lock:
            self._flushing += 1
        self._wake()
        try:
            return self.queue.wait_empty(time.monotonic() + timeout, lambda: self.running)
        finally:
            with self._flush_lock:
                self._flushing -= 1

    def close(self, timeout: float = 30.0, join_timeout: float = 15.0) -> int:
        """Deliver what is buffered (up to ``timeout``), stop the thread; returns the undelivered count.

        What is left stays queued (and counted in ``pending``); an event queued after this starts
        a thread again, which delivers it and whatever was left, then stops.
        """
        undelivered = self.flush(timeout)
        self._closed = True
        self._closing.set()
        if undelivered:
            self._abort.set()  # what is left stays undelivered: do not retry past the caller's timeout
            self._call_soon(self._delivery.interrupt)
        self._wake()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=join_timeout)  # the producer's own stop may wait out its request timeout
        return self.pending if self._started else undelivered

    # -- process life (called by rlpulse.producers.sdk.process) ------------------------------------------
    def _after_fork_in_child(self) -> None:
        """In a forked child: a new queue, locks and thread; nothing of the parent's is used or touched.

        The parent's queued events stay the parent's to send (resending them here would duplicate
        them under the parent's writer_id). Locks are made anew rather than taken before the fork
        (as CPython's logging does): one that another thread held at the fork stays held forever in
        the child, and nothing guarded by them is carried over, so nothing needs them consistent.
        The parent's loop, producer and sockets are kept referenced and never closed here: closing
        them would unregister the parent's sockets from the epoll instance the two processes share.
        """
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        process.keep_inherited((self.queue, self.transport, self._delivery, self._loop, self._wakeup, self._thread))
        self.queue = EventQueue(self.config.buffer_bytes, self.config.batch_records)
        self.transport = self.transport.renew()
        self._delivery = Delivery(self.transport, self.encoder)
        self._fresh_thread_state()
        if self._closed:
            self._closing.set()
        if self._started:  # the child's first event starts its own thread (a child that sends nothing costs nothing)
            self.queue.set_starter(self._launch, start_now=False)

    def _deliver_at_exit(self, deadline: float) -> tuple[int, int] | None:
        """(events buffered, events undelivered) after delivering until ``deadline``; None if not running here."""
        if self._pid != os.getpid() or not self.running:
            return None
        buffered = self.pending
        left = max(0.0, deadline - time.monotonic())
        return buffered, self.close(left, join_timeout=min(left + 2.5, 15.0))

    # -- background thread -----------------------------------------------------------------
    def _thread_main(self, delivery: Delivery, abort: threading.Event) -> None:
        try:
            asyncio.run(self._run(delivery, abort))
        except Exception:  # never silently: flush() and close() notice the dead thread
            log.exception("telemetry sender stopped")
        finally:
            self.queue.release(abort)
            self.queue.notify()

    async def _run(self, delivery: Delivery, abort: threading.Event) -> None:
        self._wakeup = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._loop.set_default_executor(_DaemonThreads())
        self.queue.set_waker(self._wake)
        try:
            if await delivery.transport.start(abort.is_set):
                await self._drain(delivery, abort)
        finally:
            # Let the next event start another thread while this one closes its transport.
            self.queue.release(abort)
            await delivery.transport.close()

    async def _drain(self, delivery: Delivery, abort: threading.Event) -> None:
        batch = self.config.batch_records
        while not abort.is_set():
            # Sleep until an event is queued (close() wakes it too; an empty queue has nothing
            # for a flush to hurry) ...
            if self.queue.arm(1):
                if self._closing.is_set() and self.queue.retire(abort):
                    return
                await self._sleep(None)
            # ... then linger for a batch's worth, unless someone is waiting for delivery.
            if not self._hurry() and self.queue.arm(batch):
                await self._sleep(self.config.linger_s, hurry=True)
            self.queue.disarm()
            items = self.queue.take(batch * ROUND_BATCHES)
            if items:
                containers, lost = self.encoder.encode(items)
                if lost:
                    self.queue.done(0, len(lost), sum(lost))
                left = await delivery.deliver(containers, self._delivered, abort.is_set)
                if left:  # given up (close() timed out): back in front, for a later thread or count
                    self.queue.requeue([item for c in left for item in c.items])

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
