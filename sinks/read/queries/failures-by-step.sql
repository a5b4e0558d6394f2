-- Grader failures of one run per step, term and cause, with the failure rate of each term.
-- Params (required): run_id: String.
-- From the GRADER spans (deduplicated with FINAL): graded counts every score of the term in the
-- step, failures those whose outcome is a cause (timeout, unavailable, unreadable, ungradable,
-- error); a cause with no failure in a step has no row. failure_rate = failures / graded, rounded.
SELECT
    project,
    run_id,
    attempt,
    step,
    term,
    outcome AS cause,
    failures,
    graded,
    round(failures / graded, 4) AS failure_rate
FROM
(
    SELECT project, run_id, attempt, step, term, outcome, count() AS failures,
           any(graded) AS graded
    FROM
    (
        SELECT project, run_id, attempt, step, term, outcome,
               count() OVER (PARTITION BY project, run_id, attempt, step, term) AS graded
        FROM {db}.spans FINAL
        WHERE run_id = {run_id:String} AND kind = 'GRADER'
    )
    WHERE outcome != 'ok'
    GROUP BY project, run_id, attempt, step, term, outcome
)
ORDER BY project, attempt, step, term, cause
