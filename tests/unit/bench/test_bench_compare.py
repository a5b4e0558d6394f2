"""make bench's comparison with the committed baseline: the ratio of every figure, the worse ones marked."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench.compare import TABLE, compare, load_baseline, table
from bench.monitor import CpuMeter, cpu_seconds


def test_a_figure_more_than_ten_percent_worse_is_marked_in_either_direction() -> None:
    baseline = {"e2e_events_per_s": 100_000, "e2e_latency_p99_s": 1.0, "streams_cpu_us_per_event": 10.0,
                "sdk_call_ns_median": 1000, "e2e_exact": True, "git_commit": "abc1234"}
    new = {"e2e_events_per_s": 89_000, "e2e_latency_p99_s": 1.05, "streams_cpu_us_per_event": 11.5,
           "sdk_call_ns_median": 800, "e2e_exact": True}
    c = compare(new, baseline)
    assert c == {"e2e_events_per_s": {"ratio": 0.89, "worse": True},  # fewer events/s: worse
                 "e2e_latency_p99_s": {"ratio": 1.05, "worse": False},  # 5 % more latency: within 10 %
                 "streams_cpu_us_per_event": {"ratio": 1.15, "worse": True},  # more CPU: worse
                 "sdk_call_ns_median": {"ratio": 0.8, "worse": False}}  # a faster call: better
    text = table(new, c, baseline["git_commit"])
    assert "vs baseline abc1234" in text
    drain = next(line for line in text.splitlines() if line.startswith("backlog drain"))
    assert drain.endswith("0.89x  WORSE")
    assert "2 figure(s) more than 10% worse than the baseline: backlog drain, streams + sink, streams CPU per event" in text


def test_figures_missing_on_either_side_are_not_compared(tmp_path: Path) -> None:
    assert compare({"e2e_events_per_s": None}, {"e2e_events_per_s": 5.0}) == {}
    assert compare({"e2e_events_per_s": 5.0}, {}) == {}
    assert load_baseline(tmp_path / "none.json") is None
    (tmp_path / "b.json").write_text(json.dumps({"e2e_events_per_s": 1}))
    assert load_baseline(tmp_path / "b.json") == {"e2e_events_per_s": 1}
    assert "WORSE" not in table({}, {})


def test_every_design_key_has_a_row() -> None:
    keys = {row.key for row in TABLE}
    for key in ("sdk_call_ns_median", "sdk_call_ns_p99", "sdk_floor_ns_median", "producer_events_per_s",
                "producer_ceiling_events_per_s", "e2e_events_per_s", "e2e_latency_p50_s", "e2e_latency_p99_s",
                "consumer_ceiling_events_per_s", "streams_peak_rss_mib", "sink_peak_rss_mib"):
        assert key in keys


def test_the_committed_baseline_reads() -> None:
    baseline = load_baseline(Path(__file__).resolve().parents[3] / "bench" / "results" / "baseline.json")
    assert baseline is not None and baseline["e2e_exact"] is True and baseline["e2e_events_per_s"] > 0


def test_cpu_meter_counts_this_process() -> None:
    meter = CpuMeter({"me": os.getpid()})
    meter.start()
    before = cpu_seconds([os.getpid()])
    while cpu_seconds([os.getpid()]) - before < 0.05:
        sum(i * i for i in range(10_000))
    assert meter.stop()["me"] >= 0.05
    assert cpu_seconds([2**22 + 12345]) == 0.0  # a process that is gone counts nothing
