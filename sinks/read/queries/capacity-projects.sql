-- Each training project's claims on each pool now: devices its claims hold (granted) or wait for
-- (queued), and its quota. Params: none.
-- As the capacity query: each service instance's latest report, the max across instances (never
-- the sum), instances more than 5 minutes staler than the newest left out. A project whose last
-- claim ended reads 0 and stays listed. quota is NULL where the service states none.
WITH
    latest AS
    (
        SELECT
            project,
            pool,
            instance,
            argMax((devices_granted, devices_queued, quota), time_ns) AS last,
            max(time_ns) AS reported_ns
        FROM {db}.capacity
        WHERE project != ''
        GROUP BY project, pool, instance
    ),
    fresh AS
    (
        SELECT *, max(reported_ns) OVER (PARTITION BY project, pool) AS newest_ns
        FROM latest
    )
SELECT
    project,
    pool,
    max(last.1) AS granted,
    max(last.2) AS queued,
    max(last.3) AS quota,
    count() AS instances,
    fromUnixTimestamp64Nano(max(reported_ns), 'UTC') AS reported
FROM fresh
WHERE reported_ns >= newest_ns - 300000000000
GROUP BY project, pool
ORDER BY project, pool
