-- Rollouts attempted vs failed per step: a ROLLOUT span with status ERROR (the rollout raised or
-- returned a failed status) is counted here and kept out of every reward figure.
ALTER TABLE {db}.step_stats
    ADD COLUMN IF NOT EXISTS rollouts_attempted UInt64 DEFAULT 0 AFTER sample_reward_spread_mean,
    ADD COLUMN IF NOT EXISTS rollouts_failed UInt64 DEFAULT 0 AFTER rollouts_attempted;
