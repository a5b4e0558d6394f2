-- The configuration each attempt of a run started with: one row per setting (the trainer's arguments
-- and any config={...} given to TrainingTelemetry, flattened to dotted names, values as text), from the
-- attempt's latest RUN_START that carried one. Seed 001's "training settings".
-- Params (required): run_id: String.
SELECT project, run_id, attempt, key, value
FROM (
    SELECT project, run_id, attempt, argMax(config, (time_ns, sequence_id)) AS settings
    FROM {db}.steps
    WHERE run_id = {run_id:String} AND type = 'RUN_START' AND length(config) > 0
    GROUP BY project, run_id, attempt
)
ARRAY JOIN mapKeys(settings) AS key, mapValues(settings) AS value
ORDER BY project, attempt, key
