-- A run's configuration (seed 001's "training settings"): what TrainingTelemetry(config={...}) and the
-- trainer integrations send once, on RUN_START, flattened to dotted names with values as text. Empty
-- on every other event. Read it with the saved query run-config.
ALTER TABLE {db}.steps
    ADD COLUMN IF NOT EXISTS config Map(String, String);
