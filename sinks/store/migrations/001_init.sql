-- Tables of the rlpulse database. {db} is replaced by the database name.
-- Idempotency: each table is a ReplacingMergeTree on the event's natural key, and the sink
-- also sends an insert_deduplication_token per topic-partition-offset range.
CREATE TABLE IF NOT EXISTS {db}.spans (
    project LowCardinality(String),
    run_id String,
    attempt UInt32,
    stage LowCardinality(String),
    trace_id String,
    span_id String,
    parent_span_id Nullable(String),
    name String,
    kind LowCardinality(String),
    start_time_ns Int64,
    end_time_ns Int64,
    start_time DateTime64(9, 'UTC') DEFAULT fromUnixTimestamp64Nano(start_time_ns),
    end_time DateTime64(9, 'UTC') DEFAULT fromUnixTimestamp64Nano(end_time_ns),
    status LowCardinality(String),
    status_message String,
    rollout_id String,
    attempt_id String,
    sequence_id UInt64,
    step Nullable(Int64),
    attributes Map(String, String),
    term LowCardinality(Nullable(String)),
    outcome LowCardinality(Nullable(String)),
    score Nullable(Float64),
    judge_input_tokens Nullable(Int64),
    judge_output_tokens Nullable(Int64),
    reward Nullable(Float64),
    term_shares Map(String, Float64),
    completion_tokens Nullable(Int64),
    max_tokens Nullable(Int64),
    clipped Nullable(Bool),
    sample_id Nullable(String)
) ENGINE = ReplacingMergeTree
PARTITION BY toDate(end_time)
ORDER BY (project, run_id, attempt, sequence_id, span_id)
TTL toDateTime(end_time) + INTERVAL {ttl_raw_days} DAY
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS {db}.steps (
    project LowCardinality(String),
    run_id String,
    attempt UInt32,
    stage LowCardinality(String),
    time_ns Int64,
    time DateTime64(9, 'UTC') DEFAULT fromUnixTimestamp64Nano(time_ns),
    type LowCardinality(String),
    trainer LowCardinality(String),
    step Int64,
    step_count UInt64,
    tokens UInt64,
    duration_s Float64,
    throughput Float64,
    mfu Nullable(Float64),
    dropped_events UInt64
) ENGINE = ReplacingMergeTree
PARTITION BY toDate(time)
ORDER BY (project, run_id, attempt, time_ns, type)
TTL toDateTime(time) + INTERVAL {ttl_raw_days} DAY
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS {db}.gpu_samples (
    project LowCardinality(String),
    run_id String,
    attempt UInt32,
    time_ns Int64,
    time DateTime64(9, 'UTC') DEFAULT fromUnixTimestamp64Nano(time_ns),
    hw_id String,
    `index` UInt32,
    host LowCardinality(String),
    node LowCardinality(String),
    pod String,
    rank Nullable(Int32),
    role LowCardinality(Nullable(String)),
    power_w Float64,
    temperature_c Float64,
    gpu_utilization Float64,
    memory_used_bytes UInt64,
    memory_total_bytes UInt64,
    memory_utilization Float64,
    memory_activity Float64,
    sm_clock_mhz Float64,
    throttle_reasons UInt64,
    xid_errors UInt64,
    xid_last Nullable(Int64)
) ENGINE = ReplacingMergeTree
PARTITION BY toDate(time)
ORDER BY (hw_id, time_ns)
TTL toDateTime(time) + INTERVAL {ttl_raw_days} DAY
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS {db}.placements (
    project LowCardinality(String),
    run_id String,
    attempt UInt32,
    stage LowCardinality(String),
    time_ns Int64,
    time DateTime64(9, 'UTC') DEFAULT fromUnixTimestamp64Nano(time_ns),
    role LowCardinality(String),
    rank Int32,
    pod String,
    node LowCardinality(String),
    host LowCardinality(String),
    `index` Nullable(Int32),
    hw_id Nullable(String)
) ENGINE = ReplacingMergeTree
PARTITION BY toDate(time)
ORDER BY (project, run_id, attempt, role, rank, time_ns)
TTL toDateTime(time) + INTERVAL {ttl_raw_days} DAY
SETTINGS non_replicated_deduplication_window = 10000;

-- One row per (run, attempt, term, cause, window, source partition): the streams count each
-- source partition on its own, so totals are sum(failures) / sum(graded) over source_partition.
CREATE TABLE IF NOT EXISTS {db}.grader_failures (
    project LowCardinality(String),
    run_id String,
    attempt UInt32,
    term LowCardinality(String),
    cause LowCardinality(String),
    window_start_ns Int64,
    window_end_ns Int64,
    window_start DateTime64(3, 'UTC') DEFAULT fromUnixTimestamp64Nano(window_start_ns),
    window_end DateTime64(3, 'UTC') DEFAULT fromUnixTimestamp64Nano(window_end_ns),
    failures UInt64,
    graded UInt64,
    failure_rate Float64 DEFAULT if(graded = 0, 0, failures / graded),
    source_partition UInt32,
    emitted_at_ns Int64
) ENGINE = ReplacingMergeTree(emitted_at_ns)
PARTITION BY toDate(window_start)
ORDER BY (project, run_id, attempt, term, cause, window_start_ns, source_partition)
TTL toDateTime(window_start) + INTERVAL {ttl_aggregate_days} DAY
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS {db}.alerts (
    rule LowCardinality(String),
    state LowCardinality(String),
    key String,
    severity LowCardinality(String),
    summary String,
    value Float64,
    threshold Float64,
    project LowCardinality(String),
    run_id String,
    attempt UInt32,
    time_ns Int64,
    time DateTime64(9, 'UTC') DEFAULT fromUnixTimestamp64Nano(time_ns),
    first_seen_ns Int64,
    last_seen_ns Int64
) ENGINE = ReplacingMergeTree
PARTITION BY toDate(time)
ORDER BY (rule, key, first_seen_ns, state)
TTL toDateTime(time) + INTERVAL {ttl_aggregate_days} DAY
SETTINGS non_replicated_deduplication_window = 10000;
