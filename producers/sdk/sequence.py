"""A span's ``sequence_id``: taken when the span starts, in one order across every process of a rollout.

Seed 003 takes one id per attempt from its store when a span starts, so spans written by several
processes and machines merge in start order. rlpulse has no store on the call path, so each writer
keeps a hybrid logical clock (HLC: Kulkarni et al., 2014) and the id is

    sequence_id = (microseconds since 2020-01-01 UTC, as the clock sees them) << 12 | writer tag

where the writer tag is 12 random bits per writer (per ``TrainingTelemetry``, and anew in a forked
child). What holds, exactly:

* **Within one writer** a span started later has a larger id (``take``: the clock never goes back,
  even when the wall clock does), and no two of its last 4,096 ids are equal.
* **Across processes**, a span started from a propagated context (``traceparent`` plus rlpulse
  baggage, or the ``x-sequence-id`` header) has a larger id than the span that propagated it,
  whatever the two machines' clocks say, up to 5 minutes ahead (``take(after=...)``): a propagated
  id further ahead of this writer's clock (a broken clock, or a hostile header) is followed only that
  far, so it cannot drag this writer's ids into the future.
* Otherwise, spans of different writers are in wall-clock start order up to the clocks' skew
  (NTP keeps it to milliseconds). Two writers give the same id only when their tags coincide
  (1 in 4,096) and they start spans in the same microsecond; ``span_id`` breaks that tie.
* A span published after the fact (``tel.rollout``, ``tel.grader``, ``publish_span`` without an id,
  the OpenTelemetry exporter) gets the id of its own start time (``at``), so it sorts where it
  started, not where it was published.

The ids fit an Avro long until 2091. The streams' replay marks do not use them: each writer also
numbers what it publishes, in publish order (``writer_sequence``).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable

EPOCH_NS = 1_577_836_800_000_000_000  # 2020-01-01T00:00:00Z
TAG_BITS = 12
TAG_MASK = (1 << TAG_BITS) - 1
RECENT = 4096  # ids remembered per writer, so an id from a start time never repeats a recent one
MAX_TICK = (1 << (63 - TAG_BITS)) - 1 - 2 * RECENT  # the last tick an Avro long holds (2091), less room to count up
MAX_AHEAD_US = 300 * 1_000_000  # a propagated id at most this far ahead of our clock is followed (clock skew);
# one further ahead (a broken clock, or a hostile header) would drag every later id of this writer with it


def ticks(sequence_id: int) -> int:
    """The clock part of a sequence id (microseconds since 2020 as its writer's HLC saw them)."""
    return sequence_id >> TAG_BITS


class StartSequence:
    """One writer's hybrid logical clock; thread-safe."""

    def __init__(self, clock: Callable[[], int] = time.time_ns, tag: int | None = None):
        self.clock = clock
        self.tag = (int.from_bytes(os.urandom(2), "big") if tag is None else tag) & TAG_MASK
        self._last = 0  # the largest tick given by take()
        self._lock = threading.Lock()
        self._recent: deque[int] = deque()
        self._used: set[int] = set()
        self._next: dict[int, int] = {}  # a start tick at() gave out -> the next free tick for that start

    def take(self, after: int = 0) -> int:
        """The id of a span starting now; larger than ``after`` (a propagated parent's id) when given."""
        now = (self.clock() - EPOCH_NS) // 1000
        with self._lock:
            followed = min(ticks(after), now + MAX_AHEAD_US, MAX_TICK) if after > 0 else 0
            tick = min(max(now, self._last + 1, followed + 1, 1), MAX_TICK)
            while tick in self._used:  # an id at() gave from a start time in this very microsecond
                tick += 1
            self._last = tick
            self._remember(tick)
            return tick << TAG_BITS | self.tag

    def last(self) -> int:
        """The largest id ``take`` has given (0 before the first): what a request sent now propagates, so a
        span started from it comes after every span this writer has started so far."""
        with self._lock:
            return self._last << TAG_BITS | self.tag if self._last else 0

    def at(self, start_ns: int) -> int:
        """The id of a span that started at ``start_ns`` and is published after the fact."""
        start = min(max((start_ns - EPOCH_NS) // 1000, 1), MAX_TICK)
        with self._lock:
            tick = self._next.get(start, start)  # many spans of one start (a batch's graders): no walk from it
            while tick in self._used:
                tick += 1
            self._next[start] = tick + 1
            self._remember(tick)
            return tick << TAG_BITS | self.tag

    def _remember(self, tick: int) -> None:
        self._used.add(tick)
        self._recent.append(tick)
        if len(self._recent) > RECENT:
            self._used.discard(self._recent.popleft())
            if len(self._next) > RECENT:
                self._next.clear()  # a hint only: the used set still keeps the recent ids apart
