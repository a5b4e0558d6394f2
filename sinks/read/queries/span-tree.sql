-- One rollout's spans in start order (sequence_id, across every process that wrote for it), with
-- each span's depth in the span tree (root = 0).
-- Params (required): run_id: String, attempt: UInt32, rollout_id: String.
-- Depth is computed in SQL: the rollout's span ids and parent ids are gathered into arrays and
-- arrayFold walks each span's parent chain (at most 64 steps, which also stops on a cycle); a
-- parent outside the rollout (or none) ends the chain.
-- Dedup: no FINAL. One row per span_id of the rollout (LIMIT 1 BY span_id).
WITH
    rollout AS
    (
        SELECT
            sequence_id, span_id, parent_span_id, name, kind, status, start_time_ns, end_time_ns, step, term, outcome
        FROM {db}.spans
        WHERE run_id = {run_id:String} AND attempt = {attempt:UInt32} AND rollout_id = {rollout_id:String}
        ORDER BY span_id, sequence_id
        LIMIT 1 BY span_id
    ),
    links AS
    (
        SELECT groupArray(span_id) AS ids, groupArray(ifNull(parent_span_id, '')) AS parents FROM rollout
    )
SELECT
    r.sequence_id AS sequence_id,
    arrayFold((acc, i) -> if(indexOf(ids, acc.2) = 0, acc, (toUInt32(acc.1 + 1), parents[indexOf(ids, acc.2)])),
              range(64), (toUInt32(0), ifNull(r.parent_span_id, ''))).1 AS depth,
    r.name AS name,
    r.span_id AS span_id,
    r.parent_span_id AS parent_span_id,
    r.kind AS kind,
    r.status AS status,
    r.step AS step,
    r.term AS term,
    r.outcome AS outcome,
    fromUnixTimestamp64Nano(r.start_time_ns, 'UTC') AS start_time,
    round((r.end_time_ns - r.start_time_ns) / 1e6, 3) AS duration_ms
FROM rollout AS r
CROSS JOIN links
ORDER BY sequence_id, r.start_time_ns, span_id
