-- Checkpoint saves and restores of one run: step, operation, outcome, duration, size and error.
-- Params (required): run_id: String.
-- From the CHECKPOINT spans (deduplicated with FINAL), in time order. mb_per_s: size over duration
-- (NULL when either is unknown or the duration is 0). A failed save fires checkpoint_failed.
SELECT
    project,
    run_id,
    attempt,
    step,
    checkpoint_op AS op,
    outcome,
    round((end_time_ns - start_time_ns) / 1e9, 3) AS duration_s,
    checkpoint_bytes AS bytes,
    round(if(end_time_ns > start_time_ns, checkpoint_bytes / ((end_time_ns - start_time_ns) / 1e9) / 1e6, NULL), 1) AS mb_per_s,
    status_message AS error,
    fromUnixTimestamp64Nano(end_time_ns) AS ended
FROM {db}.spans FINAL
WHERE run_id = {run_id:String} AND kind = 'CHECKPOINT'
ORDER BY project, attempt, end_time_ns
