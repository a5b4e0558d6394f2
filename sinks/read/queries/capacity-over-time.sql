-- Pool occupancy over time: per minute and pool, the devices declared, observed, granted and queued,
-- and the queued claims. Params (required): since, until: DateTime64(3, 'UTC').
-- Per minute the largest figure any instance reported in it: max across instances (and across an
-- instance's reports within the minute), never the sum, which would count the same devices once per
-- instance. Dedup: max is unchanged by a replayed row, so no FINAL.
SELECT
    toStartOfMinute(time) AS minute,
    pool,
    max(devices_declared) AS declared,
    max(devices_observed) AS observed,
    max(devices_granted) AS granted,
    max(devices_queued) AS queued,
    max(claims_queued) AS claims_queued
FROM {db}.capacity
WHERE project = '' AND time >= {since:DateTime64(3, 'UTC')} AND time < {until:DateTime64(3, 'UTC')}
GROUP BY minute, pool
ORDER BY minute, pool
