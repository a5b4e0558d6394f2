-- One row per (run, attempt, term, window): all causes and source partitions together, with
-- the grader-call duration percentiles. The latest emission wins.
CREATE TABLE IF NOT EXISTS {db}.grader_windows (
    project LowCardinality(String),
    run_id String,
    attempt UInt32,
    term LowCardinality(String),
    window_start_ns Int64,
    window_end_ns Int64,
    window_start DateTime64(3, 'UTC') DEFAULT fromUnixTimestamp64Nano(window_start_ns),
    window_end DateTime64(3, 'UTC') DEFAULT fromUnixTimestamp64Nano(window_end_ns),
    graded UInt64,
    failures UInt64,
    failure_rate Float64,
    duration_p50_s Float64,
    duration_p90_s Float64,
    duration_p99_s Float64,
    duration_max_s Float64,
    emitted_at_ns Int64
) ENGINE = ReplacingMergeTree(emitted_at_ns)
PARTITION BY toDate(window_start)
ORDER BY (project, run_id, attempt, term, window_start_ns)
TTL toDateTime(window_start) + INTERVAL {ttl_aggregate_days} DAY
SETTINGS non_replicated_deduplication_window = 10000;
