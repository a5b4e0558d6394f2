-- Capacity of each pool now, as `rlpulse capacity` prints it: devices declared and observed, devices
-- claims hold (granted) or wait for (queued), and those claims. Params: none.
-- Every instance of the trainer service reports the same figures under its own instance: each
-- instance's latest report, then the max across instances, never the sum (which would count the
-- same devices once per instance). Instances whose latest report is more than 5 minutes older than
-- the pool's newest are left out, as Prometheus leaves a stale series out: an instance that went
-- away no longer holds the figures up. observed is NULL until an instance has read the cluster.
-- A pool whose last claim ended reads 0 (the service keeps reporting it) and stays listed.
-- Dedup: no FINAL. A replayed report is the same row (pool, project, instance, time_ns): argMax
-- takes one of two equal rows.
WITH
    latest AS
    (
        SELECT
            pool,
            instance,
            argMax((serving, accelerator, devices_declared, devices_observed, devices_granted, devices_queued,
                    claims_granted, claims_queued), time_ns) AS last,
            max(time_ns) AS reported_ns
        FROM {db}.capacity
        WHERE project = ''
        GROUP BY pool, instance
    ),
    fresh AS
    (
        SELECT *, max(reported_ns) OVER (PARTITION BY pool) AS pool_reported_ns
        FROM latest
    )
SELECT
    pool,
    max(last.1) AS serving,
    any(last.2) AS accelerator,
    max(last.3) AS declared,
    max(last.4) AS observed,
    max(last.5) AS granted,
    max(last.6) AS queued,
    max(last.7) AS claims_granted,
    max(last.8) AS claims_queued,
    count() AS instances,
    fromUnixTimestamp64Nano(max(reported_ns), 'UTC') AS reported
FROM fresh
WHERE reported_ns >= pool_reported_ns - 300000000000
GROUP BY pool
ORDER BY pool
