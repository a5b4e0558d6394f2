"""The benchmark's statistics helpers (pure functions; nothing here is timed)."""

from __future__ import annotations

import pytest

from bench.kafka_perf import PerfError, parse_consumer, parse_producer
from bench.stats import median, percentile, ratio, weighted_percentile


def test_median_skips_missing_figures() -> None:
    assert median([3.0, None, 1.0, 2.0]) == 2.0
    assert median([1.0, 2.0]) == 1.5
    assert median([None]) is None
    assert median([]) is None


def test_percentile_interpolates_between_ranks() -> None:
    values = [10.0, 1.0, 4.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 10.0
    assert percentile(values, 50) == 3.0
    assert percentile([1.0, 2.0], 50) == 1.5  # the median of an even sample
    assert percentile(list(map(float, range(101))), 99) == 99.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_weighted_percentile_equals_the_expanded_sample() -> None:
    pairs = [(0.5, 3), (0.1, 1), (2.0, 1), (0.9, 0)]  # a weight of 0 contributes nothing
    expanded = sorted([0.5, 0.5, 0.5, 0.1, 2.0])
    assert weighted_percentile(pairs, 50) == expanded[2]
    assert weighted_percentile(pairs, 20) == 0.1  # nearest rank 1
    assert weighted_percentile(pairs, 80) == 0.5  # nearest rank 4
    assert weighted_percentile(pairs, 99) == 2.0
    assert weighted_percentile(pairs, 100) == 2.0
    assert weighted_percentile([], 50) is None


def test_ratio_is_none_without_both_figures() -> None:
    assert ratio(50.0, 200.0) == 0.25
    assert ratio(None, 2.0) is None
    assert ratio(1.0, None) is None
    assert ratio(1.0, 0.0) is None


def test_kafka_tool_outputs_parse() -> None:
    producer = ("3463 records sent, 692.6 records/sec (19.82 MB/sec), 1224.2 ms avg latency, 1860.0 ms max latency.\n"
                "20000 records sent, 1311.561414 records/sec (37.52 MB/sec), 601.81 ms avg latency, 1860.00 ms max "
                "latency, 519 ms 50th, 1406 ms 95th, 1770 ms 99th, 1857 ms 99.9th.\n")
    assert parse_producer(producer) == {"records": 20000, "records_per_s": 1311.561414, "mb_per_s": 37.52,
                                        "latency_avg_ms": 601.81, "latency_p99_ms": 1770.0}
    consumer = ("start.time, end.time, data.consumed.in.MB, MB.sec, data.consumed.in.nMsg, nMsg.sec, rebalance.time.ms, "
                "fetch.time.ms, fetch.MB.sec, fetch.nMsg.sec\n"
                "2026-12-03 09:28:01:948, 2026-12-03 09:28:03:962, 572.2046, 284.1135, 20000, 9930.4866, 296, 1718, "
                "333.0644, 11641.4435\n")
    parsed = parse_consumer(consumer)
    assert parsed["messages"] == 20000 and parsed["fetch_messages_per_s"] == 11641.4435 and parsed["rebalance_ms"] == 296.0
    with pytest.raises(PerfError):
        parse_producer("nothing useful")
    with pytest.raises(PerfError):
        parse_consumer("start.time, end.time\n")
