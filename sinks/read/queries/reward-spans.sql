-- Every reward of one rollout in start order (seed 003's find_reward_spans): its ROLLOUT span's reward,
-- each REWARD entry's, each reward annotation's (emit_reward: intermediate, or final), with the one that is
-- the trajectory's final reward marked.
-- Params (required): run_id: String, attempt: UInt32, rollout_id: String.
-- The final reward (seed 003's find_final_reward, as `rlpulse export` reads it): the ROLLOUT span's, else
-- the latest REWARD entry's, else the latest final annotation's. Positions are sequence ids (start order).
-- Dedup: no FINAL. One row per span_id of the rollout (LIMIT 1 BY span_id).
WITH
    rewards AS
    (
        SELECT
            sequence_id, span_id, name, kind, reward, step, start_time_ns,
            multiIf(kind = 'ROLLOUT', 'rollout', kind = 'REWARD', 'reward_entry', 'annotation') AS source,
            attributes['rlpulse.reward.final'] IN ('true', '1') AS marked_final,
            attributes['rlpulse.reward.name'] AS reward_name
        FROM {db}.spans
        WHERE run_id = {run_id:String} AND attempt = {attempt:UInt32} AND rollout_id = {rollout_id:String}
          AND reward IS NOT NULL AND kind IN ('ROLLOUT', 'REWARD', 'ANNOTATION')
        ORDER BY span_id, sequence_id
        LIMIT 1 BY span_id
    ),
    chosen AS
    (
        SELECT multiIf(countIf(source = 'rollout') > 0, argMaxIf(span_id, sequence_id, source = 'rollout'),
                       countIf(source = 'reward_entry') > 0, argMaxIf(span_id, sequence_id, source = 'reward_entry'),
                       argMaxIf(span_id, sequence_id, source = 'annotation' AND marked_final)) AS final_span
        FROM rewards
    )
SELECT
    r.sequence_id AS sequence_id,
    r.source AS source,
    if(r.source = 'annotation', if(r.marked_final, 'final', 'intermediate'), r.source) AS role,
    r.reward AS reward,
    r.span_id = c.final_span AS is_final_reward,
    r.reward_name AS reward_name,
    r.name AS span_name,
    r.span_id AS span_id,
    r.step AS step,
    fromUnixTimestamp64Nano(r.start_time_ns, 'UTC') AS time
FROM rewards AS r
CROSS JOIN chosen AS c
ORDER BY sequence_id, r.start_time_ns, span_id
