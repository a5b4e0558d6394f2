"""ProcessedOffsets.missed: a worker that is handed offsets past ones it never got goes back for them."""

from __future__ import annotations

from dataclasses import dataclass

from streams.commits import REWIND_WAIT_S, ProcessedOffsets


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


def feed(p: ProcessedOffsets, consumer: GroupOffsets, offsets: list[int], now: float = 0.0) -> list[tuple[int, int | None]]:
    out = []
    for o in offsets:
        back = p.missed(consumer, Message(SPANS, o), now)
        out.append((o, back))
        if back is None:
            p.done(Message(SPANS, o))
    return out


def test_offsets_in_order_from_the_committed_one_are_processed() -> None:
    p, consumer = ProcessedOffsets(), GroupOffsets({SPANS: 32})
    assert feed(p, consumer, [32, 33, 34]) == [(32, None), (33, None), (34, None)]


def test_a_restart_that_skipped_offsets_seeks_back_skips_the_buffered_and_processes_them_again(caplog) -> None:
    # Faust dropped 32..38 during recovery: the first message this worker gets is 39.
    p, consumer = ProcessedOffsets(), GroupOffsets({SPANS: 32})
    got = feed(p, consumer, [39, 40] + list(range(32, 42)))
    assert got == [(39, 32), (40, -1)] + [(o, None) for o in range(32, 42)]
    assert p.positions[SPANS] == 42
    assert "seeking back to 32" in caplog.text


def test_a_gap_in_the_middle_seeks_back_to_the_offset_after_the_last_processed() -> None:
    p, consumer = ProcessedOffsets(), GroupOffsets({SPANS: 0})
    assert feed(p, consumer, [0, 1, 5, 6, 2, 3, 4, 5, 6]) == [
        (0, None), (1, None), (5, 2), (6, -1), (2, None), (3, None), (4, None), (5, None), (6, None)]


def test_offsets_that_never_come_back_are_given_up_on_after_the_wait(caplog) -> None:
    p, consumer = ProcessedOffsets(), GroupOffsets({SPANS: 32})
    assert feed(p, consumer, [39], now=0.0) == [(39, 32)]
    assert feed(p, consumer, [40], now=1.0) == [(40, -1)]
    assert feed(p, consumer, [41], now=REWIND_WAIT_S + 1) == [(41, None)]
    assert "going on" in caplog.text


def test_a_revoked_partition_forgets_its_rewind() -> None:
    p, consumer = ProcessedOffsets(), GroupOffsets({SPANS: 32})
    assert feed(p, consumer, [39]) == [(39, 32)]
    p.forget({SPANS})
    consumer._committed_offset[SPANS] = 39  # the next owner committed past them
    assert feed(p, consumer, [39]) == [(39, None)]


def test_a_tick_late_or_after_a_gap_says_the_worker_was_cut_off() -> None:
    from streams.commits import TickWatch

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
