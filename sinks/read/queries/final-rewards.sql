-- The final reward of each rollout of a run (seed 003's find_final_reward), where it came from, and how many
-- intermediate rewards (emit_reward) it had; rollouts without a reward have a NULL one.
-- Params (required): run_id: String, attempt: UInt32.
-- The final reward, as `rlpulse export` reads it: the ROLLOUT span's reward, else the latest REWARD entry's,
-- else the latest final reward annotation's (emit_reward(final=True)).
-- Dedup: no FINAL. One row per span_id (LIMIT 1 BY span_id).
WITH spans AS
(
    SELECT rollout_id, span_id, kind, sequence_id, step, reward,
           attributes['rlpulse.reward.final'] IN ('true', '1') AS marked_final
    FROM {db}.spans
    WHERE run_id = {run_id:String} AND attempt = {attempt:UInt32} AND rollout_id != ''
      AND kind IN ('ROLLOUT', 'REWARD', 'ANNOTATION')
    ORDER BY span_id, sequence_id
    LIMIT 1 BY span_id
)
SELECT
    rollout_id,
    anyIf(step, kind = 'ROLLOUT') AS step,
    anyIf(reward, kind = 'ROLLOUT') AS rollout_reward,
    argMaxIf(reward, sequence_id, kind = 'REWARD' AND reward IS NOT NULL) AS entry_reward,
    argMaxIf(reward, sequence_id, kind = 'ANNOTATION' AND reward IS NOT NULL AND marked_final) AS final_annotation,
    coalesce(rollout_reward, entry_reward, final_annotation) AS final_reward,
    multiIf(rollout_reward IS NOT NULL, 'rollout', entry_reward IS NOT NULL, 'reward_entry',
            final_annotation IS NOT NULL, 'annotation', '') AS source,
    countIf(kind = 'ANNOTATION' AND reward IS NOT NULL AND NOT marked_final) AS intermediate_rewards
FROM spans
GROUP BY rollout_id
HAVING countIf(kind = 'ROLLOUT') > 0
ORDER BY step, rollout_id
