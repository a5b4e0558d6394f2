-- GPU utilisation of one run: per GPU (hw_id), role and rank, the mean utilisation and power of its samples.
-- Params (required): run_id: String.
-- Samples join the run through placements on hw_id (never on the GPU index). Placement rows are
-- published periodically while a worker runs, so a run's placement of a GPU covers
-- [min(time), max(time) + 60 s] of that run's placement rows for that (attempt, hw_id, role,
-- rank); the end is cut just before the start of the next placement of the same GPU by another run,
-- attempt, role or rank, so a GPU that moved between runs counts for each only in its own time.
-- A placement with no samples in its time shows samples 0 and NULL means.
-- Dedup: no FINAL. Samples: one row per natural key (hw_id, time_ns) via LIMIT 1 BY; placement
-- duplicates do not change min/max time.
WITH
    run_gpus AS
    (
        SELECT DISTINCT hw_id
        FROM {db}.placements
        WHERE run_id = {run_id:String} AND hw_id IS NOT NULL AND hw_id != ''
    ),
    stints AS
    (
        SELECT
            project, run_id, attempt, assumeNotNull(hw_id) AS hw_id, role, rank,
            min(time_ns) AS from_ns,
            max(time_ns) + 60000000000 AS last_ns
        FROM {db}.placements
        WHERE hw_id IN (SELECT hw_id FROM run_gpus)
        GROUP BY project, run_id, attempt, hw_id, role, rank
    ),
    held AS
    (
        SELECT
            project, run_id, attempt, hw_id, role, rank, from_ns,
            leadInFrame(toNullable(from_ns)) OVER (PARTITION BY hw_id ORDER BY from_ns, run_id, attempt, role, rank
                                                   ROWS BETWEEN CURRENT ROW AND 1 FOLLOWING) AS next_from_ns,
            least(last_ns, ifNull(next_from_ns - 1, last_ns)) AS to_ns
        FROM stints
    ),
    mine AS
    (
        SELECT * FROM held WHERE run_id = {run_id:String}
    ),
    samples AS
    (
        SELECT hw_id, time_ns, gpu_utilization, power_w
        FROM {db}.gpu_samples
        WHERE hw_id IN (SELECT hw_id FROM run_gpus)
          AND time_ns >= (SELECT min(from_ns) FROM mine) AND time_ns <= (SELECT max(to_ns) FROM mine)
        LIMIT 1 BY hw_id, time_ns
    )
SELECT
    m.attempt AS attempt,
    m.hw_id AS hw_id,
    m.role AS role,
    m.rank AS rank,
    fromUnixTimestamp64Nano(m.from_ns, 'UTC') AS held_from,
    fromUnixTimestamp64Nano(m.to_ns, 'UTC') AS held_to,
    countIf(s.time_ns BETWEEN m.from_ns AND m.to_ns) AS samples,
    if(samples = 0, NULL, round(avgIf(s.gpu_utilization, s.time_ns BETWEEN m.from_ns AND m.to_ns), 3)) AS mean_gpu_utilization,
    if(samples = 0, NULL, round(avgIf(s.power_w, s.time_ns BETWEEN m.from_ns AND m.to_ns), 3)) AS mean_power_w
FROM mine AS m
LEFT JOIN samples AS s ON s.hw_id = m.hw_id
GROUP BY m.attempt, m.hw_id, m.role, m.rank, m.from_ns, m.to_ns
ORDER BY attempt, role, rank, hw_id, held_from
