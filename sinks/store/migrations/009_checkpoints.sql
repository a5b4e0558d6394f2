-- Checkpoint saves and restores: CHECKPOINT spans name the operation and the bytes moved;
-- their outcome (ok, failed) is the spans' outcome column.
ALTER TABLE {db}.spans
    ADD COLUMN IF NOT EXISTS checkpoint_op LowCardinality(Nullable(String)),
    ADD COLUMN IF NOT EXISTS checkpoint_bytes Nullable(Int64);
