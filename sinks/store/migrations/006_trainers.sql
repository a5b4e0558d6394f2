-- What trainers report.
-- Rollouts: the policy version that generated them and why generation stopped.
ALTER TABLE {db}.spans
    ADD COLUMN IF NOT EXISTS policy_version Nullable(Int64),
    ADD COLUMN IF NOT EXISTS finish_reason LowCardinality(Nullable(String));

-- Steps: the trainer's own scalars (STEP and METRICS events) and how a run ended (RUN_END).
ALTER TABLE {db}.steps
    ADD COLUMN IF NOT EXISTS metrics Map(String, Float64),
    ADD COLUMN IF NOT EXISTS status LowCardinality(Nullable(String));

-- Step figures: staleness (step - policy_version) over the rollouts that name their policy version.
ALTER TABLE {db}.step_stats
    ADD COLUMN IF NOT EXISTS staleness_max Nullable(Int64),
    ADD COLUMN IF NOT EXISTS staleness_mean Nullable(Float64);

-- The trainer's scalars in long form, one row per (run, attempt, step, name): read from the
-- steps rows, so a replayed message (one steps row after the merge) is one value, and a value
-- logged twice for a step (a METRICS event and its STEP) keeps the later one.
CREATE VIEW IF NOT EXISTS {db}.step_metrics AS
SELECT project, run_id, attempt, step, name, argMax(value, time_ns) AS value, max(time_ns) AS logged_ns
FROM {db}.steps FINAL
ARRAY JOIN mapKeys(metrics) AS name, mapValues(metrics) AS value
WHERE type IN ('STEP', 'METRICS') AND step >= 0
GROUP BY project, run_id, attempt, step, name;
