-- Throughput redesign of the wire format.
-- Spans and steps carry the SDK instance (writer_id) and, on steps, its per-writer sequence_id.
-- On steps both join the sorting key (allowed for columns added in the same ALTER): two writers'
-- events of one run at the same nanosecond and type are two rows, while a replay of one writer's
-- event is still one.
ALTER TABLE {db}.spans ADD COLUMN IF NOT EXISTS writer_id String AFTER sequence_id;

ALTER TABLE {db}.steps
    ADD COLUMN IF NOT EXISTS writer_id String,
    ADD COLUMN IF NOT EXISTS sequence_id UInt64,
    MODIFY ORDER BY (project, run_id, attempt, time_ns, type, writer_id, sequence_id);

-- The streams now count a window of a run in one place (all writers and partitions together), so
-- grader_failures has one row per (project, run_id, attempt, term, cause, window_start) and the
-- latest emission wins. Rows written per source partition before are summed into that one row.
CREATE TABLE IF NOT EXISTS {db}.grader_failures_v4 (
    project LowCardinality(String),
    run_id String,
    attempt UInt32,
    term LowCardinality(String),
    cause LowCardinality(String),
    window_start_ns Int64,
    window_end_ns Int64,
    window_start DateTime64(3, 'UTC') DEFAULT fromUnixTimestamp64Nano(window_start_ns),
    window_end DateTime64(3, 'UTC') DEFAULT fromUnixTimestamp64Nano(window_end_ns),
    failures UInt64,
    graded UInt64,
    failure_rate Float64 DEFAULT if(graded = 0, 0, failures / graded),
    emitted_at_ns Int64
) ENGINE = ReplacingMergeTree(emitted_at_ns)
PARTITION BY toDate(window_start)
ORDER BY (project, run_id, attempt, term, cause, window_start_ns)
TTL toDateTime(window_start) + INTERVAL {ttl_aggregate_days} DAY
SETTINGS non_replicated_deduplication_window = 10000;

INSERT INTO {db}.grader_failures_v4 (project, run_id, attempt, term, cause, window_start_ns, window_end_ns, failures, graded, emitted_at_ns)
SELECT project, run_id, attempt, term, cause, window_start_ns, max(window_end_ns), sum(failures), sum(graded), max(emitted_at_ns)
FROM {db}.grader_failures FINAL
GROUP BY project, run_id, attempt, term, cause, window_start_ns;

DROP TABLE {db}.grader_failures;

RENAME TABLE {db}.grader_failures_v4 TO {db}.grader_failures;
