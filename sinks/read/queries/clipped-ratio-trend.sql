-- Clipped ratio per step of one run and its change from the previous step.
-- Params (required): run_id: String, attempt: UInt32.
-- change = clipped_ratio - clipped_ratio of the previous step present (NULL for the first),
-- computed before rounding; both rounded to 4 digits.
-- Dedup: no FINAL. Per (project, step) the latest emission wins (argMax over emitted_at_ns).
SELECT
    step,
    rollouts,
    clipped,
    round(clipped_ratio, 4) AS clipped_ratio,
    round(clipped_ratio - lagInFrame(toNullable(clipped_ratio)) OVER (ORDER BY step ROWS BETWEEN 1 PRECEDING AND CURRENT ROW), 4) AS change
FROM
(
    SELECT
        step,
        argMax(rollouts, emitted_at_ns) AS rollouts,
        argMax(clipped, emitted_at_ns) AS clipped,
        argMax(clipped_ratio, emitted_at_ns) AS clipped_ratio
    FROM {db}.step_stats
    WHERE run_id = {run_id:String} AND attempt = {attempt:UInt32}
    GROUP BY project, step
)
ORDER BY step
