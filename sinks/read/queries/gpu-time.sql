-- GPU time per run: per project, run and attempt, the GPUs it held, their GPU-seconds and the
-- energy they drew. Params: none.
-- A GPU counts for a run from the run's first placement on it until the run's last sample of that
-- GPU (or its last placement there, whichever is later), and never past the GPU's next placement
-- by another run or attempt: a GPU that moves A -> B -> A counts each stretch for the run placed on
-- it then. Samples count by their own project, run_id and attempt (a poller without a placement
-- publishes samples of no run: they count for none). Roles and ranks of one run on one GPU count
-- the GPU once; placements without hw_id (NVML could not read the GPU) count no GPU time.
-- gpus: distinct GPUs; gpu_seconds (gpu_hours): the sum of every stretch's length; held_from /
-- held_to: the first start and the last end. energy_kwh: the energy counter's (energy_mj) increase
-- between consecutive samples of the run in each stretch, summed: exact from the first sample to
-- the last, no sampling error (a decrease, a counter reset on driver reload, adds nothing); NULL
-- when none of the run's GPUs reports energy; energy_gpus: how many of them do.
-- Dedup: no FINAL. Placements: DISTINCT; samples: one row per (hw_id, time_ns) via LIMIT 1 BY.
WITH
    marks AS
    (
        SELECT DISTINCT project, run_id, attempt, assumeNotNull(hw_id) AS hw_id, time_ns,
               concat(project, '\0', run_id, '\0', toString(attempt)) AS holder
        FROM {db}.placements
        WHERE hw_id IS NOT NULL AND hw_id != ''
    ),
    changes AS
    (
        SELECT *,
               holder != lagInFrame(holder, 1, '') OVER (PARTITION BY hw_id ORDER BY time_ns, holder
                                                          ROWS BETWEEN 1 PRECEDING AND CURRENT ROW) AS starts
        FROM marks
    ),
    numbered AS
    (
        SELECT *,
               sum(starts) OVER (PARTITION BY hw_id ORDER BY time_ns, holder
                                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS stretch
        FROM changes
    ),
    stretches AS
    (
        SELECT hw_id, stretch, any(project) AS project, any(run_id) AS run_id, any(attempt) AS attempt,
               min(time_ns) AS from_ns, max(time_ns) AS last_mark_ns
        FROM numbered
        GROUP BY hw_id, stretch
    ),
    bounded AS
    (
        SELECT *,
               leadInFrame(toNullable(from_ns)) OVER (PARTITION BY hw_id ORDER BY from_ns
                                                      ROWS BETWEEN CURRENT ROW AND 1 FOLLOWING) AS next_from_ns
        FROM stretches
    ),
    samples AS
    (
        SELECT hw_id, time_ns, project, run_id, attempt, energy_mj
        FROM {db}.gpu_samples
        WHERE hw_id IN (SELECT hw_id FROM marks) AND run_id != ''
        LIMIT 1 BY hw_id, time_ns
    ),
    in_stretch AS
    (
        SELECT b.hw_id AS hw_id, b.stretch AS stretch, s.time_ns AS time_ns, s.energy_mj AS energy_mj,
               toInt64(s.energy_mj) - lagInFrame(toNullable(toInt64(s.energy_mj))) OVER (
                   PARTITION BY b.hw_id, b.stretch ORDER BY s.time_ns
                   ROWS BETWEEN 1 PRECEDING AND CURRENT ROW) AS energy_step_mj
        FROM bounded AS b
        INNER JOIN samples AS s ON s.hw_id = b.hw_id AND s.project = b.project AND s.run_id = b.run_id
                                   AND s.attempt = b.attempt
        WHERE s.time_ns >= b.from_ns AND (b.next_from_ns IS NULL OR s.time_ns < b.next_from_ns)
    ),
    per_stretch AS
    (
        SELECT hw_id, stretch, max(time_ns) AS last_sample_ns, countIf(energy_mj IS NOT NULL) AS energy_samples,
               sumIf(greatest(energy_step_mj, 0), energy_step_mj IS NOT NULL) AS used_mj
        FROM in_stretch
        GROUP BY hw_id, stretch
    ),
    held AS
    (
        SELECT b.project AS project, b.run_id AS run_id, b.attempt AS attempt, b.hw_id AS hw_id, b.from_ns AS from_ns,
               greatest(b.last_mark_ns, p.last_sample_ns) AS to_ns,  -- no sample: 0 here, the mark wins
               p.energy_samples AS energy_samples, p.used_mj AS used_mj
        FROM bounded AS b
        LEFT JOIN per_stretch AS p ON p.hw_id = b.hw_id AND p.stretch = b.stretch
    )
SELECT
    project,
    run_id,
    attempt,
    uniqExact(hw_id) AS gpus,
    round(sum(to_ns - from_ns) / 1e9, 3) AS gpu_seconds,
    round(gpu_seconds / 3600, 4) AS gpu_hours,
    fromUnixTimestamp64Nano(min(from_ns), 'UTC') AS held_from,
    fromUnixTimestamp64Nano(max(to_ns), 'UTC') AS held_to,
    uniqExactIf(hw_id, energy_samples > 0) AS energy_gpus,
    if(energy_gpus = 0, NULL, round(sum(used_mj) / 3.6e9, 9)) AS energy_kwh
FROM held
GROUP BY project, run_id, attempt
ORDER BY project, run_id, attempt
