-- Throughput and efficiency of one run, step by step: tokens, duration, tokens/s and MFU.
-- Params (required): run_id: String, attempt: UInt32.
-- From the attempt's STEP events; per (project, step) the latest one wins (a step repeated after a
-- restore shows its last run; a replayed event is the same event). time_ns: that event's time.
-- tokens: seed 001's step.tokens, as published. duration_s: the step's wall time, NULL when the
-- writer gave none (0). tokens_per_s: step.throughput as published; NULL when not a finite number
-- of 0 or more, and when 0 without a duration (the SDK's throughput without a duration_s).
-- mfu: step.mfu, the model FLOPs utilization of the policy update, from 0 to 1; NULL when none was
-- published and when the published value lies outside [0, 1] (or is not finite): such a step has
-- mfu_out_of_range = 1 (the steps table keeps the value as sent).
-- Dedup: no FINAL; LIMIT 1 BY (project, step), latest time_ns first.
SELECT
    project,
    run_id,
    attempt,
    step,
    time_ns,
    tokens,
    if(isFinite(sent_duration_s) AND sent_duration_s > 0, round(sent_duration_s, 3), NULL) AS duration_s,
    if(isFinite(sent_throughput) AND (sent_throughput > 0 OR (sent_throughput = 0 AND sent_duration_s > 0)),
       round(sent_throughput, 2), NULL) AS tokens_per_s,
    if(sent_mfu >= 0 AND sent_mfu <= 1, round(sent_mfu, 4), NULL) AS mfu,
    toUInt8(sent_mfu IS NOT NULL AND NOT (sent_mfu >= 0 AND sent_mfu <= 1)) AS mfu_out_of_range
FROM
(
    SELECT project, run_id, attempt, step, time_ns, tokens, duration_s AS sent_duration_s,
           throughput AS sent_throughput, mfu AS sent_mfu
    FROM {db}.steps
    WHERE run_id = {run_id:String} AND attempt = {attempt:UInt32} AND type = 'STEP'
    ORDER BY project, step, time_ns DESC
    LIMIT 1 BY project, step
)
ORDER BY project, step
