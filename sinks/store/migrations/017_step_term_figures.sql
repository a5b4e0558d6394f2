-- Seed 001's per-term figures of a step: the term's share mean and spread, and its grader calls
-- (durations, failures and what they cost, judge tokens); and the share of sample groups whose
-- rollouts all scored the same (TRL's frac_reward_zero_std).
CREATE TABLE IF NOT EXISTS {db}.step_term_stats (
    project LowCardinality(String),
    run_id String,
    attempt UInt32,
    step Int64,
    term LowCardinality(String),
    rollouts UInt64,
    share_mean Float64,
    share_std Float64,
    share_zero_fraction Float64,
    graded UInt64,
    failures UInt64,
    failure_rate Float64,
    failure_cost Nullable(Float64),
    duration_p50_s Float64,
    duration_p90_s Float64,
    duration_p99_s Float64,
    duration_max_s Float64,
    judge_input_tokens UInt64,
    judge_output_tokens UInt64,
    emitted_at_ns Int64,
    emitted_at DateTime64(9, 'UTC') DEFAULT fromUnixTimestamp64Nano(emitted_at_ns)
) ENGINE = ReplacingMergeTree(emitted_at_ns)
PARTITION BY toDate(emitted_at)
ORDER BY (project, run_id, attempt, step, term)
TTL toDateTime(emitted_at) + INTERVAL {ttl_aggregate_days} DAY
SETTINGS non_replicated_deduplication_window = 10000;

ALTER TABLE {db}.step_stats
    ADD COLUMN IF NOT EXISTS zero_std_fraction Nullable(Float64) AFTER samples_same_reward;
ALTER TABLE {db}.step_term_stats MODIFY SETTING merge_selector_base = 20;
