"""Seed 001's per-term figures of a step, against truth computed here independently.

A failed score counts 0 in its term's histogram and share figures (the SDK puts the failed term
in ``term_shares`` as 0.0; the GRADER span keeps its score NULL); the step's grader calls give
per-term duration percentiles, failures, what the failures cost, and the judge's tokens; the
sample groups give the zero-std fraction (TRL's ``frac_reward_zero_std``).
"""

from __future__ import annotations

import statistics

import pytest

from rlpulse.streams.runs import RunConfig
from rlpulse.streams.stage import load_state
from rlpulse.streams.state import Run
from rlpulse.streams.testing import NS, Harness

pytestmark = pytest.mark.full

T0 = 1_700_000_000 * NS
CONFIG = RunConfig(window_s=10, lateness_s=2, idle_s=5, retention_s=30, stall_after_s=900, silent_after_s=300)
IDENT = {"project": "p", "run_id": "r1", "attempt": 1, "stage": "", "writer_id": "w1"}

# (rollout, sample, judge share or None when the judge failed, format share)
ROLLOUTS = [("a", "s0", 0.5, 0.1), ("b", "s0", None, 0.6), ("c", "s1", 0.3, 0.1), ("d", "s1", None, 0.1)]
# judge calls: (rollout, outcome, duration s, input tokens, output tokens)
CALLS = [("a", "ok", 1.0, 100, 7), ("b", "timeout", 30.0, 120, None), ("c", "ok", 2.0, 90, 5),
         ("d", "unavailable", 3.0, None, None)]


def records() -> list[dict]:
    seq = iter(range(1, 100))
    out = []
    for i, (rid, outcome, duration, tin, tout) in enumerate(CALLS):
        t = T0 + (i + 1) * NS
        out.append({**IDENT, "time_ns": t, "kind": "GRADER", "term": "judge", "outcome": outcome, "step": 0,
                    "rollout_id": rid, "start_time_ns": t - int(duration * NS), "end_time_ns": t,
                    "judge_input_tokens": tin, "judge_output_tokens": tout, "sequence_id": next(seq)})
    for i, (rid, sample, judge, fmt) in enumerate(ROLLOUTS):
        shares = {"judge": judge if judge is not None else 0.0, "format": fmt}
        out.append({**IDENT, "time_ns": T0 + (10 + i) * NS, "kind": "ROLLOUT", "step": 0, "rollout_id": rid,
                    "reward": sum(shares.values()), "term_shares": shares, "completion_tokens": 10,
                    "sample_id": sample, "sequence_id": next(seq)})
    return out


def test_failed_terms_count_zero_and_the_step_gives_each_terms_figures() -> None:
    h = Harness(CONFIG)
    h.feed("spans", records())
    h.feed("steps", [{**IDENT, "time_ns": T0 + 20 * NS, "type": "STEP", "trainer": "rl", "step": 0, "step_count": 1,
                      "sequence_id": 1}])
    h.advance(10)
    judge_shares = [j if j is not None else 0.0 for _, _, j, _ in ROLLOUTS]
    hist = h.latest("reward-histograms")[("p", "r1", 1, 0, "judge")]
    assert (hist["count"], hist["bucket_counts"][0]) == (4, 2)  # seed 001: (4, 2), not (2, 0)
    terms = h.latest("step-terms")
    assert set(terms) == {("p", "r1", 1, 0, "judge"), ("p", "r1", 1, 0, "format")}
    judge = terms[("p", "r1", 1, 0, "judge")]
    assert judge["rollouts"] == 4
    assert judge["share_mean"] == pytest.approx(statistics.fmean(judge_shares))
    assert judge["share_std"] == pytest.approx(statistics.pstdev(judge_shares))
    assert judge["share_zero_fraction"] == 0.5
    assert (judge["graded"], judge["failures"], judge["failure_rate"]) == (4, 2, 0.5)
    # two failed scores at the mean share of the two the judge did score: 2 x (0.5 + 0.3) / 2
    assert judge["failure_cost"] == pytest.approx(0.8)
    durations = sorted(d for _, _, d, _, _ in CALLS)  # nearest rank: p50 is the 2nd of 4, p90 and p99 the 4th
    # an exponential histogram's estimate: the bucket's midpoint, within a factor sqrt(base) of the value
    assert judge["duration_p50_s"] == pytest.approx(durations[1], rel=0.02)
    assert (judge["duration_p90_s"], judge["duration_p99_s"], judge["duration_max_s"]) == (30.0, 30.0, 30.0)
    assert (judge["judge_input_tokens"], judge["judge_output_tokens"]) == (310, 12)
    fmt = terms[("p", "r1", 1, 0, "format")]
    assert (fmt["rollouts"], fmt["graded"], fmt["failures"], fmt["failure_cost"]) == (4, 0, 0, 0.0)
    assert fmt["share_std"] == pytest.approx(statistics.pstdev([f for *_, f in ROLLOUTS]))
    [stats] = h.emissions("step-stats")
    # s0: rewards 0.6 and 0.6 (all the same); s1: 0.4 and 0.1
    assert (stats["samples"], stats["samples_same_reward"], stats["zero_std_fraction"]) == (2, 1, 0.5)


def test_a_term_the_judge_never_scored_has_no_cost_figure() -> None:
    h = Harness(CONFIG)
    t = T0 + NS
    h.feed("spans", [
        {**IDENT, "time_ns": t, "kind": "GRADER", "term": "judge", "outcome": "timeout", "step": 0, "rollout_id": "a",
         "start_time_ns": t - NS, "end_time_ns": t, "sequence_id": 1},
        {**IDENT, "time_ns": t + NS, "kind": "ROLLOUT", "step": 0, "rollout_id": "a", "reward": 0.0,
         "term_shares": {"judge": 0.0}, "sequence_id": 2}])
    h.feed("steps", [{**IDENT, "time_ns": t + 2 * NS, "type": "RUN_END", "trainer": "rl", "step": 0, "step_count": 1,
                      "sequence_id": 1, "spans_sent": 2}])
    h.advance(10)
    judge = h.latest("step-terms")[("p", "r1", 1, 0, "judge")]
    assert (judge["rollouts"], judge["failures"], judge["failure_cost"]) == (1, 1, None)
    [stats] = h.emissions("step-stats")
    assert stats["zero_std_fraction"] is None  # no sample groups: no fraction, not 0


def grader(t_s: float, outcome: str, seq: int, step: int = 0) -> dict:
    t = T0 + int(t_s * NS)
    return {**IDENT, "time_ns": t, "kind": "GRADER", "term": "judge", "outcome": outcome, "step": step,
            "rollout_id": f"x{seq}", "start_time_ns": t - NS, "end_time_ns": t, "sequence_id": seq}


def test_grader_calls_held_until_their_step_completes_are_judged_in_the_newest_window() -> None:
    """The SDK's grader_calls="step" sends a step's calls when the step completes, after their window
    closed: the late update of the newest window still fires the failure-rate rule; one of an older
    window, overtaken by a newer window's verdict, does not."""
    from rlpulse.base.settings import AlertThresholds
    config = RunConfig(window_s=10, lateness_s=2, idle_s=50, retention_s=300, stall_after_s=900, silent_after_s=300,
                       thresholds=AlertThresholds(grader_failure_rate=0.5, grader_min_graded=1))
    h = Harness(config)
    h.feed("spans", [grader(1, "ok", 1), grader(2, "ok", 2)])  # window [0, 10): 2 ok calls
    h.feed("spans", [grader(13, "ok", 3, step=1)])  # progress 13 >= 10 + 2: the first window closes, rate 0
    assert h.alerts() == []
    h.feed("spans", [grader(3, "timeout", 4), grader(4, "timeout", 5), grader(5, "timeout", 6)])  # held, late
    assert h.alerts() == [("grader_failure_rate", "p/r1/1/judge", "FIRING")]  # 3 of 5 failed, judged again
    h.feed("spans", [grader(25, "ok", 7, step=2)])  # the window [10, 20) closes: 1 ok of 1, resolves
    assert h.alerts()[-1] == ("grader_failure_rate", "p/r1/1/judge", "RESOLVED")
    h.feed("spans", [grader(6, "timeout", 8), grader(7, "timeout", 9)])  # late for the older window: not judged
    assert [a[2] for a in h.alerts()] == ["FIRING", "RESOLVED"]
    first = [w for w in h.emissions("grader-windows") if w["window_start_ns"] == T0][-1]
    assert (first["graded"], first["failures"]) == (7, 5)  # its figures still count every call


def test_hostile_grader_spans_neither_crash_nor_move_the_run() -> None:
    """Token counts no judge reports stay out of the sums (an Avro long must hold them), a term with "|"
    in its name is a term like any other, and a grader span naming a far step closes no open step."""
    h = Harness(CONFIG)
    t = T0 + NS
    h.feed("spans", [
        {**grader(1, "ok", 1), "judge_input_tokens": 2**62, "judge_output_tokens": 7},
        {**grader(1.5, "ok", 2), "judge_input_tokens": 2**62, "judge_output_tokens": -5},
        {**grader(2, "ok", 3), "term": "fmt|strict", "judge_input_tokens": 11},
        {**grader(2.5, "ok", 4, step=9)},  # says nothing of where the run is
        {**IDENT, "time_ns": t + 2 * NS, "kind": "ROLLOUT", "step": 0, "rollout_id": "a", "reward": 0.5,
         "term_shares": {"judge": 0.5}, "sequence_id": 5}])
    [run] = h.table.values()
    assert Run.from_dict(load_state(run)).steps["1|0"].end_ns is None  # step 0 is still open: step 9's grader did not end it
    h.feed("steps", [{**IDENT, "time_ns": t + 9 * NS, "type": "RUN_END", "trainer": "rl", "step": 0, "step_count": 1,
                      "sequence_id": 1, "spans_sent": 5}])
    h.advance(10)
    terms = h.latest("step-terms")
    judge = terms[("p", "r1", 1, 0, "judge")]
    assert (judge["graded"], judge["judge_input_tokens"], judge["judge_output_tokens"]) == (2, 0, 7)
    assert terms[("p", "r1", 1, 0, "fmt|strict")]["judge_input_tokens"] == 11
    assert {w["term"] for w in h.emissions("grader-windows")} == {"judge", "fmt|strict"}


def test_a_failed_call_retried_to_a_score_costs_nothing() -> None:
    h = Harness(CONFIG)
    spans = [grader(1, "timeout", 1), grader(2, "ok", 2), grader(3, "ok", 3)]  # rollout a: a timeout, then a score
    spans += [{**IDENT, "time_ns": T0 + (5 + i) * NS, "kind": "ROLLOUT", "step": 0, "rollout_id": rid, "reward": 1.0,
               "term_shares": {"judge": 1.0}, "sequence_id": 4 + i} for i, rid in enumerate(("a", "b"))]
    h.feed("spans", spans)
    h.feed("steps", [{**IDENT, "time_ns": T0 + 9 * NS, "type": "RUN_END", "trainer": "rl", "step": 0, "step_count": 1,
                      "sequence_id": 1, "spans_sent": 5}])
    h.advance(10)
    judge = h.latest("step-terms")[("p", "r1", 1, 0, "judge")]
    assert (judge["graded"], judge["failures"], judge["failure_cost"]) == (3, 1, 0.0)


def test_reports_after_run_end_track_nothing_and_raise_no_alert() -> None:
    """Another rank's heartbeat racing its job's close arrives after RUN_END: the ended attempt is not
    tracked again (its silence would fire silent_run, and run-end would resolve it, over and over)."""
    config = RunConfig(window_s=10, lateness_s=2, idle_s=5, retention_s=30, stall_after_s=900, silent_after_s=3)
    h = Harness(config)
    h.feed("steps", [{**IDENT, "time_ns": T0, "type": "RUN_START", "trainer": "rl", "step": -1, "step_count": 0,
                      "sequence_id": 1},
                     {**IDENT, "time_ns": T0 + NS, "type": "RUN_END", "trainer": "rl", "step": 0, "step_count": 1,
                      "sequence_id": 2},
                     {**IDENT, "writer_id": "rank1", "time_ns": T0 + 2 * NS, "type": "HEARTBEAT", "trainer": "rl",
                      "step": 0, "step_count": 1, "sequence_id": 1}])
    h.advance(60)
    assert h.alerts() == []
    assert not h.table  # nothing of the run is tracked any more: its state expired
