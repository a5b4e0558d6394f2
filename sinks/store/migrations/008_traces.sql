-- Traced LLM and tool calls (rlpulse.producers.tracing).
-- A ROLLOUT or REWARD entry span's own metrics (seed 000's rollout_metrics / reward_metrics): flat
-- names to floats, at most 10 names per kind and run (the SDK refuses more). A typed column rather
-- than attributes (Map(String, String)), so `metrics['accuracy']` is a number in SQL.
ALTER TABLE {db}.spans
    ADD COLUMN IF NOT EXISTS metrics Map(String, Float64);
