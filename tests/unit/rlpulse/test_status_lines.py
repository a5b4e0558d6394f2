"""``rlpulse status``'s lines for one consumer group: a summary line, and with --detail a line per
partition (the broker's side is tests/integration/rlpulse/test_status_lag.py)."""

from __future__ import annotations

from rlpulse.status import group_lines
import pytest

pytestmark = pytest.mark.full  # new this round: make test stays under 6 minutes

ROWS = [("p.spans", 0, 10, 13), ("p.spans", 1, 7, 7), ("p.steps", 0, 4, 4), ("p.steps", 1, 100, 102),
        ("p.hardware", 0, 0, 0), ("p.hardware", 1, 5, 5)]


def test_a_group_behind_names_its_topics_in_order() -> None:
    assert group_lines("p-streams", ROWS, committed=True, state="Stable", members=2) == [
        "consumer group p-streams: lag 5, 6 partitions (3 topics), 2 members; behind on p.spans 3, p.steps 2"]


def test_detail_adds_a_line_per_partition_aligned() -> None:
    assert group_lines("p-streams", ROWS, committed=True, state="Stable", members=2, detail=True) == [
        "consumer group p-streams: lag 5, 6 partitions (3 topics), 2 members; behind on p.spans 3, p.steps 2",
        "  p.spans[0]      10 /  13 = 3",
        "  p.spans[1]       7 /   7 = 0",
        "  p.steps[0]       4 /   4 = 0",
        "  p.steps[1]     100 / 102 = 2",
        "  p.hardware[0]    0 /   0 = 0",
        "  p.hardware[1]    5 /   5 = 0",
    ]


def test_caught_up_empty_and_one_of_each() -> None:
    assert group_lines("p-sink", [("p.spans", 0, 3, 3)], committed=True, state="Empty", members=0) == [
        "consumer group p-sink: lag 0, 1 partition (1 topic), 0 members"]
    assert group_lines("p-sink", ROWS[:2], committed=True, state="Stable", members=1) == [
        "consumer group p-sink: lag 3, 2 partitions (1 topic), 1 member; behind on p.spans 3"]


def test_a_group_not_settled_or_never_committed_says_so() -> None:
    rows = [("p.spans", 0, 0, 4), ("p.spans", 1, 0, 0)]
    # Kafka answers Dead for a group it has no record of: no member, nothing committed
    assert group_lines("p-sink", rows, committed=False, state="Dead", members=0) == [
        "consumer group p-sink: lag 4, 2 partitions (1 topic), 0 members; behind on p.spans 4 "
        "(the group has not committed yet)"]
    assert group_lines("p-sink", rows, committed=True, state="PreparingRebalance", members=1) == [
        "consumer group p-sink: lag 4, 2 partitions (1 topic), 1 member (rebalancing); behind on p.spans 4"]
    assert group_lines("p-sink", rows, committed=True, state="Unknown", members=0) == [
        "consumer group p-sink: lag 4, 2 partitions (1 topic), 0 members (state unknown: its coordinator did not "
        "answer); behind on p.spans 4"]


def test_a_committed_offset_past_the_end_counts_no_lag() -> None:
    # after a topic is recreated the group's committed offset can lie past the new end: not a negative lag
    assert group_lines("g", [("p.spans", 0, 9, 2)], committed=True, state="Empty", members=0, detail=True) == [
        "consumer group g: lag 0, 1 partition (1 topic), 0 members", "  p.spans[0]  9 / 2 = 0"]
