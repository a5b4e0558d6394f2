-- The vLLM figures beyond the first eight (seed 001, "Rollout engine"): the prefix cache's hit rate
-- over the interval (GRPO's shared prompts make it matter), the time requests waited before they
-- ran, and the inter-token latency. NULL where the engine does not export the figure, and in rows
-- written before this migration.
ALTER TABLE {db}.engine_samples
    ADD COLUMN IF NOT EXISTS prefix_cache_queries Nullable(Int64) AFTER counter_resets,
    ADD COLUMN IF NOT EXISTS prefix_cache_hit_rate Nullable(Float64) AFTER prefix_cache_queries,
    ADD COLUMN IF NOT EXISTS queue_time_count Nullable(Int64) AFTER prefix_cache_hit_rate,
    ADD COLUMN IF NOT EXISTS queue_time_mean_s Nullable(Float64) AFTER queue_time_count,
    ADD COLUMN IF NOT EXISTS queue_time_p50_s Nullable(Float64) AFTER queue_time_mean_s,
    ADD COLUMN IF NOT EXISTS queue_time_p90_s Nullable(Float64) AFTER queue_time_p50_s,
    ADD COLUMN IF NOT EXISTS itl_count Nullable(Int64) AFTER queue_time_p90_s,
    ADD COLUMN IF NOT EXISTS itl_mean_s Nullable(Float64) AFTER itl_count,
    ADD COLUMN IF NOT EXISTS itl_p50_s Nullable(Float64) AFTER itl_mean_s,
    ADD COLUMN IF NOT EXISTS itl_p90_s Nullable(Float64) AFTER itl_p50_s;
