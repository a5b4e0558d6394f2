"""Seed 001's per-term figures and the zero-std fraction, end to end: the SDK, the real broker,
``rlpulse streams``, ``rlpulse sink``, chDB, then ``rlpulse query --saved term-figures``.

Four rollouts of one step; the judge times out on two of them, so those two carry the judge
term at 0.0 (seed 001: a failed score counts as zero for its term) and the GRADER spans keep their
score NULL. The truth is computed here from the inputs.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys

import pytest

from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.producers import TrainingTelemetry
from rlpulse.schemas.topics import ensure_topics
from rlpulse.base.settings import Settings
from tests.integration import until

pytestmark = [pytest.mark.integration, pytest.mark.full]

# (rollout, sample, judge share or None when its grader timed out, format share)
ROLLOUTS = [("a", "s0", 0.5, 0.1), ("b", "s0", None, 0.6), ("c", "s1", 0.3, 0.1), ("d", "s1", None, 0.1)]
# the judge's calls: (rollout, outcome, duration s, input tokens, output tokens)
CALLS = [("a", "ok", 1.0, 100, 7), ("b", "timeout", 30.0, 120, None), ("c", "ok", 2.0, 90, 5),
         ("d", "timeout", 3.0, None, None)]


def run_job(settings: Settings) -> None:
    with TrainingTelemetry(project="tf", run_id="terms", attempt=1, settings=settings) as tel:
        for rid, outcome, duration, tin, tout in CALLS:
            tel.grader(step=0, rollout_id=rid, term="judge", outcome=outcome, duration_s=duration,
                       score=None if outcome != "ok" else 1.0, input_tokens=tin, output_tokens=tout)
        for rid, sample, judge, fmt in ROLLOUTS:
            shares = {"judge": 0.0 if judge is None else judge, "format": fmt}
            tel.rollout(step=0, rollout_id=rid, reward=sum(shares.values()), term_shares=shares,
                        completion_tokens=10, max_tokens=100, sample_id=sample)
        tel.step_completed(step=0, tokens=40, duration_s=1.0)
        assert tel.flush(30) == 0


def saved(settings: Settings, name: str, run_id: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "rlpulse.cli", "query", "--saved", name, "--param", f"run_id={run_id}",
                          "--format", "json"], env=settings_env(settings), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_term_figures_and_zero_std_fraction_through_the_pipeline(settings: Settings) -> None:
    settings = dataclasses.replace(settings, stall_after=60.0, silent_after=60.0)
    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        run_job(settings)
        pipeline.wait_caught_up(until=until.counts(settings, {"step_term_stats": 2, "step_stats": 1}))
        rows = {r["term"]: r for r in saved(settings, "term-figures", "terms")}
        hist = until.query(settings, "SELECT count, bucket_counts[1] FROM $db.reward_histograms FINAL "
                                     "WHERE run_id = 'terms' AND term = 'judge'")
        stats = until.query(settings, "SELECT samples, samples_same_reward, zero_std_fraction FROM $db.step_stats FINAL "
                                      "WHERE run_id = 'terms'")
        scores = until.query(settings, "SELECT countIf(score IS NULL) FROM $db.spans FINAL "
                                       "WHERE run_id = 'terms' AND kind = 'GRADER' AND outcome != 'ok'")
        pipeline.stop()
    assert hist == [(4, 2)]  # the seed's (4, 2): both failed scores in the <= 0 bucket
    assert scores == [(2,)]  # the stored scores stay NULL
    assert stats == [(2, 1, 0.5)]  # s0 scored 0.6 twice; s1 0.4 and 0.1
    judge_shares = [0.0 if j is None else j for _, _, j, _ in ROLLOUTS]
    judge = rows["judge"]
    assert (judge["rollouts"], judge["graded"], judge["failures"], judge["failure_rate"]) == (4, 4, 2, 0.5)
    assert judge["share_mean"] == round(statistics.fmean(judge_shares), 4)
    assert judge["share_std"] == round(statistics.pstdev(judge_shares), 4)
    assert judge["share_zero_fraction"] == 0.5
    assert judge["failure_cost"] == 0.8  # 2 failures x the mean of the two scored shares, (0.5 + 0.3) / 2
    assert (judge["duration_p90_s"], judge["duration_p99_s"], judge["duration_max_s"]) == (30.0, 30.0, 30.0)
    assert judge["duration_p50_s"] == pytest.approx(2.0, rel=0.02)  # nearest rank: the 2nd of 1, 2, 3, 30 s
    assert (judge["judge_input_tokens"], judge["judge_output_tokens"]) == (310, 12)
    fmt = rows["format"]
    assert (fmt["rollouts"], fmt["graded"], fmt["failures"], fmt["failure_cost"]) == (4, 0, 0, 0.0)
    assert fmt["share_mean"] == round(statistics.fmean(f for *_, f in ROLLOUTS), 4)
