-- Seed 000's custom metrics of one run, step by step: per entry span kind (ROLLOUT: rollout_metrics,
-- REWARD: reward_metrics) and metric name, the entries that carry the name and the metric's mean,
-- spread (std), minimum and maximum over them.
-- Params (required): run_id: String.
-- From the `metrics` map of ROLLOUT and REWARD entry spans; rollouts: the step's entries of that kind
-- with the name (an entry without it counts in none of its figures); std: the population standard
-- deviation (stddevPop), as the streams compute reward_std; spans without a step are left out.
-- Dedup: a span may be stored more than once (a replayed batch) until merges: FINAL, with the kind
-- filter as PREWHERE (the copies of a span are one event of one kind, so FINAL keeps one of each).
SELECT
    project,
    attempt,
    step,
    kind,
    name,
    count() AS rollouts,
    avg(value) AS mean,
    stddevPop(value) AS std,
    min(value) AS min,
    max(value) AS max
FROM {db}.spans FINAL
ARRAY JOIN mapKeys(metrics) AS name, mapValues(metrics) AS value
PREWHERE kind IN ('ROLLOUT', 'REWARD')
WHERE run_id = {run_id:String} AND step IS NOT NULL
GROUP BY project, attempt, step, kind, name
ORDER BY project, attempt, step, kind, name
