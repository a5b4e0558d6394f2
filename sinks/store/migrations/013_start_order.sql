-- sequence_id is now the span's start order per rollout (taken when it starts, across processes);
-- each writer's publish order, which the streams skip replays by, moves to writer_sequence.
-- Rows written before keep their publish order in sequence_id and 0 here.
ALTER TABLE {db}.spans ADD COLUMN IF NOT EXISTS writer_sequence UInt64 DEFAULT 0 AFTER writer_id;
