-- The rollout engine's samples and the trainer service's capacity gauges,
-- both published on the hardware topic.

-- One row per scrape of one vLLM engine (rlpulse engine-poller): gauges as read, counters as rates
-- and TTFT percentiles over the interval since the previous scrape; NULL where the engine does not
-- export the figure. Keyed by run first, so a run's engines read together (engine-by-step).
CREATE TABLE IF NOT EXISTS {db}.engine_samples (
    project LowCardinality(String),
    run_id String,
    attempt UInt32,
    pod String,
    url String,
    engine LowCardinality(String),
    model_name LowCardinality(String),
    time_ns Int64,
    time DateTime64(9, 'UTC') DEFAULT fromUnixTimestamp64Nano(time_ns),
    interval_s Nullable(Float64),
    requests_running Nullable(Float64),
    requests_waiting Nullable(Float64),
    kv_cache_usage Nullable(Float64),
    preemptions_per_s Nullable(Float64),
    prompt_tokens_per_s Nullable(Float64),
    generation_tokens_per_s Nullable(Float64),
    ttft_count Nullable(Int64),
    ttft_p50_s Nullable(Float64),
    ttft_p90_s Nullable(Float64),
    ttft_p99_s Nullable(Float64),
    awake Nullable(UInt8),
    counter_resets UInt32
) ENGINE = ReplacingMergeTree
PARTITION BY toDate(time)
ORDER BY (project, run_id, attempt, pod, url, engine, time_ns)
TTL toDateTime(time) + INTERVAL {ttl_raw_days} DAY
SETTINGS non_replicated_deduplication_window = 10000;

-- One row per report of one service instance: a pool's figures (project '') or one project's claims
-- on a pool. Every instance reports the same values: queries take each instance's latest row and the
-- max across instances, never the sum (sinks/read/queries/capacity.sql).
CREATE TABLE IF NOT EXISTS {db}.capacity (
    pool String,
    serving Bool,
    accelerator LowCardinality(String),
    project String,
    instance String,
    time_ns Int64,
    time DateTime64(9, 'UTC') DEFAULT fromUnixTimestamp64Nano(time_ns),
    devices_declared Nullable(Int64),
    devices_observed Nullable(Int64),
    devices_granted Nullable(Int64),
    devices_queued Nullable(Int64),
    claims_granted Nullable(Int64),
    claims_queued Nullable(Int64),
    quota Nullable(Int64)
) ENGINE = ReplacingMergeTree
PARTITION BY toDate(time)
ORDER BY (pool, project, instance, time_ns)
TTL toDateTime(time) + INTERVAL {ttl_raw_days} DAY
SETTINGS non_replicated_deduplication_window = 10000;
