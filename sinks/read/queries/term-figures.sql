-- Seed 001's per-term figures of each step of one run: the term's share (mean, spread, zero
-- fraction; a failed score counts 0), its grader calls (duration percentiles, failures, their
-- reward cost) and the judge's tokens.
-- Params (required): run_id: String.
-- share_mean / share_std: akka.optimize.training.rl term share mean and spread per step;
-- duration_*: akka.optimize.training.rl.grader.duration (failed calls included), from the
-- streams' exponential histogram (within about 1 % of the value); judge_*_tokens: the sums of
-- akka.optimize.training.rl.grader.tokens; failure_cost: the failed scores counted 0 (failures, at
-- most the rollouts whose share is <= 0: a call retried to a score cost nothing) x the term's mean
-- share over the rollouts it did score (NULL when it scored none).
-- Dedup: no FINAL. Per (project, attempt, step, term) the latest emission wins (argMax over emitted_at_ns).
SELECT
    project,
    attempt,
    step,
    term,
    argMax(rollouts, emitted_at_ns) AS rollouts,
    round(argMax(share_mean, emitted_at_ns), 4) AS share_mean,
    round(argMax(share_std, emitted_at_ns), 4) AS share_std,
    round(argMax(share_zero_fraction, emitted_at_ns), 4) AS share_zero_fraction,
    argMax(graded, emitted_at_ns) AS graded,
    argMax(failures, emitted_at_ns) AS failures,
    round(argMax(failure_rate, emitted_at_ns), 4) AS failure_rate,
    -- through a tuple: argMax skips NULLs, and a later emission may have no cost where an earlier had one
    round(argMax(tuple(failure_cost), emitted_at_ns).1, 4) AS failure_cost,
    round(argMax(duration_p50_s, emitted_at_ns), 3) AS duration_p50_s,
    round(argMax(duration_p90_s, emitted_at_ns), 3) AS duration_p90_s,
    round(argMax(duration_p99_s, emitted_at_ns), 3) AS duration_p99_s,
    round(argMax(duration_max_s, emitted_at_ns), 3) AS duration_max_s,
    argMax(judge_input_tokens, emitted_at_ns) AS judge_input_tokens,
    argMax(judge_output_tokens, emitted_at_ns) AS judge_output_tokens
FROM {db}.step_term_stats
WHERE run_id = {run_id:String}
GROUP BY project, attempt, step, term
ORDER BY project, attempt, step, term
