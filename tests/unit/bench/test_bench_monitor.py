"""The benchmark's bookkeeping: offsets to events, lag, profiles, options (nothing timed)."""

from __future__ import annotations

import argparse
import os

import pytest
from aiokafka import TopicPartition

from bench.monitor import EventIndex, OffsetSample, RssSampler, process_tree, summarize_profile
from bench.options import add_arguments, to_argv

A, B = TopicPartition("x.spans", 0), TopicPartition("x.spans", 1)


def test_event_index_converts_committed_offsets_to_events() -> None:
    index = EventIndex()
    for offset, records in ((0, 200), (1, 200), (2, 50)):
        index.add(A, offset, records)
    index.add(B, 5, 10)  # a partition whose first offsets hold something else (e.g. a transaction marker)
    assert index.total == 460
    assert index.events_before(A, 0) == 0
    assert index.events_before(A, 1) == 200  # a committed offset is the next message to read
    assert index.events_before(A, 3) == 450
    assert index.events_before(A, 99) == 450
    assert index.events_before(B, 5) == 0 and index.events_before(B, 6) == 10
    assert index.events_committed({A: 2, B: 6}) == 410
    assert index.events_committed({}) == 0
    with pytest.raises(ValueError):
        index.add(A, 1, 5)


def test_lag_counts_uncommitted_messages_of_the_named_topics() -> None:
    other = TopicPartition("x.grader-failures", 0)
    s = OffsetSample(t=0.0, end={A: 10, B: 4, other: 7}, committed={"g": {A: 10, B: 1}})
    assert s.lag("g", ("x.spans",)) == 3
    assert s.lag("g", ("x.spans", "x.grader-failures")) == 10  # never committed: all of it
    assert s.lag("unknown", ("x.spans",)) == 14


def test_profile_summary_adds_up_a_functions_lines() -> None:
    collapsed = "\n".join([
        "main (app.py:1);loop (app.py:10);decode (codec.py:5) 6",
        "main (app.py:1);loop (app.py:10);decode (codec.py:7) 2",
        "main (app.py:1);loop (app.py:12) 2",
        "garbage line",
    ])
    lines = summarize_profile(collapsed, top=3)
    assert lines[0].startswith("10 samples")
    assert lines[1].strip() == "80.0%  decode (codec.py)"
    assert lines[2].strip() == "20.0%  loop (app.py)"
    inclusive = lines[lines.index(next(x for x in lines if x.startswith("inclusive"))) + 1:]
    assert inclusive[0].strip() in ("100.0%  main (app.py)", "100.0%  loop (app.py)")
    assert summarize_profile("") == ["(no samples)"]


def test_rss_of_this_process_tree() -> None:
    assert os.getpid() in process_tree(os.getpid())
    rss = RssSampler({"me": os.getpid()})
    rss.sample()
    assert rss.peaks_mib()["me"] > 1


def test_options_round_trip_to_a_command_line() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = ["--runs", "20", "--quick", "--latency-s", "2.5", "--keep"]
    back = to_argv(p.parse_args(argv))
    assert p.parse_args(back) == p.parse_args(argv)
    assert to_argv(p.parse_args([])) == []
