-- How each attempt of each run ended: its RUN_END status (finished, failed, cancelled), or
-- running while no RUN_END arrived. Params: none.
-- steps: completed steps (the highest step_count any event of the attempt carried); last_event:
-- the attempt's latest event time. Deduplicated with FINAL.
SELECT
    project,
    run_id,
    attempt,
    if(countIf(type = 'RUN_END') > 0, ifNull(argMaxIf(status, time_ns, type = 'RUN_END'), 'unknown'), 'running') AS status,
    max(step_count) AS steps,
    fromUnixTimestamp64Nano(max(time_ns)) AS last_event
FROM {db}.steps FINAL
GROUP BY project, run_id, attempt
ORDER BY project, run_id, attempt
