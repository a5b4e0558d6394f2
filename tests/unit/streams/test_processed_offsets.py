"""ProcessedOffsets: offsets a worker was never handed are noticed (and read by the caller), and
TickWatch: a worker cut off from the broker catches up again."""

from __future__ import annotations

from rlpulse.streams.commits import ProcessedOffsets
from rlpulse.streams.commits import TopicPartition as TP


class GroupOffsets:
    """What ``missed`` reads of the consumer (rlpulse.streams.commits.ConsumerView): the group's committed offsets."""

    def __init__(self, committed: dict[TP, int]):
        self.committed_offsets = committed

    def committed(self, tp: TP) -> int | None:
        return self.committed_offsets.get(tp)


SPANS = TP("p.spans", 0)


def feed(p: ProcessedOffsets, consumer: GroupOffsets, offsets: list[int]) -> list[tuple[int, int | None]]:
    """Each offset with what ``missed`` says of it; as the agent does, the missing ones are then
    read (marked done) before the message itself."""
    out = []
    for o in offsets:
        first = p.missed(consumer, SPANS, o)
        out.append((o, first))
        if first is not None:
            for missing in range(first, o):
                p.done(SPANS, missing)
        p.done(SPANS, o)
    return out


def test_offsets_in_order_from_the_committed_one_are_processed() -> None:
    p, consumer = ProcessedOffsets(), GroupOffsets({SPANS: 32})
    assert feed(p, consumer, [32, 33, 34]) == [(32, None), (33, None), (34, None)]


def test_a_restart_that_skipped_offsets_reads_them_before_the_first_message(caplog) -> None:
    # Faust dropped 32..38 during recovery: the first message this worker gets is 39.
    p, consumer = ProcessedOffsets(), GroupOffsets({SPANS: 32})
    assert feed(p, consumer, [39, 40, 41]) == [(39, 32), (40, None), (41, None)]
    assert p.positions[SPANS] == 42
    assert "reading offsets 32 to 38" in caplog.text


def test_a_gap_in_the_middle_is_read_from_the_offset_after_the_last_processed() -> None:
    p, consumer = ProcessedOffsets(), GroupOffsets({SPANS: 0})
    assert feed(p, consumer, [0, 1, 5, 6]) == [(0, None), (1, None), (5, 2), (6, None)]


def test_a_replay_below_what_was_processed_is_no_gap() -> None:
    p, consumer = ProcessedOffsets(), GroupOffsets({SPANS: 0})
    assert feed(p, consumer, [0, 1, 2, 1, 2, 3]) == [(0, None), (1, None), (2, None), (1, None), (2, None), (3, None)]


def test_a_revoked_partition_starts_again_from_the_groups_offset() -> None:
    p, consumer = ProcessedOffsets(), GroupOffsets({SPANS: 32})
    assert feed(p, consumer, [32, 33]) == [(32, None), (33, None)]
    p.forget({SPANS})
    consumer.committed_offsets[SPANS] = 40  # the next owner committed up to 40 meanwhile
    assert feed(p, consumer, [40]) == [(40, None)]


def test_a_tick_late_or_after_a_gap_says_the_worker_was_cut_off() -> None:
    from rlpulse.streams.commits import TickWatch

    s = 1_000_000_000
    watch = TickWatch(late_s=5.0)
    assert TickWatch.sent(TickWatch.stamp(123 * s)) == 123 * s
    assert TickWatch.sent(b"") is None  # an older worker's tick carries no stamp
    assert not watch.cut_off(0, 100 * s, 100 * s)  # the first tick of a partition
    assert not watch.cut_off(0, 100 * s, 100 * s + s // 2)  # on time, half a second later
    assert watch.cut_off(0, 101 * s, 107 * s)  # sent 6 s ago: queued while the broker was down
    assert not watch.cut_off(0, 107 * s, 107 * s + s // 2)
    assert watch.cut_off(0, 130 * s, 130 * s)  # on time, but none for 22 s: the ticks were lost meanwhile
    assert not watch.cut_off(1, None, 200 * s)  # each partition has its own ticks
    assert watch.cut_off(1, None, 206 * s)


class LogEnds(GroupOffsets):
    """Adds what ``caught_up`` reads: the end of each partition's log as the consumer last saw it."""

    def __init__(self, committed: dict[TP, int], high: dict[TP, int]):
        super().__init__(committed)
        self.high = high

    def highwater(self, tp: TP) -> int | None:
        return self.high.get(tp)


def test_recheck_makes_the_partition_catch_up_again_to_the_log_end_seen_now() -> None:
    consumer, offsets = LogEnds({SPANS: 0}, {SPANS: 5}), ProcessedOffsets()
    assert not offsets.caught_up(consumer, [SPANS], 0.0)  # the call that fixes the target, 5
    feed(offsets, consumer, list(range(5)))
    assert offsets.caught_up(consumer, [SPANS], 1.0)
    consumer.high[SPANS] = 9  # published while the worker was cut off from the broker
    offsets.recheck([SPANS])
    assert not offsets.caught_up(consumer, [SPANS], 2.0)  # the call that fixes the new target
    assert not offsets.caught_up(consumer, [SPANS], 3.0)
    feed(offsets, consumer, list(range(5, 9)))
    assert offsets.caught_up(consumer, [SPANS], 4.0)


def test_a_partition_the_group_never_committed_counts_from_offset_0() -> None:
    # Faust keeps a committed 0 as None: the first message must still be offset 0.
    p, consumer = ProcessedOffsets(), GroupOffsets({})
    assert feed(p, consumer, [2, 3]) == [(2, 0), (3, None)]


def test_a_partition_is_caught_up_once_what_was_waiting_when_it_was_assigned_is_processed() -> None:
    from rlpulse.streams.commits import STUCK_S

    spans, steps = TP("t.spans", 0), TP("t.steps", 0)
    consumer, offsets = LogEnds({spans: 3, steps: 7}, {steps: 7}), ProcessedOffsets()
    assert not offsets.caught_up(consumer, [spans, steps], 0.0)  # no fetch answered for spans yet
    consumer.high[spans] = 5
    assert not offsets.caught_up(consumer, [spans, steps], 0.5)  # targets fixed now: 5 and 7; spans done up to 3
    offsets.done(spans, 3)
    consumer.high[spans] = 9  # live traffic after the assignment does not hold it back
    assert not offsets.caught_up(consumer, [spans, steps], 1.0)
    offsets.done(spans, 4)
    assert offsets.caught_up(consumer, [spans, steps], 1.5)
    offsets.forget({spans, steps})  # revoked and assigned again: a new catch-up
    assert not offsets.caught_up(consumer, [spans, steps], 2.0)
    # a catch-up that makes no progress has its missing range read by the caller once (Faust can
    # skip a partition's tail); still none after that (the log's start moved past offsets never
    # committed), it is given up
    stuck = LogEnds({}, {spans: 50, steps: 0})
    offsets = ProcessedOffsets()
    assert not offsets.caught_up(stuck, [spans, steps], 0.0)
    assert not offsets.caught_up(stuck, [spans, steps], 1.0)
    assert offsets.take_stuck() == []
    assert not offsets.caught_up(stuck, [spans, steps], STUCK_S + 1.0)
    assert offsets.take_stuck() == [(spans, 0, 50)]
    assert not offsets.caught_up(stuck, [spans, steps], 2 * STUCK_S)
    assert offsets.caught_up(stuck, [spans, steps], 2 * STUCK_S + 2.0)


class Committing(LogEnds):
    """All of ConsumerView: the assignment and the commit, as commit_behind uses them."""

    def __init__(self, committed: dict[TP, int], assigned: set[TP], under_way: bool = False):
        super().__init__(committed, {})
        self.assigned, self.under_way, self.commits = assigned, under_way, []

    def assignment(self) -> set[TP]:
        return self.assigned

    async def commit_under_way(self) -> bool:
        return self.under_way

    async def commit(self, offsets) -> None:
        self.commits.append(dict(offsets))
        self.committed_offsets.update(offsets)


def test_commit_behind_commits_only_assigned_partitions_faust_left_behind() -> None:
    import asyncio

    steps, hardware = TP("p.steps", 0), TP("p.hardware", 0)
    p = ProcessedOffsets()
    for tp, offset in ((SPANS, 9), (steps, 4), (hardware, 2)):
        p.done(tp, offset)
    consumer = Committing({SPANS: 10, steps: 3}, assigned={SPANS, steps})  # hardware was revoked
    assert asyncio.run(p.commit_behind(consumer)) == {steps: 5}
    assert consumer.commits == [{steps: 5}] and consumer.committed(SPANS) == 10
    assert asyncio.run(p.commit_behind(consumer)) == {}  # nothing behind any more
    p.done(SPANS, 12)
    consumer.under_way = True  # Faust is committing: leave it to Faust this time
    assert asyncio.run(p.commit_behind(consumer)) == {} and len(consumer.commits) == 1
