-- A process holding several GPUs publishes one placement per GPU at the same time_ns, role and
-- rank. The 001 key (project, run_id, attempt, role, rank, time_ns) made them one row, so the
-- ReplacingMergeTree (and already the insert, with optimize_on_insert) kept a single GPU. The GPU
-- joins the key: hw_id, and the index for GPUs whose UUID NVML could not read (hw_id null).
-- hw_id stays Nullable (null = unreadable, as the schema says); the key uses ifNull() so no
-- Nullable column is in it (that would need allow_nullable_key).
-- ClickHouse cannot insert a column into the middle of an existing sorting key, so the table is
-- rebuilt: a new one, every row copied (no FINAL: rows distinct under the old key are distinct
-- under this finer one), the two swapped by EXCHANGE (atomic: readers never see no table), the
-- old one dropped. A rerun after a failure at any statement starts again from the placements
-- table in place: a leftover placements_v5 is a partial copy, or the old table already copied.
DROP TABLE IF EXISTS {db}.placements_v5;

CREATE TABLE {db}.placements_v5 (
    project LowCardinality(String),
    run_id String,
    attempt UInt32,
    stage LowCardinality(String),
    time_ns Int64,
    time DateTime64(9, 'UTC') DEFAULT fromUnixTimestamp64Nano(time_ns),
    role LowCardinality(String),
    rank Int32,
    pod String,
    node LowCardinality(String),
    host LowCardinality(String),
    `index` Nullable(Int32),
    hw_id Nullable(String)
) ENGINE = ReplacingMergeTree
PARTITION BY toDate(time)
ORDER BY (project, run_id, attempt, role, rank, ifNull(hw_id, ''), ifNull(`index`, -1), time_ns)
TTL toDateTime(time) + INTERVAL {ttl_raw_days} DAY
SETTINGS non_replicated_deduplication_window = 10000;

INSERT INTO {db}.placements_v5 (project, run_id, attempt, stage, time_ns, time, role, rank, pod, node, host, `index`, hw_id)
SELECT project, run_id, attempt, stage, time_ns, time, role, rank, pod, node, host, `index`, hw_id
FROM {db}.placements;

EXCHANGE TABLES {db}.placements_v5 AND {db}.placements;

DROP TABLE {db}.placements_v5;
