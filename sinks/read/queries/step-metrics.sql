-- The trainer's own scalars of one run, step by step (loss, kl, grad_norm, clip_ratio/*, ...).
-- Params (required): run_id: String.
-- From step_metrics: one value per (attempt, step, name), the latest logged.
-- Not the seed's clipped ratio (truncation at the length limit, in step_stats): names such as
-- clip_ratio/* or actor/pg_clipfrac are PPO's ratio clipping, as the trainer logged it.
SELECT
    project,
    run_id,
    attempt,
    step,
    name,
    value
FROM {db}.step_metrics
WHERE run_id = {run_id:String}
ORDER BY project, attempt, step, name
