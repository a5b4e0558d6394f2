"""The bounded queue between the threads that record events and the one that sends them.

Shaped like OpenTelemetry's ``BatchSpanProcessor``: callers append and return at once; the
sender sleeps until a batch's worth is queued (or a linger timeout passes, or a flush asks),
then takes everything queued. What a caller appends is a :class:`Channel` (where the record
goes and how to build it) plus the validated arguments of the call: turning them into an Avro
record costs more than the call itself, so it happens on the sender's thread.

Every queued event counts against ``buffer_bytes`` (an estimate from its string lengths) until
the broker acknowledges it; an event that would go past the bound is dropped and counted.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any
from collections.abc import Callable

log = logging.getLogger(__name__)

DROP_LOG_INTERVAL_S = 10.0
# Sequence streams: each writer numbers its spans and its steps separately, because the two
# topics are consumed independently and a mark from one must never skip an event of the other.
SPANS, STEPS, UNSEQUENCED = 0, 1, 2
NEVER = 1 << 62  # a wake threshold that is never reached
# What one queued event holds in memory until it is acknowledged (its argument tuples, number
# objects, copied dicts; measured with tracemalloc), which is 2-4x its encoded size: counting
# this makes buffer_bytes bound the SDK's memory, not only the bytes it would put on the wire.
# Strings add their length (a rollout id made per call is kept alive by the queue).
ROLLOUT_QUEUED_BYTES = 480
GRADER_QUEUED_BYTES = 420
STEP_QUEUED_BYTES = 380
DICT_QUEUED_BYTES = 240  # a copied term_shares or attributes dict, plus ENTRY_BYTES an entry
ENTRY_BYTES = 60


class Channel:
    """Where one kind of record goes (topic, key, record type) and how the sender builds it.

    ``build(sequence_id, args)`` runs on the sender's thread and returns the Avro record.
    """

    __slots__ = ("topic", "key", "schema", "build", "group")

    def __init__(self, topic: str, key: str, schema: str, build: Callable[[int, Any], dict[str, Any]]):
        self.topic, self.key, self.schema, self.build = topic, key, schema, build
        self.group = (topic, key, schema)  # the sender encodes each group as its own containers


# A queued event: (channel, sequence_id, estimated bytes, call arguments).
Item = tuple[Channel, int, int, Any]


class EventQueue:
    """Thread-safe. ``put`` from any thread; one sender calls ``take`` and ``done``."""

    def __init__(self, buffer_bytes: int, batch_records: int):
        self.buffer_bytes = buffer_bytes
        self.batch_records = batch_records
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # flush waits on it; ``done`` notifies
        self._items: collections.deque[Item] = collections.deque()
        self._next_seq = [0, 0, 0]
        self._bytes = 0  # queued or in flight: released on acknowledgement
        self.pending = 0  # events accepted and neither delivered nor given up on
        self.dropped = 0  # refused because the buffer was full, or found unsendable later
        self.delivered = 0
        self._last_drop_log = 0.0
        # The sender sets how many queued items should wake it (1 when it sleeps on an empty
        # queue, a batch when it lingers), so a caller wakes it once, not on every append.
        self._wake_at = NEVER
        self._wake: Callable[[], None] = _nothing
        # The sender thread draining this queue (its token), and what starts one when there is none.
        self._owner: object | None = None
        self._starter: Callable[[], object | None] | None = None

    # -- callers' side -------------------------------------------------------------------
    def put(self, stream: int, channel: Channel, args: Any, size: int) -> bool:
        """Number the event in ``stream`` and queue it, in one step; False (counted) when full.

        Taking the sequence id and appending under one lock is what makes several threads'
        events reach Kafka in sequence order.
        """
        with self._lock:
            if self._bytes + size > self.buffer_bytes:
                self._count_drop()
                return False
            seq = self._next_seq[stream] + 1
            self._next_seq[stream] = seq
            items = self._items
            items.append((channel, seq, size, args))
            self._bytes += size
            self.pending += 1
            if len(items) >= self._wake_at:
                self._wake_at = NEVER
                if self._owner is not None or self._starter is None:
                    self._wake()
                else:  # no sender thread (not yet, or no longer, running): start one
                    self._start()
        return True

    def reserve(self, size: int) -> bool:
        """Count ``size`` bytes against the bound now, for an event queued later by ``put_reserved``
        (a grader call held for its step); False, a counted drop, when they do not fit."""
        with self._lock:
            if self._bytes + size > self.buffer_bytes:
                self._count_drop()
                return False
            self._bytes += size
            return True

    def unreserve(self, size: int) -> None:
        """Give back bytes reserved for events that will never be queued (a step the job abandoned)."""
        with self._lock:
            self._bytes -= size

    def put_reserved(self, stream: int, channel: Channel, args: Any, size: int) -> None:
        """``put`` for an event whose ``size`` was reserved: never dropped. (``put``'s body again rather
        than a helper both call: ``put`` is the hot path of every SDK call.)"""
        with self._lock:
            seq = self._next_seq[stream] + 1
            self._next_seq[stream] = seq
            items = self._items
            items.append((channel, seq, size, args))
            self.pending += 1
            if len(items) >= self._wake_at:
                self._wake_at = NEVER
                if self._owner is not None or self._starter is None:
                    self._wake()
                else:
                    self._start()

    def last_sequence(self, stream: int) -> int:
        """The last sequence id given in ``stream`` (0 when none): RUN_END tells the streams so."""
        with self._lock:
            return self._next_seq[stream]

    def _count_drop(self) -> None:
        self.dropped += 1
        now = time.monotonic()
        if now - self._last_drop_log >= DROP_LOG_INTERVAL_S:  # a full buffer must not flood the job's log
            self._last_drop_log = now
            log.warning("telemetry buffer full (%d of %d bytes undelivered): %d events dropped so far",
                        self._bytes, self.buffer_bytes, self.dropped)

    def queued(self) -> list[Item]:
        """A copy of what is queued and not yet taken by the sender (for tests and inspection)."""
        with self._lock:
            return list(self._items)

    def __len__(self) -> int:
        return len(self._items)

    # -- sender's side -------------------------------------------------------------------
    def set_waker(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    def arm(self, at: int) -> bool:
        """Ask to be woken once ``at`` items are queued; False when that many already are."""
        with self._lock:
            if len(self._items) >= at:
                self._wake_at = NEVER
                return False
            self._wake_at = at
            return True

    def set_starter(self, starter: Callable[[], object | None], start_now: bool) -> None:
        """``starter`` starts a sender thread (returning a token that thread releases the queue with).

        While no thread drains the queue, the next ``put`` calls it (or this call does, with
        ``start_now``, or when events are already waiting). It runs under this queue's lock, so
        two threads never drain one queue and an event is never left without one.
        """
        with self._lock:
            self._starter = starter
            if self._owner is None:
                if start_now or self._items:
                    self._start()
                else:
                    self._wake_at = 1

    def _start(self) -> None:
        assert self._starter is not None
        self._wake_at = NEVER
        self._owner = self._starter()
        if self._owner is None:  # it could not start a thread (and said why): the next put tries again
            self._wake_at = 1

    def retire(self, owner: object) -> bool:
        """The closing sender thread ``owner`` stops if nothing is queued (True); an event queued
        after this starts a new thread, so none is ever stranded between the check and the stop."""
        with self._lock:
            if self._items or self._owner is not owner:
                return False
            self._owner = None
            self._wake_at = 1 if self._starter is not None else NEVER
            return True

    def release(self, owner: object) -> None:
        """The sender thread ``owner`` stops: the next ``put`` starts another (if a starter is set)."""
        with self._lock:
            if self._owner is owner:
                self._owner = None
                self._wake_at = 1 if self._starter is not None else NEVER

    def requeue(self, items: list[Item]) -> None:
        """Put back, in front and in order, what was taken and not delivered (they keep their ids and budget)."""
        with self._lock:
            self._items.extendleft(reversed(items))
            self._changed.notify_all()

    def disarm(self) -> None:
        with self._lock:
            self._wake_at = NEVER

    def take(self, limit: int) -> list[Item]:
        """Remove and return up to ``limit`` items, oldest first."""
        with self._lock:
            items = self._items
            if len(items) <= limit:
                out = list(items)
                items.clear()
                return out
            return [items.popleft() for _ in range(limit)]

    def done(self, delivered: int, given_up: int, size: int) -> None:
        """Account for events acknowledged (``delivered``) or unsendable (``given_up``), ``size`` bytes in all."""
        with self._lock:
            self.delivered += delivered
            self.dropped += given_up
            self.pending -= delivered + given_up
            self._bytes -= size
            self._changed.notify_all()

    def wait_empty(self, deadline: float, alive: Callable[[], bool]) -> int:
        """Wait until nothing is pending or the monotonic ``deadline`` passes; returns ``pending``."""
        with self._lock:
            while self.pending > 0 and alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, 0.5))  # bounded: also notices the sender dying
            return self.pending

    def notify(self) -> None:
        with self._lock:
            self._changed.notify_all()


def _nothing() -> None:
    pass
