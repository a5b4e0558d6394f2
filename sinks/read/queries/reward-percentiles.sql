-- p10/p50/p90 of the total reward per step of one run, estimated from the reward histogram buckets.
-- Params (required): run_id: String, attempt: UInt32.
-- Estimate: bucket i (1-based, n = length(bounds) + 1 buckets) holds bounds[i-1] < x <= bounds[i];
-- bucket 1 holds x <= bounds[1], bucket n holds x > bounds[n-1]. For quantile q the rank is
-- r = q * count; the bucket k holding it is the first whose cumulative count reaches r, and the
-- value is interpolated linearly inside it: lo + (hi - lo) * (r - cum[k-1]) / counts[k].
-- The edges are clamped to the histogram's exact min and max: lo = greatest(bounds[k-1], min),
-- hi = least(bounds[k], max), with no bound below bucket 1 or above bucket n. So the open-ended
-- buckets use min / max as their outer edge, the first non-empty bucket starts at min and the
-- last non-empty one ends at max; a bucket "<= 0" holding only zeros (min = 0) is the point 0.
-- The estimate lies in the bucket that holds the rank: within one bucket's width of the truth.
-- Dedup: no FINAL. Per (project, step) of term 'total' the latest emission wins (argMax over
-- emitted_at_ns).
SELECT
    step,
    n AS count,
    round(min_v, 4) AS min,
    round(ps[1], 4) AS p10,
    round(ps[2], 4) AS p50,
    round(ps[3], 4) AS p90,
    round(max_v, 4) AS max
FROM
(
    SELECT
        step, n, min_v, max_v,
        [0.1, 0.5, 0.9] AS qs,
        arrayMap(q -> arrayFirstIndex(c -> c >= q * n, cum), qs) AS ks,
        arrayMap((q, k) -> if(n = 0, NULL, toNullable(
            if(k = 1, min_v, greatest(b[k - 1], min_v))
            + (if(k = length(counts), max_v, least(b[k], max_v)) - if(k = 1, min_v, greatest(b[k - 1], min_v)))
              * (q * n - (cum[k] - counts[k])) / counts[k])),
            qs, ks) AS ps
    FROM
    (
        SELECT
            step,
            argMax(bounds, emitted_at_ns) AS b,
            argMax(bucket_counts, emitted_at_ns) AS counts,
            arrayCumSum(counts) AS cum,
            argMax(count, emitted_at_ns) AS n,
            argMax(min, emitted_at_ns) AS min_v,
            argMax(max, emitted_at_ns) AS max_v
        FROM {db}.reward_histograms
        WHERE run_id = {run_id:String} AND attempt = {attempt:UInt32} AND term = 'total'
        GROUP BY project, step
    )
)
ORDER BY step
