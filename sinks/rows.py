"""Decoded Avro records -> ClickHouse rows: one table per record type, columns by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

Record = dict[str, Any]


def _hex(value: bytes | None) -> str | None:
    return None if value is None else value.hex()


def _span(r: Record) -> Record:
    # Map values are typed unions in Avro; ClickHouse keeps them as text, keys sorted.
    attrs = {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in sorted(r["attributes"].items())}
    return {**r, "trace_id": r["trace_id"].hex(), "span_id": r["span_id"].hex(),
            "parent_span_id": _hex(r["parent_span_id"]), "attributes": attrs}


def _same(r: Record) -> Record:
    return r


@dataclass(frozen=True)
class TableSpec:
    table: str
    columns: tuple[str, ...]
    convert: Callable[[Record], Record]

    def row(self, record: Record) -> list[Any]:
        converted = self.convert(record)
        return [converted[c] for c in self.columns]


_SPAN_COLUMNS = (
    "project", "run_id", "attempt", "stage", "trace_id", "span_id", "parent_span_id", "name", "kind",
    "start_time_ns", "end_time_ns", "status", "status_message", "rollout_id", "attempt_id", "sequence_id",
    "step", "attributes", "term", "outcome", "score", "judge_input_tokens", "judge_output_tokens", "reward",
    "term_shares", "completion_tokens", "max_tokens", "clipped", "sample_id",
)
_STEP_COLUMNS = ("project", "run_id", "attempt", "stage", "time_ns", "type", "trainer", "step", "step_count",
                 "tokens", "duration_s", "throughput", "mfu", "dropped_events")
_GPU_COLUMNS = ("project", "run_id", "attempt", "time_ns", "hw_id", "index", "host", "node", "pod", "rank", "role",
                "power_w", "temperature_c", "gpu_utilization", "memory_used_bytes", "memory_total_bytes",
                "memory_utilization", "memory_activity", "sm_clock_mhz", "throttle_reasons", "xid_errors", "xid_last")
_PLACEMENT_COLUMNS = ("project", "run_id", "attempt", "stage", "time_ns", "role", "rank", "pod", "node", "host",
                      "index", "hw_id")
_GRADER_COLUMNS = ("project", "run_id", "attempt", "term", "cause", "window_start_ns", "window_end_ns", "failures",
                   "graded", "source_partition", "emitted_at_ns")
_STEP_STATS_COLUMNS = (
    "project", "run_id", "attempt", "step", "rollouts", "clipped", "clipped_ratio", "reward_mean", "reward_std",
    "reward_min", "reward_max", "reward_zero_fraction", "completion_mean", "completion_min", "completion_max",
    "samples", "samples_same_reward", "sample_reward_spread_mean", "complete", "emitted_at_ns",
)
_REWARD_HIST_COLUMNS = ("project", "run_id", "attempt", "step", "term", "bounds", "bucket_counts", "count", "sum",
                        "min", "max", "zero_fraction", "emitted_at_ns")
_LENGTH_HIST_COLUMNS = ("project", "run_id", "attempt", "step", "scale", "zero_count", "offset", "bucket_counts",
                        "count", "sum", "min", "max", "emitted_at_ns")
_GRADER_WINDOW_COLUMNS = ("project", "run_id", "attempt", "term", "window_start_ns", "window_end_ns", "graded",
                          "failures", "failure_rate", "duration_p50_s", "duration_p90_s", "duration_p99_s",
                          "duration_max_s", "emitted_at_ns")
_ALERT_COLUMNS = ("rule", "state", "key", "severity", "summary", "value", "threshold", "project", "run_id", "attempt",
                  "time_ns", "first_seen_ns", "last_seen_ns")

# Avro full name -> where its records go.
TABLES: dict[str, TableSpec] = {
    "rlpulse.v1.Span": TableSpec("spans", _SPAN_COLUMNS, _span),
    "rlpulse.v1.Step": TableSpec("steps", _STEP_COLUMNS, _same),
    "rlpulse.v1.GpuSample": TableSpec("gpu_samples", _GPU_COLUMNS, _same),
    "rlpulse.v1.Placement": TableSpec("placements", _PLACEMENT_COLUMNS, _same),
    "rlpulse.v1.GraderFailureWindow": TableSpec("grader_failures", _GRADER_COLUMNS, _same),
    "rlpulse.v1.Alert": TableSpec("alerts", _ALERT_COLUMNS, _same),
    "rlpulse.v1.GraderWindow": TableSpec("grader_windows", _GRADER_WINDOW_COLUMNS, _same),
    "rlpulse.v1.StepStats": TableSpec("step_stats", _STEP_STATS_COLUMNS, _same),
    "rlpulse.v1.RewardHistogram": TableSpec("reward_histograms", _REWARD_HIST_COLUMNS, _same),
    "rlpulse.v1.CompletionLengthHistogram": TableSpec("completion_length_histograms", _LENGTH_HIST_COLUMNS, _same),
}

# Topic short name -> the record types allowed on it; anything else is a dead letter.
TOPIC_RECORDS: dict[str, tuple[str, ...]] = {
    "spans": ("rlpulse.v1.Span",),
    "steps": ("rlpulse.v1.Step",),
    "hardware": ("rlpulse.v1.GpuSample", "rlpulse.v1.Placement"),
    "grader-failures": ("rlpulse.v1.GraderFailureWindow",),
    "alerts": ("rlpulse.v1.Alert",),
    "grader-windows": ("rlpulse.v1.GraderWindow",),
    "step-stats": ("rlpulse.v1.StepStats",),
    "reward-histograms": ("rlpulse.v1.RewardHistogram",),
    "length-histograms": ("rlpulse.v1.CompletionLengthHistogram",),
}
