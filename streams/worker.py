"""The streams worker: what the two agents do with each event, free of Faust.

``rlpulse.streams.app`` binds Faust to it: each agent hands over its events (topic, partition, offset,
value), the timers call :meth:`StreamsWorker.send_ticks`, :meth:`~StreamsWorker.report` and
:meth:`~StreamsWorker.commit_behind`, and Faust's consumer and topics are adapted to the small
protocols here (and :class:`rlpulse.streams.commits.ConsumerView`). The test harness
(``rlpulse.streams.testing.WorkerHarness``) gives it an in-memory broker instead.

Per event, one at a time in each agent (``concurrency=1``):

* a message of an input topic: offsets the consumer never handed over before it are read first,
  in order (Faust's recovery skip, see ``ProcessedOffsets.missed``); then its records go to the
  lane's stage, and the stage's outputs are published;
* a tick: the lane's stage does its wall-clock work. The runs get none until their partition has
  caught up with what waited on it when this worker got it (``ProcessedOffsets.caught_up``);
  a late tick makes it catch up again (``TickWatch``), and a catch-up stuck for ``STUCK_S`` has
  its missing ranges read here, once.

Processing is at-least-once; replays are skipped by the sequence marks kept in each run's state.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict
from typing import Any, Protocol

from rlpulse.schemas.catalogue import HARDWARE_TOPICS, RUN_TOPICS, TICKS_TOPIC
from rlpulse.schemas.codec import Codec
from rlpulse.streams.commits import ConsumerView, ProcessedOffsets, TickWatch, TopicPartition
from rlpulse.streams.inputs import Inputs
from rlpulse.streams.runs import Output
from rlpulse.streams.stage import RunStage, Stage

log = logging.getLogger(__name__)

__all__ = ["Clock", "Lane", "Publisher", "RangeReader", "StreamsWorker", "SystemClock", "TopicPartition"]


class Publisher(Protocol):
    async def send(self, topic: str, key: bytes, value: bytes, partition: int | None = None) -> None:
        """Send one message to ``topic`` (a short name); the partition from the key unless given.
        Sent, not awaited to delivery: Faust flushes its producer before it commits."""
        ...


class RangeReader(Protocol):
    async def read_range(self, tp: TopicPartition, first: int, end: int) -> list[tuple[int, bytes | None]]:
        """Offsets ``first`` up to ``end`` (excluded) of ``tp`` as (offset, value); fewer when the
        log no longer holds them (``rlpulse.streams.inputs.read_range``)."""
        ...


class Clock(Protocol):
    def wall_ns(self) -> int:
        """The wall clock: what ticks are stamped with and the stages judge idleness by."""
        ...

    def monotonic_s(self) -> float:
        """For how long a catch-up made no progress (``STUCK_S``)."""
        ...


class SystemClock:
    def wall_ns(self) -> int:
        return time.time_ns()

    def monotonic_s(self) -> float:
        return time.monotonic()


@dataclasses.dataclass(frozen=True)
class Lane:
    """One agent: its stage and its input topics (short names, ticks excluded)."""

    name: str
    stage: Stage
    sources: tuple[str, ...]
    # Its ticks wait for its sources' catch-up, and read a stuck catch-up's ranges. Only the runs
    # lane: the hardware agent shares the ticks, and taking the ranges there would drop their records.
    tracks_catch_up: bool


class StreamsWorker:
    def __init__(self, prefix: str, partitions: int, runs: RunStage, gpus: Stage, *, publisher: Publisher,
                 ranges: RangeReader, consumer: ConsumerView, clock: Clock | None = None,
                 codec: Codec | None = None):
        self.prefix, self.partitions = prefix, partitions
        self.runs = Lane("runs", runs, tuple(s for s in RUN_TOPICS if s != TICKS_TOPIC), tracks_catch_up=True)
        self.gpus = Lane("gpus", gpus, tuple(s for s in HARDWARE_TOPICS if s != TICKS_TOPIC), tracks_catch_up=False)
        self.processor = runs.processor
        self.publisher, self.ranges, self.consumer = publisher, ranges, consumer
        self.clock: Clock = clock or SystemClock()
        self.codec = codec or Codec()
        self.inputs = Inputs(self.codec)
        self.processed = ProcessedOffsets()
        self.tick_watch = TickWatch()
        self._throughput = (self.clock.monotonic_s(), 0)  # (since when, records applied then), see report

    def topic(self, short: str) -> str:
        return f"{self.prefix}.{short}"

    def short(self, topic: str) -> str:
        return topic[len(self.prefix) + 1:]

    # -- the agents' events ----------------------------------------------------------------------
    async def on_event(self, lane: Lane, tp: TopicPartition, offset: int, value: bytes | None) -> None:
        """One event of ``lane``'s agent: a tick or a message in, the outputs published, the offset marked done."""
        now = self.clock.wall_ns()
        if self.short(tp.topic) == TICKS_TOPIC:
            await self.publish(self._tick(lane, tp.partition, now, value))
            for stuck, first, end in self.processed.take_stuck() if lane.tracks_catch_up else ():
                await self._read(lane, stuck, first, end)
        else:
            skipped_from = self.processed.missed(self.consumer, tp, offset)
            if skipped_from is not None:  # offsets Faust never handed us: read them first, in order
                await self._read(lane, tp, skipped_from, offset)
            await self._handle(lane, tp, offset, value, now)
        self.processed.done(tp, offset)

    def _tick(self, lane: Lane, partition: int, now: int, value: bytes | None) -> list[Output]:
        if not lane.tracks_catch_up:
            return lane.stage.on_tick(partition, now)
        sources = [TopicPartition(self.topic(short), partition) for short in lane.sources]
        if self.tick_watch.cut_off(partition, TickWatch.sent(value), now):
            self.processed.recheck(sources)  # events published while we were cut off may still be on their way
        caught_up = self.processed.caught_up(self.consumer, sources, self.clock.monotonic_s())
        return lane.stage.on_tick(partition, now, caught_up=caught_up)

    async def _read(self, lane: Lane, tp: TopicPartition, first: int, end: int) -> None:
        """Offsets ``first`` to ``end - 1`` of ``tp``, read by the worker itself and processed in order."""
        for offset, value in await self.ranges.read_range(tp, first, end):
            await self._handle(lane, tp, offset, value, self.clock.wall_ns())
            self.processed.done(tp, offset)

    async def _handle(self, lane: Lane, tp: TopicPartition, offset: int, value: bytes | None, now: int) -> None:
        short = self.short(tp.topic)
        records = self.inputs.decode(short, value, f"{tp.topic}[{tp.partition}]@{offset}")
        if records:
            await self.publish(lane.stage.on_message(short, tp.partition, records, now))

    async def publish(self, out: list[Output]) -> None:
        """One container per (topic, key, record type); sent, not awaited: Faust flushes before committing."""
        groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
        for o in out:
            groups[(o.topic, o.key, o.schema)].append(o.record)
        for (short, key, schema), records in groups.items():
            await self.publisher.send(short, key.encode(), self.codec.encode(schema, records))

    # -- the timers and the rebalances -----------------------------------------------------------
    async def send_ticks(self) -> None:
        """One tick to every partition of ``ticks``, stamped with when it was sent (see TickWatch)."""
        for partition in range(self.partitions):
            await self.publisher.send(TICKS_TOPIC, b"tick", TickWatch.stamp(self.clock.wall_ns()), partition=partition)

    def report(self) -> None:
        """One line every 10 s while records flow: what a person watching the worker wants to know."""
        p, now = self.processor, self.clock.monotonic_s()
        since, applied = self._throughput
        records = p.applied - applied
        if records:
            log.info("run processor: %d records in %.0fs (%.0f/s); %d replayed records skipped, %d missing "
                     "(sequence gaps), %d refused by the input limits so far", records, now - since,
                     records / max(now - since, 1e-9), p.duplicates, p.sequence_gaps,
                     p.terms_refused + p.names_refused + p.runs_refused)
        self._throughput = (now, p.applied)

    async def commit_behind(self) -> dict[TopicPartition, int]:
        """Commit the offsets Faust's own commit left behind (faust-streaming #318, see rlpulse.streams.commits)."""
        committed = await self.processed.commit_behind(self.consumer)
        if committed:
            log.info("committed %d partitions Faust had left behind", len(committed))
        return committed

    def forget(self, revoked: set[TopicPartition]) -> None:
        """Partitions revoked: their positions and catch-ups belong to whoever gets them next."""
        self.processed.forget(revoked)
