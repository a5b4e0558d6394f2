"""Seed 001's step rules, from the SDK and the TRL integration through the real broker, ``rlpulse
streams`` and ``rlpulse sink`` into ClickHouse:

* a failed grader score counts as zero for its term: 4 rollouts whose judge failed on 2 give the
  judge term's histogram 4 rollouts, 2 of them in the bucket at or below 0 (it held 2 and 0 when a
  failed term was left out), while the GRADER spans keep a NULL score; through ``RolloutBatch`` and
  through TRL's reward functions (a stand-in trainer calling them as ``GRPOTrainer`` does);
* ``grader_calls="step"``: the grader calls of a completed step arrive, those of the step the job
  stopped in do not; the default publishes both.
"""

from __future__ import annotations

import pytest

from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.producers import TrainingTelemetry
from rlpulse.producers.integrations.trl import instrument
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from tests.integration import until
from tests.unit.producers.integrations.test_integration_trl import BATCH, FakeGRPO, judge

pytestmark = [pytest.mark.integration, pytest.mark.full]

# bounds 0, 0.1 ... 0.9, 0.99, 1, 2, 5: two rollouts at 0 (bucket 0), two at 1.0 (bucket 11, (0.99, 1])
JUDGE_BUCKETS = [2] + [0] * 10 + [2, 0, 0, 0]


def publish_batch(settings: Settings) -> None:
    """4 rollouts; the judge times out on b and d (its score NULL), the format term scores all."""
    with TrainingTelemetry(project="sf", run_id="batch", settings=settings) as tel:
        with tel.rollouts(step=1, policy_version=1) as batch:
            for rid, judged in (("a", 1.0), ("b", None), ("c", 1.0), ("d", None)):
                tel.grader(step=1, rollout_id=rid, term="judge", outcome="ok" if judged else "timeout",
                           score=judged, duration_s=0.5)
                batch.term(rid, "judge", judged)  # None: failed, counts 0.0
                batch.term(rid, "format", 0.5)
                batch.rollout(rid, completion_tokens=8)
        tel.step_completed(1)


def publish_trl(settings: Settings) -> None:
    """TRL: ``judge`` returns None and GraderFailure("timeout") for completions 0 and 1, 1.0 for 2 and 3."""
    trainer = FakeGRPO([judge], [BATCH])
    instrument(trainer, project="sf", run_id="trl", settings=settings)
    trainer.train()


def publish_stopped(settings: Settings, run_id: str, mode: str) -> None:
    """Step 1: 3 grader calls, completed; step 2: 2 calls, then the judge refuses the credentials and the job stops."""
    with pytest.raises(PermissionError):
        with TrainingTelemetry(project="sf", run_id=run_id, settings=settings, grader_calls=mode) as tel:
            for i in range(3):
                tel.grader(step=1, rollout_id=f"s1-{i}", term="judge", outcome="ok", score=1.0, duration_s=0.1)
            tel.step_completed(1)
            for i in range(2):
                tel.grader(step=2, rollout_id=f"s2-{i}", term="judge", outcome="unavailable", duration_s=0.1)
            raise PermissionError("the judge refused the job's credentials")


@pytest.fixture(scope="module")
def ran(module_settings: Settings) -> Settings:
    settings = module_settings
    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        publish_batch(settings)
        publish_trl(settings)
        publish_stopped(settings, "held", "step")
        publish_stopped(settings, "each", "call")
        pipeline.wait_caught_up(until=until.counts(settings, {
            "SELECT count() FROM $db.spans FINAL WHERE project = 'sf' AND kind = 'GRADER'": 4 + 4 + 3 + 5,
            "SELECT count() FROM $db.steps FINAL WHERE project = 'sf' AND type = 'RUN_END'": 4,
            "SELECT count() FROM $db.reward_histograms FINAL WHERE project = 'sf' AND term = 'judge'": 2}))
        pipeline.stop()
    return settings


def rows(settings: Settings, sql: str) -> list[tuple]:
    got = until.query(settings, sql)
    assert got is not None
    return got


@pytest.mark.parametrize("run_id", ["batch", "trl"])
def test_a_failed_score_counts_as_zero_in_its_terms_histogram(ran: Settings, run_id: str) -> None:
    got = rows(ran, f"SELECT step, count, bucket_counts, sum, min, max, zero_fraction FROM $db.reward_histograms FINAL "
                    f"WHERE project = 'sf' AND run_id = '{run_id}' AND term = 'judge'")
    assert got == [(1, 4, JUDGE_BUCKETS, 2.0, 0.0, 1.0, 0.5)]
    # the stored scores of the failed calls stay NULL
    scores = rows(ran, f"SELECT outcome, score FROM $db.spans FINAL WHERE project = 'sf' AND run_id = '{run_id}' "
                       "AND kind = 'GRADER' ORDER BY rollout_id")
    failed = {"batch": [("timeout", None), ("timeout", None)], "trl": [("timeout", None), ("ungradable", None)]}[run_id]
    assert sorted(s for s in scores if s[1] is None) == failed
    assert [s for s in scores if s[1] is not None] == [("ok", 1.0), ("ok", 1.0)]


def test_the_reward_counts_a_failed_term_as_nothing(ran: Settings) -> None:
    got = rows(ran, "SELECT rollout_id, reward, term_shares FROM $db.spans FINAL WHERE project = 'sf' "
                    "AND run_id = 'batch' AND kind = 'ROLLOUT' ORDER BY rollout_id")
    assert [(r, w, dict(t)) for r, w, t in got] == [
        ("a", 1.5, {"judge": 1.0, "format": 0.5}), ("b", 0.5, {"judge": 0.0, "format": 0.5}),
        ("c", 1.5, {"judge": 1.0, "format": 0.5}), ("d", 0.5, {"judge": 0.0, "format": 0.5})]


def test_step_scoped_grader_calls_of_the_step_the_job_stopped_in_are_not_published(ran: Settings) -> None:
    got = rows(ran, "SELECT run_id, step, count() FROM $db.spans FINAL WHERE project = 'sf' AND kind = 'GRADER' "
                    "AND run_id IN ('held', 'each') GROUP BY run_id, step ORDER BY run_id, step")
    assert got == [("each", 1, 3), ("each", 2, 2), ("held", 1, 3)]
    ends = rows(ran, "SELECT run_id, status, step_count FROM $db.steps FINAL WHERE project = 'sf' AND type = 'RUN_END' "
                     "AND run_id IN ('held', 'each') ORDER BY run_id")
    assert ends == [("each", "failed", 1), ("held", "failed", 1)]

