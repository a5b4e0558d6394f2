"""What trainers report, from the SDK through the real broker, ``rlpulse streams`` and ``rlpulse
sink`` into ClickHouse: the trainer's scalars in ``step_metrics``, a
rollout's policy version and finish reason, staleness per step and its alert, a grader that
raised under cause ``error`` with no score and its own times, RUN_END's status, and two ranks
counting each step once.
"""

from __future__ import annotations

import time

import pytest

from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.producers import TrainingTelemetry
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from tests.integration import until

pytestmark = pytest.mark.integration

STEPS = (0, 1, 6)  # step 6 trains on rollouts of policy 0: staleness 6, over the default bound of 4


def publish(settings: Settings) -> int:
    """Publishes the job; returns the end time it gave the grader that raised."""
    graded_at = time.time_ns() - 3 * 10**9  # its own end: before it is published, within the lateness
    with pytest.raises(RuntimeError, match="the trainer crashed"):
        with TrainingTelemetry(project="tr", run_id="crash", settings=settings) as tel:
            with TrainingTelemetry(project="tr", run_id="crash", settings=settings, rank=1, world_size=2) as rank1:
                for step in STEPS:
                    for tel_, who in ((tel, "r0"), (rank1, "r1")):
                        version = step if step < 2 else 0
                        tel_.rollout(step=step, rollout_id=f"{who}-{step}", reward=1.0, completion_tokens=8, max_tokens=8,
                                     finish_reason="stop" if who == "r0" else "length", policy_version=version)
                        tel_.step_completed(step, metrics={"loss": 1.0 / (step + 1), "clip_ratio/region_mean": 0.0})
                    tel.log(step, {"grad_norm": float(step)})
                tel.grader(step=0, rollout_id="r0-0", term="judge", outcome="error", score=0.5,
                           start_ns=graded_at - 10**9, end_ns=graded_at)
                tel.grader(step=0, rollout_id="r1-0", term="judge", outcome="ok", score=0.5, duration_s=0.1)
                tel.checkpoint(1, "save", outcome="failed", error="OSError: disk full", duration_s=2.0)
                with tel.checkpointing(6, "save") as ck:
                    ck.size_bytes = 4_000_000
                assert rank1.flush(30) == 0
            raise RuntimeError("the trainer crashed")
    return graded_at


@pytest.fixture(scope="module")
def ran(module_settings: Settings) -> tuple[Settings, int]:
    settings = module_settings
    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        graded_at = publish(settings)
        pipeline.wait_caught_up(until=until.counts(settings, {
            "SELECT count() FROM $db.spans FINAL WHERE project = 'tr'": 10,
            "SELECT count() FROM $db.steps FINAL WHERE project = 'tr'": 8,
            "SELECT count() FROM $db.step_stats FINAL WHERE project = 'tr'": 3,
            "SELECT count() FROM $db.alerts FINAL WHERE rule = 'policy_stale'": 1,
            "SELECT count() FROM $db.alerts FINAL WHERE rule = 'checkpoint_failed'": 2}))
        pipeline.stop()
    return settings, graded_at


def rows(settings: Settings, sql: str) -> list[tuple]:
    got = until.query(settings, sql)
    assert got is not None
    return got


def test_each_step_counts_once_across_ranks_and_the_run_ended_failed(ran: tuple[Settings, int]) -> None:
    assert rows(ran[0], "SELECT type, step, step_count, status FROM $db.steps FINAL WHERE project = 'tr' "
                     "ORDER BY time_ns, type") == [
        ("RUN_START", -1, 0, None), ("STEP", 0, 1, None), ("METRICS", 0, 1, None), ("STEP", 1, 2, None),
        ("METRICS", 1, 2, None), ("STEP", 6, 3, None), ("METRICS", 6, 3, None), ("RUN_END", -1, 3, "failed")]


def test_the_trainers_scalars_are_long_form(ran: tuple[Settings, int]) -> None:
    got = rows(ran[0], "SELECT step, name, value FROM $db.step_metrics WHERE run_id = 'crash' ORDER BY step, name")
    assert got == [(s, n, v) for s in STEPS
                   for n, v in (("clip_ratio/region_mean", 0.0), ("grad_norm", float(s)), ("loss", 1.0 / (s + 1)))]


def test_rollouts_carry_their_policy_version_finish_reason_and_clipped(ran: tuple[Settings, int]) -> None:
    got = rows(ran[0], "SELECT rollout_id, policy_version, finish_reason, clipped FROM $db.spans FINAL "
                    "WHERE project = 'tr' AND kind = 'ROLLOUT' ORDER BY rollout_id")
    assert got == [(f"r{r}-{s}", s if s < 2 else 0, "stop" if r == 0 else "length", r == 1) for r in (0, 1) for s in STEPS]


def test_staleness_per_step_and_the_alert(ran: tuple[Settings, int]) -> None:
    stats = rows(ran[0], "SELECT step, rollouts, clipped_ratio, staleness_max, staleness_mean FROM $db.step_stats FINAL "
                      "WHERE project = 'tr' ORDER BY step")
    assert stats == [(0, 2, 0.5, 0, 0.0), (1, 2, 0.5, 0, 0.0), (6, 2, 0.5, 6, 6.0)]
    # it fires at the stale step, and resolves when the run ends (its last step was the stale one)
    assert rows(ran[0], "SELECT rule, state, value, threshold, position(summary, 'run ended') > 0 FROM $db.alerts FINAL "
                        "WHERE project = 'tr' AND rule = 'policy_stale' ORDER BY state") == [
        ("policy_stale", "FIRING", 6.0, 4.0, False), ("policy_stale", "RESOLVED", 6.0, 4.0, True)]


def test_a_grader_that_raised_has_no_score_and_its_own_times(ran: tuple[Settings, int]) -> None:
    settings, graded_at = ran
    got = rows(settings, "SELECT outcome, score, start_time_ns, end_time_ns FROM $db.spans FINAL "
                    "WHERE project = 'tr' AND kind = 'GRADER' ORDER BY outcome")
    assert got[0] == ("error", None, graded_at - 10**9, graded_at)
    assert got[1][:2] == ("ok", 0.5)
    failures = rows(settings, "SELECT cause, sum(failures), sum(graded) FROM $db.grader_failures FINAL WHERE project = 'tr' "
                         "GROUP BY cause ORDER BY cause")
    # counted in the window of its own end, 3 s before it was published: one of the two scores failed
    assert {c: f for c, f, _ in failures}["error"] == 1 and sum(g for c, _, g in failures if c == "error") == 2


def test_checkpoints_and_the_alert_of_a_failed_save(ran: tuple[Settings, int]) -> None:
    from rlpulse.sinks.store.clickhouse import open_reader
    from rlpulse.sinks.read.queries import saved_sql

    store = open_reader(ran[0].clickhouse_dsn, owner="test")
    try:
        result = store.client.query(saved_sql("checkpoints", {"run_id": "crash"}, store.database),
                                    parameters={"run_id": "crash"})
        got = [dict(zip(result.column_names, r)) for r in result.result_rows]
    finally:
        store.close()
    assert [(r["step"], r["op"], r["outcome"], r["bytes"], r["error"]) for r in got] == [
        (1, "save", "failed", None, "OSError: disk full"), (6, "save", "ok", 4_000_000, "")]
    assert got[0]["duration_s"] == 2.0 and got[0]["mb_per_s"] is None
    assert rows(ran[0], "SELECT state, summary FROM $db.alerts FINAL WHERE rule = 'checkpoint_failed' ORDER BY time_ns") == [
        ("FIRING", "checkpoint save at step 1 failed: OSError: disk full"), ("RESOLVED", "checkpoint saved at step 6")]
