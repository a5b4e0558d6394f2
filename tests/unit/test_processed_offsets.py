"""ProcessedOffsets: offsets a worker was never handed are noticed (and read by the caller), and
TickWatch: a worker cut off from the broker catches up again."""

from __future__ import annotations

from dataclasses import dataclass

from rlpulse.streams.commits import ProcessedOffsets


@dataclass(frozen=True)
class TP:
    topic: str
    partition: int


@dataclass(frozen=True)
class Message:
    tp: TP
    offset: int


class GroupOffsets:
    """What ``missed`` reads of Faust's consumer: the group's committed offsets at assignment."""

    def __init__(self, committed: dict[TP, int]):
        self._committed_offset = committed


SPANS = TP("p.spans", 0)


def feed(p: ProcessedOffsets, consumer: GroupOffsets, offsets: list[int]) -> list[tuple[int, int | None]]:
    """Each offset with what ``missed`` says of it; as the agent does, the missing ones are then
    read (marked done) before the message itself."""
    out = []
    for o in offsets:
        first = p.missed(consumer, Message(SPANS, o))
        out.append((o, first))
        if first is not None:
            for missing in range(first, o):
                p.done_offset(SPANS, missing)
        p.done(Message(SPANS, o))
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
    consumer._committed_offset[SPANS] = 40  # the next owner committed up to 40 meanwhile
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

    def highwater(self, tp: TP) -> int:
        return self.high[tp]


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
