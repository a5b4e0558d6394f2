-- Runs stalled now: the latest stalled_run or first_step_stalled alert of each key
-- (project/run_id/attempt) is FIRING (the summary says which: no step completed yet, or a step
-- count that stopped rising). The two never overlap for a key: the first step resolves one before
-- the other can fire.
-- Params: none.
-- Dedup: no FINAL. The latest record per (rule, key) is picked with argMax over time_ns (a
-- replayed alert is an identical row, so duplicates pick the same values); when a FIRING and a
-- RESOLVED record share a time_ns, RESOLVED counts as the later one.
SELECT
    project,
    run_id,
    attempt,
    key,
    fromUnixTimestamp64Nano(first_seen_ns, 'UTC') AS stalled_since,
    fromUnixTimestamp64Nano(last_seen_ns, 'UTC') AS last_seen,
    value,
    threshold,
    summary
FROM
(
    SELECT
        key,
        argMax(state, (time_ns, state = 'RESOLVED')) AS latest_state,
        argMax(project, (time_ns, state = 'RESOLVED')) AS project,
        argMax(run_id, (time_ns, state = 'RESOLVED')) AS run_id,
        argMax(attempt, (time_ns, state = 'RESOLVED')) AS attempt,
        argMax(first_seen_ns, (time_ns, state = 'RESOLVED')) AS first_seen_ns,
        argMax(last_seen_ns, (time_ns, state = 'RESOLVED')) AS last_seen_ns,
        argMax(value, (time_ns, state = 'RESOLVED')) AS value,
        argMax(threshold, (time_ns, state = 'RESOLVED')) AS threshold,
        argMax(summary, (time_ns, state = 'RESOLVED')) AS summary
    FROM {db}.alerts
    WHERE rule IN ('stalled_run', 'first_step_stalled')
    GROUP BY key
)
WHERE latest_state = 'FIRING'
ORDER BY stalled_since, key
