-- The rollout engines of one run, step by step: requests running and waiting, KV-cache usage, token
-- and preemption rates, time to first token, the prefix cache's hit rate, the time requests waited
-- before they ran, the inter-token latency, and the share of samples the engines were awake.
-- Params (required): run_id: String, attempt: UInt32.
-- A step spans from the end of the step before it (its STEP event; the attempt's RUN_START for the
-- first) to its own STEP event; an engine sample belongs to the step whose span holds its time
-- (ASOF join on the step ends). Per step and engine the samples are averaged (the largest for
-- waiting, KV usage and TTFT p99), then the engines are added up (rates, running) or the largest
-- taken (waiting, KV usage, TTFT p99). awake_share < 1: the engines slept in that step, as while the
-- actor updates; a step shorter than the scrape interval may have no sample at all.
-- prefix_cache_hit_rate is the step's hits over its queries, tokens of every engine and sample (each
-- sample's rate weighted by its queries); queue_time_mean_s and itl_mean_s are the step's means over
-- every observation (each sample's mean weighted by its count); the p90s are the largest sample's.
-- NULL where no engine exported the figure or nothing was observed in the step.
-- Dedup: steps FINAL; engine samples one row per natural key (LIMIT 1 BY).
WITH
    marks AS
    (
        SELECT run_id, step, max(time_ns) AS at_ns
        FROM {db}.steps FINAL
        WHERE run_id = {run_id:String} AND attempt = {attempt:UInt32} AND type IN ('STEP', 'RUN_START')
        GROUP BY run_id, step
    ),
    bounds AS
    (
        SELECT
            run_id, step, at_ns AS to_ns,
            lagInFrame(at_ns, 1, toInt64(0)) OVER (ORDER BY at_ns, step ROWS BETWEEN 1 PRECEDING AND CURRENT ROW) AS from_ns
        FROM marks
    ),
    samples AS
    (
        SELECT run_id, pod, url, engine, time_ns, requests_running, requests_waiting, kv_cache_usage,
               prompt_tokens_per_s, generation_tokens_per_s, preemptions_per_s, ttft_count, ttft_p50_s, ttft_p99_s, awake,
               prefix_cache_queries, prefix_cache_hit_rate, queue_time_count, queue_time_mean_s, queue_time_p90_s,
               itl_count, itl_mean_s, itl_p90_s
        FROM {db}.engine_samples
        WHERE run_id = {run_id:String} AND attempt = {attempt:UInt32}
        LIMIT 1 BY project, pod, url, engine, time_ns
    ),
    per_engine AS
    (
        SELECT
            b.step AS step, s.pod AS pod, s.url AS url, s.engine AS engine,
            count() AS samples,
            avg(s.requests_running) AS running,
            max(s.requests_waiting) AS waiting,
            max(s.kv_cache_usage) AS kv_max,
            avg(s.kv_cache_usage) AS kv_mean,
            avg(s.prompt_tokens_per_s) AS prompt_rate,
            avg(s.generation_tokens_per_s) AS generation_rate,
            avg(s.preemptions_per_s) AS preemption_rate,
            sum(s.ttft_count) AS ttft_count,
            sum(s.ttft_p50_s * s.ttft_count) AS ttft_p50_weighted,
            max(s.ttft_p99_s) AS ttft_p99,
            sum(s.awake) AS awake_samples,
            count(s.awake) AS sleep_known,
            sumIf(s.prefix_cache_queries, s.prefix_cache_hit_rate IS NOT NULL) AS prefix_queries,
            sum(s.prefix_cache_hit_rate * s.prefix_cache_queries) AS prefix_hits,
            sumIf(s.queue_time_count, s.queue_time_mean_s IS NOT NULL) AS queue_count,
            sum(s.queue_time_mean_s * s.queue_time_count) AS queue_seconds,
            max(s.queue_time_p90_s) AS queue_p90,
            sumIf(s.itl_count, s.itl_mean_s IS NOT NULL) AS itl_count,
            sum(s.itl_mean_s * s.itl_count) AS itl_seconds,
            max(s.itl_p90_s) AS itl_p90
        FROM samples AS s
        ASOF INNER JOIN bounds AS b ON s.run_id = b.run_id AND s.time_ns <= b.to_ns
        WHERE s.time_ns > b.from_ns AND b.step >= 0
        GROUP BY step, pod, url, engine
    )
SELECT
    step,
    count() AS engines,
    sum(samples) AS samples,
    round(sum(running), 2) AS requests_running,
    max(waiting) AS requests_waiting_max,
    round(max(kv_max), 3) AS kv_cache_usage_max,
    round(avg(kv_mean), 3) AS kv_cache_usage_mean,
    round(sum(prompt_rate), 1) AS prompt_tokens_per_s,
    round(sum(generation_rate), 1) AS generation_tokens_per_s,
    round(sum(preemption_rate), 3) AS preemptions_per_s,
    if(sum(ttft_count) > 0, round(sum(ttft_p50_weighted) / sum(ttft_count), 3), NULL) AS ttft_p50_s,
    round(max(ttft_p99), 3) AS ttft_p99_s_max,
    if(sum(sleep_known) > 0, round(sum(awake_samples) / sum(sleep_known), 3), NULL) AS awake_share,
    if(sum(prefix_queries) > 0, round(sum(prefix_hits) / sum(prefix_queries), 3), NULL) AS prefix_cache_hit_rate,
    if(sum(queue_count) > 0, round(sum(queue_seconds) / sum(queue_count), 3), NULL) AS queue_time_mean_s,
    round(max(queue_p90), 3) AS queue_time_p90_s_max,
    if(sum(itl_count) > 0, round(sum(itl_seconds) / sum(itl_count), 4), NULL) AS itl_mean_s,
    round(max(itl_p90), 4) AS itl_p90_s_max
FROM per_engine
GROUP BY step
ORDER BY step
