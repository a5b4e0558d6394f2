"""Seed 001's per-term figures and the zero-std fraction, end to end: the SDK, the real broker,
``rlpulse streams``, ``rlpulse sink``, chDB, then ``rlpulse query --saved term-figures``.

Four rollouts of one step; the judge times out on two of them, so those two carry the judge
term at 0.0 (seed 001: a failed score counts as zero for its term) and the GRADER spans keep their
score NULL. The truth is computed here from the inputs.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.producers import TrainingTelemetry
from rlpulse.schemas.topics import ensure_topics
from rlpulse.base.settings import Settings
from rlpulse.sinks.store.clickhouse import open_reader
from rlpulse.sinks.views.ui_html import fmt_number
from rlpulse.sinks.views.ui_server import UiServer
from tests.integration import until

pytestmark = [pytest.mark.integration, pytest.mark.full]

# (rollout, sample, judge share or None when its grader timed out, format share)
ROLLOUTS = [("a", "s0", 0.5, 0.1), ("b", "s0", None, 0.6), ("c", "s1", 0.3, 0.1), ("d", "s1", None, 0.1)]
# the judge's calls: (rollout, outcome, duration s, input tokens, output tokens)
CALLS = [("a", "ok", 1.0, 100, 7), ("b", "timeout", 30.0, 120, None), ("c", "ok", 2.0, 90, 5),
         ("d", "timeout", 3.0, None, None)]
TOKEN = "term-figures-test-" + "5b2d" * 8


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


@pytest.fixture(scope="module")
def published(module_settings: Settings) -> Settings:
    settings = dataclasses.replace(module_settings, stall_after=60.0, silent_after=60.0)
    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        run_job(settings)
        pipeline.wait_caught_up(until=until.counts(settings, {"step_term_stats": 2, "step_stats": 1}))
        pipeline.stop()
    return settings


def judge_truth() -> dict:
    """The judge's figures of step 0, from the inputs: 4 rollouts, 2 failed scores counted 0."""
    shares = [0.0 if j is None else j for _, _, j, _ in ROLLOUTS]
    return {"rollouts": 4, "graded": 4, "failures": 2, "share_mean": round(statistics.fmean(shares), 4),
            "share_std": round(statistics.pstdev(shares), 4), "failure_cost": 0.8,
            "judge_input_tokens": 310, "judge_output_tokens": 12}


def test_term_figures_and_zero_std_fraction_through_the_pipeline(published: Settings) -> None:
    settings = published
    rows = {r["term"]: r for r in saved(settings, "term-figures", "terms")}
    hist = until.query(settings, "SELECT count, bucket_counts[1] FROM $db.reward_histograms FINAL "
                                 "WHERE run_id = 'terms' AND term = 'judge'")
    stats = until.query(settings, "SELECT samples, samples_same_reward, zero_std_fraction FROM $db.step_stats FINAL "
                                  "WHERE run_id = 'terms'")
    scores = until.query(settings, "SELECT countIf(score IS NULL) FROM $db.spans FINAL "
                                   "WHERE run_id = 'terms' AND kind = 'GRADER' AND outcome != 'ok'")
    assert hist == [(4, 2)]  # the seed's (4, 2): both failed scores in the <= 0 bucket
    assert scores == [(2,)]  # the stored scores stay NULL
    assert stats == [(2, 1, 0.5)]  # s0 scored 0.6 twice; s1 0.4 and 0.1
    judge = rows["judge"]
    assert {k: judge[k] for k in judge_truth()} == judge_truth()
    assert (judge["failure_rate"], judge["share_zero_fraction"]) == (0.5, 0.5)
    assert (judge["duration_p90_s"], judge["duration_p99_s"], judge["duration_max_s"]) == (30.0, 30.0, 30.0)
    assert judge["duration_p50_s"] == pytest.approx(2.0, rel=0.02)  # nearest rank: the 2nd of 1, 2, 3, 30 s
    fmt = rows["format"]
    assert (fmt["rollouts"], fmt["graded"], fmt["failures"], fmt["failure_cost"]) == (4, 0, 0, 0.0)
    assert fmt["share_mean"] == round(statistics.fmean(f for *_, f in ROLLOUTS), 4)


def cells(html: str, term: str) -> dict[str, str]:
    row = re.search(rf'<tr class="term" data-term="{term}">(.*?)</tr>', html).group(1)
    return dict(re.findall(r'<td class="([\w-]+)">([^<]*)</td>', row))


def test_the_run_page_and_the_reports_show_each_terms_figures(published: Settings, tmp_path: Path) -> None:
    dsn, t = published.clickhouse_dsn, judge_truth()
    with UiServer(lambda: open_reader(dsn, owner="test"), dsn, token=TOKEN) as server:
        request = urllib.request.Request(server.url.rstrip("/") + "/run?project=tf&run=terms&attempt=1",
                                         headers={"Authorization": f"token {server.token}"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            page = answer.read().decode()
    judge = cells(page, "judge")
    # numbers by kind (ui_html.fmt_*): the p90 a duration, the step's zero-std fraction a percentage
    assert (judge["share-mean"], judge["share-std"], judge["graded"], judge["failures"], judge["failure-cost"]) == (
        fmt_number(t["share_mean"]), fmt_number(t["share_std"]), "4", "2", "0.8")
    assert (judge["duration-p90-s"], judge["judge-input-tokens"], judge["judge-output-tokens"]) == ("30 s", "310", "12")
    assert re.search(r'<td class="n zero-std">50%</td>', page)
    assert re.search(r'<svg class="chart" data-chart="term-shares".*?data-series="judge" data-points="1"', page)
    text = subprocess.run([sys.executable, "-m", "rlpulse.cli", "report", "--project", "tf"],
                          env={**settings_env(published), "COLUMNS": "250"}, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.split("== reward terms per run: share, grader calls, failures and their cost, judge tokens "
                              "(project tf) ==\n")[1].splitlines()
    by_term = {cols[2]: cols for cols in (re.split(r"\s{2,}", line.strip()) for line in lines[2:4])}
    assert by_term["judge"] == ["terms", "1", "judge", "1", str(t["share_mean"]), str(t["share_std"]), "4", "2", "0.8",
                                "30.0", "310", "12"]
    out = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "rlpulse.cli", "report", "terms", "--html", str(out)],
                          env=settings_env(published), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    html = out.read_text()
    svg = re.search(r'<svg[^>]*data-chart="term-shares".*?</svg>', html, re.S).group(0)
    assert sorted(re.findall(r'<polyline class="series" data-series="([^"]*)"', svg)) == ["format", "judge"]
    row = re.search(r'<tr data-term="judge">(.*?)</tr>', html).group(1)
    assert re.findall(r"<td>([^<]*)</td>", row) == ["judge", "1", str(t["share_mean"]), str(t["share_std"]), "4", "2",
                                                    "0.8", "30.0", "310", "12"]
