-- Per-step figures from the streams. Re-sent rows carry a later emitted_at_ns; the
-- ReplacingMergeTree keeps the latest per (run, attempt, step[, term]).
CREATE TABLE IF NOT EXISTS {db}.step_stats (
    project LowCardinality(String),
    run_id String,
    attempt UInt32,
    step Int64,
    rollouts UInt64,
    clipped UInt64,
    clipped_ratio Float64,
    reward_mean Float64,
    reward_std Float64,
    reward_min Float64,
    reward_max Float64,
    reward_zero_fraction Float64,
    completion_mean Float64,
    completion_min Int64,
    completion_max Int64,
    samples UInt64,
    samples_same_reward UInt64,
    sample_reward_spread_mean Float64,
    complete Bool,
    emitted_at_ns Int64,
    emitted_at DateTime64(9, 'UTC') DEFAULT fromUnixTimestamp64Nano(emitted_at_ns)
) ENGINE = ReplacingMergeTree(emitted_at_ns)
PARTITION BY toDate(emitted_at)
ORDER BY (project, run_id, attempt, step)
TTL toDateTime(emitted_at) + INTERVAL {ttl_aggregate_days} DAY
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS {db}.reward_histograms (
    project LowCardinality(String),
    run_id String,
    attempt UInt32,
    step Int64,
    term LowCardinality(String),
    bounds Array(Float64),
    bucket_counts Array(UInt64),
    count UInt64,
    sum Float64,
    min Float64,
    max Float64,
    zero_fraction Float64,
    emitted_at_ns Int64,
    emitted_at DateTime64(9, 'UTC') DEFAULT fromUnixTimestamp64Nano(emitted_at_ns)
) ENGINE = ReplacingMergeTree(emitted_at_ns)
PARTITION BY toDate(emitted_at)
ORDER BY (project, run_id, attempt, step, term)
TTL toDateTime(emitted_at) + INTERVAL {ttl_aggregate_days} DAY
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS {db}.completion_length_histograms (
    project LowCardinality(String),
    run_id String,
    attempt UInt32,
    step Int64,
    scale Int32,
    zero_count UInt64,
    offset Int32,
    bucket_counts Array(UInt64),
    count UInt64,
    sum Float64,
    min Float64,
    max Float64,
    emitted_at_ns Int64,
    emitted_at DateTime64(9, 'UTC') DEFAULT fromUnixTimestamp64Nano(emitted_at_ns)
) ENGINE = ReplacingMergeTree(emitted_at_ns)
PARTITION BY toDate(emitted_at)
ORDER BY (project, run_id, attempt, step)
TTL toDateTime(emitted_at) + INTERVAL {ttl_aggregate_days} DAY
SETTINGS non_replicated_deduplication_window = 10000;
