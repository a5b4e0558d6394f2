"""The one catalogue of names: topics, the record types on each, their keys and ClickHouse tables.

Record types and their fields come from the ``.avsc`` files (``rlpulse.schemas.codec.load_schemas``);
this module only says where each record type travels and lands. Every other module derives its
topic lists, table names and columns from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlpulse.schemas.codec import full_name


@dataclass(frozen=True)
class TopicSpec:
    short: str  # full topic name is ``<prefix>.<short>``
    records: tuple[str, ...]  # record full names allowed on it; anything else is a dead letter
    key: str  # what the message key is, for people reading this
    kind: str  # raw (published by jobs and pollers), derived (by the streams), otlp (OpenTelemetry's bytes), internal, dlq
    per_run: bool = True  # keyed by project/run_id, so co-partitioned with the run processor


def _records(*names: str) -> tuple[str, ...]:
    return tuple(full_name(n) for n in names)


TOPICS: tuple[TopicSpec, ...] = (
    TopicSpec("spans", _records("Span"), "project/run_id", "raw"),
    TopicSpec("steps", _records("Step"), "project/run_id", "raw"),
    TopicSpec("hardware", _records("GpuSample", "Placement", "EngineSample", "CapacitySample"),
              "hw_id (host/index without a UUID); engine_key for engine samples, the pool for capacity", "raw", per_run=False),
    TopicSpec("grader-failures", _records("GraderFailureWindow"), "project/run_id", "derived"),
    TopicSpec("grader-windows", _records("GraderWindow"), "project/run_id", "derived"),
    TopicSpec("step-stats", _records("StepStats"), "project/run_id", "derived"),
    TopicSpec("reward-histograms", _records("RewardHistogram"), "project/run_id", "derived"),
    TopicSpec("step-terms", _records("StepTermStats"), "project/run_id", "derived"),
    TopicSpec("length-histograms", _records("CompletionLengthHistogram"), "project/run_id", "derived"),
    TopicSpec("alerts", _records("Alert"), "project/run_id, or hw_id for GPU alerts, pod/engine for engine alerts", "derived"),
    # Wall-clock ticks, one message per partition every half second: a Faust table can only be
    # written while an event of its partition is processed, so idle runs are closed on these.
    TopicSpec("ticks", (), "none", "internal"),
    TopicSpec("dlq", (), "the original key", "dlq", per_run=False),
    # OTLP export requests (protobuf or JSON), as the Collector's kafka exporter and `rlpulse otlp`
    # write them; `rlpulse otlp-ingest` turns them into the records above.
    TopicSpec("otlp-spans", (), "the trace id as hex (the Collector's partition_traces_by_id), or none", "otlp",
              per_run=False),
    TopicSpec("otlp-metrics", (), "a hash of the resource attributes, or none", "otlp", per_run=False),
)
BY_SHORT = {t.short: t for t in TOPICS}
RAW_TOPICS = tuple(t.short for t in TOPICS if t.kind == "raw")
DERIVED_TOPICS = tuple(t.short for t in TOPICS if t.kind == "derived")
DLQ_TOPIC = "dlq"
TICKS_TOPIC = "ticks"
# The topics code names one by one (the streams' inputs and outputs); checked against TOPICS below.
SPANS_TOPIC = "spans"
STEPS_TOPIC = "steps"
HARDWARE_TOPIC = "hardware"
GRADER_FAILURES_TOPIC = "grader-failures"
GRADER_WINDOWS_TOPIC = "grader-windows"
STEP_STATS_TOPIC = "step-stats"
REWARD_HISTOGRAMS_TOPIC = "reward-histograms"
STEP_TERMS_TOPIC = "step-terms"
LENGTH_HISTOGRAMS_TOPIC = "length-histograms"
ALERTS_TOPIC = "alerts"
OTLP_SPANS_TOPIC = "otlp-spans"
OTLP_METRICS_TOPIC = "otlp-metrics"
OTLP_TOPICS = (OTLP_SPANS_TOPIC, OTLP_METRICS_TOPIC)
# The writer id of records translated from OTLP starts with this. They are numbered by the Kafka
# position of their OTLP message (``writer_sequence`` = offset << 16 | index, per OTLP partition:
# the writer id ends in ``@partition``), so a replay repeats the numbers; the numbers are sparse,
# and the streams do not count their jumps as lost records.
OTLP_WRITER_PREFIX = "otlp/"
_NAMED = (OTLP_SPANS_TOPIC, OTLP_METRICS_TOPIC,
          DLQ_TOPIC, TICKS_TOPIC, SPANS_TOPIC, STEPS_TOPIC, HARDWARE_TOPIC, GRADER_FAILURES_TOPIC, GRADER_WINDOWS_TOPIC,
          STEP_STATS_TOPIC, REWARD_HISTOGRAMS_TOPIC, STEP_TERMS_TOPIC, LENGTH_HISTOGRAMS_TOPIC, ALERTS_TOPIC)
if set(_NAMED) - set(BY_SHORT):  # a misspelt constant would name a topic nobody creates
    raise ImportError(f"topic constants not in TOPICS: {sorted(set(_NAMED) - set(BY_SHORT))}")

# The topics the run processor reads: co-partitioned by project/run_id.
RUN_TOPICS = (SPANS_TOPIC, STEPS_TOPIC, TICKS_TOPIC)
HARDWARE_TOPICS = (HARDWARE_TOPIC, TICKS_TOPIC)
# What the sink writes to ClickHouse.
SINK_TOPICS = RAW_TOPICS + DERIVED_TOPICS


def sink_topics(raw: bool = True) -> tuple[str, ...]:
    """The topics the sink reads: all of SINK_TOPICS, or the derived ones only when ClickHouse's
    Kafka engine loads the raw topics (RLPULSE_SINK_RAW=0)."""
    return SINK_TOPICS if raw else DERIVED_TOPICS

# Record full name -> ClickHouse table.
TABLES: dict[str, str] = {
    full_name("Span"): "spans",
    full_name("Step"): "steps",
    full_name("GpuSample"): "gpu_samples",
    full_name("Placement"): "placements",
    full_name("EngineSample"): "engine_samples",
    full_name("CapacitySample"): "capacity",
    full_name("GraderFailureWindow"): "grader_failures",
    full_name("GraderWindow"): "grader_windows",
    full_name("StepStats"): "step_stats",
    full_name("RewardHistogram"): "reward_histograms",
    full_name("StepTermStats"): "step_term_stats",
    full_name("CompletionLengthHistogram"): "completion_length_histograms",
    full_name("Alert"): "alerts",
}

# Each table's natural key: the columns of its ReplacingMergeTree ORDER BY as the migrations leave
# it (sinks/store/migrations/*.sql, the latest one to set it), so the rows ClickHouse deduplicates. A key
# part that is an expression of a column (placements: ifNull(hw_id, '')) is named by its column.
# tests/unit/schemas/test_natural_keys.py checks these against the migrations.
NATURAL_KEYS: dict[str, tuple[str, ...]] = {
    "spans": ("project", "run_id", "attempt", "sequence_id", "span_id"),
    "steps": ("project", "run_id", "attempt", "time_ns", "type", "writer_id", "sequence_id"),
    "gpu_samples": ("hw_id", "time_ns"),
    "placements": ("project", "run_id", "attempt", "role", "rank", "hw_id", "index", "time_ns"),
    "engine_samples": ("project", "run_id", "attempt", "pod", "url", "engine", "time_ns"),
    "capacity": ("pool", "project", "instance", "time_ns"),
    "grader_failures": ("project", "run_id", "attempt", "term", "cause", "window_start_ns"),
    "grader_windows": ("project", "run_id", "attempt", "term", "window_start_ns"),
    "step_stats": ("project", "run_id", "attempt", "step"),
    "reward_histograms": ("project", "run_id", "attempt", "step", "term"),
    "step_term_stats": ("project", "run_id", "attempt", "step", "term"),
    "completion_length_histograms": ("project", "run_id", "attempt", "step"),
    "alerts": ("rule", "key", "first_seen_ns", "state"),
}

# A key column filled from a record field of another name: table -> {column: field}. Empty today:
# the sink fills each key column from the record field of the same name (the unit test checks
# that every key column is a field of its record); a column renamed one day is mapped here.
KEY_FIELDS: dict[str, dict[str, str]] = {}


def record_key(record: str) -> tuple[str, ...]:
    """The natural key of ``record``'s table (a full record name), as that record's field names."""
    table = TABLES[record]
    fields = KEY_FIELDS.get(table, {})
    return tuple(fields.get(column, column) for column in NATURAL_KEYS[table])


def topic_key(short: str) -> tuple[str, ...]:
    """The natural key of the records on topic ``short``, which must carry one record type."""
    records = BY_SHORT[short].records
    if len(records) != 1:
        raise ValueError(f"topic {short} carries {len(records)} record types, not one: ask record_key per record")
    return record_key(records[0])

# The streams app's Faust tables (their changelog topics are created up front, see rlpulse.schemas.topics).
STREAM_TABLES = ("runs", "gpus")


def run_key(project: str, run_id: str) -> str:
    """The key of every span, step and run-derived message: all of a run lands on one partition."""
    return f"{project}/{run_id}"


def engine_key(pod: str, url: str, engine: str) -> str:
    """The key of an engine's samples on ``hardware`` and of its ``engine_saturated`` alert: the pod of
    the rollout server (its metrics URL when no pod was given) and vLLM's engine label."""
    return f"{pod or url}/{engine}"
