"""The bench's table, each figure beside the committed baseline (``bench/results/baseline.json``).

Every figure with a direction is compared with the baseline's and printed as a ratio
(new / baseline); one more than ``WORSE`` (10 %) worse than the baseline is marked, so a
regression cannot pass unseen. The baseline is a ``latest.json`` of an earlier run, committed on
purpose (``make bench BENCH_ARGS=--save-baseline``), with the commit it measured in it.

The rates move with whatever else the machine runs; the CPU each process spends per event
(``*_cpu_us_per_event``) barely does, so that is the figure to read on a busy machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

WORSE = 0.10  # a figure this much worse than the baseline is marked


class Row(NamedTuple):
    key: str
    label: str
    unit: str
    target: str
    better: str  # "+" higher is better, "-" lower is better, "" not compared


# in the order the table prints them; targets as in docs/performance.md ("Targets and the current baseline")
TABLE = [
    Row("sdk_call_ns_median", "SDK call, median", "ns", "<= 2000", "-"),
    Row("sdk_call_ns_p99", "SDK call, p99", "ns", "", "-"),
    Row("sdk_floor_ns_median", "dict + append (floor), median", "ns", "", ""),
    Row("sdk_call_over_floor", "  SDK call / floor", "x", "<= 3", "-"),
    Row("sdk_call_ns_median_broker_down", "SDK call, broker down, median", "ns", "< 250000", "-"),
    Row("sdk_call_ns_p99_broker_down", "SDK call, broker down, p99", "ns", "< 1000000", "-"),
    Row("producer_events_per_s", "SDK -> Kafka", "events/s", "", "+"),
    Row("producer_ceiling_events_per_s", "ProducerPerformance ceiling", "events/s", "", ""),
    Row("producer_over_ceiling", "  SDK producer / ceiling", "x", "", "+"),
    Row("consumer_ceiling_events_per_s", "ConsumerPerformance ceiling", "events/s", "", ""),
    Row("broker_topics", "topics on the broker at the start", "", "", ""),
    Row("e2e_events_per_s", "backlog drain, streams + sink", "events/s", ">= 100000", "+"),
    Row("e2e_events_per_s_reps", "  each drain (median above)", "events/s", "", ""),
    Row("e2e_over_consumer_ceiling", "  drain / consumer ceiling", "x", "", "+"),
    Row("streams_only_events_per_s", "  streams alone reached lag 0 at", "events/s", "", "+"),
    Row("streams_cpu_us_per_event", "  streams CPU per event", "us", "", "-"),
    Row("sink_cpu_us_per_event", "  sink CPU per event", "us", "", "-"),
    Row("broker_cpu_us_per_event", "  broker CPU per event", "us", "", "-"),
    Row("startup_to_first_streams_commit_s", "start-up to first streams commit", "s", "", "-"),
    Row("e2e_exact", "figures exact vs truth", "", "true", ""),
    Row("e2e_latency_p50_s", "event -> row latency, p50", "s", "", "-"),
    Row("e2e_latency_p99_s", "event -> row latency, p99", "s", "< 1.5", "-"),
    Row("latency_events_per_s", "  at a live load of", "events/s", "", ""),
    Row("streams_peak_rss_mib", "streams peak RSS ({runs} runs)", "MiB", "< 500", "-"),
    Row("sink_peak_rss_mib", "sink peak RSS", "MiB", "", "-"),
    Row("ui_runs_s_max", "rlpulse ui, runs page, slowest of 5", "s", "< 1", "-"),
    Row("ui_run_s_max", "  a run of 1,000 steps x 512 rollouts", "s", "< 1", "-"),
    Row("ui_step_s_max", "  a step's 512 trajectories", "s", "< 1", "-"),
    Row("ui_trajectory_s_max", "  a trajectory", "s", "< 1", "-"),
    Row("ui_compare_8_s_max", "  8 runs compared, by step", "s", "< 1", "-"),
    Row("ui_compare_8_time_smooth_s_max", "  8 runs compared, by time, smoothed, 2 metrics", "s", "< 1", "-"),
    Row("ui_search_s_max", "  search of 512,000 trajectories, reward + failed", "s", "< 1", "-"),
    Row("ui_search_text_s_max", "  search by text in the dialogues", "s", "< 1", "-"),
    Row("ui_search_page_40_s_max", "  search, page 40", "s", "< 1", "-"),
    Row("ui_within_target", "  every page 200 and within 1 s", "", "true", ""),
]


def load_baseline(path: Path) -> dict[str, Any] | None:
    """The committed baseline's figures; None when there is none (the table then has no ratios)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def compare(results: dict[str, Any], baseline: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """key -> {"ratio": new / baseline, "worse": more than WORSE worse} for every comparable figure."""
    out: dict[str, dict[str, Any]] = {}
    for row in TABLE:
        new, old = results.get(row.key), baseline.get(row.key)
        if not row.better or not _number(new) or not _number(old) or old == 0:
            continue
        r = new / old
        worse = r < 1 - WORSE if row.better == "+" else r > 1 + WORSE
        out[row.key] = {"ratio": round(r, 3), "worse": worse}
    return out


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(value: Any, unit: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return " / ".join(_fmt(v, unit) for v in value)
    if isinstance(value, bool):
        return str(value).lower()
    if unit == "x":
        return f"{value:.2f}"
    if unit in ("s", "us"):
        return f"{value:.3f}"
    return f"{value:,.0f}" if isinstance(value, (int, float)) else str(value)


def table(r: dict[str, Any], ratios: dict[str, dict[str, Any]] | None = None, baseline_commit: str | None = None) -> str:
    """The figures as a table; with ``ratios`` (see :func:`compare`) a column against the baseline."""
    runs = f"{r['e2e_runs']:,}" if r.get("e2e_runs") else "?"
    ratios = ratios or {}

    def versus(key: str) -> str:
        c = ratios.get(key)
        return "" if c is None else f"{c['ratio']:.2f}x" + ("  WORSE" if c["worse"] else "")

    def value(row: Row) -> str:
        status = r.get(row.key.removesuffix("_s_max") + "_status")  # a ui page that did not answer 200 has no time
        return f"HTTP {status}" if r.get(row.key) is None and status not in (None, 200) else _fmt(r.get(row.key), row.unit)

    rows = [(row.label.format(runs=runs), value(row), row.unit, row.target, versus(row.key)) for row in TABLE]
    head = ("figure", "value", "unit", "target", f"vs baseline {baseline_commit}" if baseline_commit else "")
    w = [max(len(x[i]) for x in [*rows, head]) for i in range(5)]
    lines = [f"{head[0].ljust(w[0])}  {head[1].rjust(w[1])}  {head[2].ljust(w[2])}  {head[3].ljust(w[3])}  {head[4]}",
             "-" * (sum(w) + 8)]
    lines += [f"{a.ljust(w[0])}  {b.rjust(w[1])}  {c.ljust(w[2])}  {d.ljust(w[3])}  {e}".rstrip() for a, b, c, d, e in rows]
    worse = [row.label.format(runs=runs).strip() for row in TABLE if ratios.get(row.key, {}).get("worse")]
    if worse:
        lines.append(f"\n{len(worse)} figure(s) more than {WORSE:.0%} worse than the baseline: {', '.join(worse)}")
    return "\n".join(lines)
