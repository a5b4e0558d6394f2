-- Grader failures per run, term and cause over windows starting in [since, until), with the failure rate.
-- Params (required): since, until: DateTime64(3, 'UTC'), e.g. --param since='2025-01-01 00:00:00'
--   --param until='2025-01-02 00:00:00' (any text ClickHouse parses as a DateTime64 in UTC).
-- Sums failures and graded over windows; failure_rate = failures / graded
-- (0 when nothing was graded), rounded to 4 digits.
-- Dedup: no FINAL. Per natural key (project, run_id, attempt, term, cause, window_start_ns)
-- the latest emission wins: argMax(..., emitted_at_ns) in the inner query.
SELECT
    project,
    run_id,
    attempt,
    term,
    cause,
    count() AS windows,
    sum(failures) AS failures,
    sum(graded) AS graded,
    round(if(graded = 0, 0, failures / graded), 4) AS failure_rate
FROM
(
    SELECT
        project, run_id, attempt, term, cause, window_start_ns,
        argMax(failures, emitted_at_ns) AS failures,
        argMax(graded, emitted_at_ns) AS graded
    FROM {db}.grader_failures
    WHERE window_start >= {since:DateTime64(3, 'UTC')} AND window_start < {until:DateTime64(3, 'UTC')}
    GROUP BY project, run_id, attempt, term, cause, window_start_ns
)
GROUP BY project, run_id, attempt, term, cause
ORDER BY project, run_id, attempt, term, cause
