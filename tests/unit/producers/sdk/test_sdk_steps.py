"""Seed 001's rules for step figures, in the SDK: grader calls counted with their step
(``grader_calls="step"``), MFU as a fraction from 0 to 1, and a failed term counting as zero in a
``RolloutBatch``. Read back from the queue (never started) or an ``InMemoryTransport``."""

from __future__ import annotations

import logging

import pytest

from rlpulse.producers import InMemoryTransport, TrainingTelemetry
from rlpulse.base.settings import Settings

pytestmark = pytest.mark.full  # make test sits at its 6-minute limit

SETTINGS = Settings.load({"RLPULSE_TOPIC_PREFIX": "q"})


def make(**kwargs) -> TrainingTelemetry:
    return TrainingTelemetry(project="p", run_id="r", settings=SETTINGS, **kwargs)  # never started: read its queue


def queued_graders(tel: TrainingTelemetry) -> list[tuple[int, str]]:
    return [(r["step"], r["rollout_id"]) for _, _, r in tel.sender.queued_records() if r.get("kind") == "GRADER"]


def grade(tel: TrainingTelemetry, step: int, n: int, outcome: str = "ok") -> None:
    for i in range(n):
        tel.grader(step=step, rollout_id=f"s{step}-{i}", term="judge", outcome=outcome, score=1.0)


def test_the_default_publishes_each_call_when_made() -> None:
    tel = make()
    grade(tel, 1, 2)
    assert queued_graders(tel) == [(1, "s1-0"), (1, "s1-1")]
    assert tel.held_graders is None and tel.discard_step(1) == 0


def test_calls_are_held_until_their_step_completes_and_go_out_before_its_step_event() -> None:
    tel = make(grader_calls="step")
    held = tel.held_graders
    assert held is not None
    grade(tel, 1, 2)
    grade(tel, 2, 3)
    grade(tel, 3, 1)
    assert queued_graders(tel) == [] and (held.held, held.published) == (6, 0)
    tel.step_completed(1)
    assert queued_graders(tel) == [(1, "s1-0"), (1, "s1-1")]
    kinds = [r.get("kind") or r["type"] for _, _, r in tel.sender.queued_records()]
    assert kinds == ["GRADER", "GRADER", "STEP"]  # the step's calls, then the step
    # a loop that reports every few steps: completing step 3 publishes steps 2 and 3, in order
    tel.step_completed(3)
    assert queued_graders(tel)[2:] == [(2, "s2-0"), (2, "s2-1"), (2, "s2-2"), (3, "s3-0")]
    # a call for a step already reported goes out at once
    grade(tel, 3, 2)
    assert queued_graders(tel)[-1] == (3, "s3-1")
    assert (held.held, held.published, held.discarded, held.dropped) == (0, 8, 0, 0)


def test_an_abandoned_step_is_discarded_explicitly_or_at_close_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    transport = InMemoryTransport()
    with caplog.at_level(logging.WARNING, logger="rlpulse.producers.sdk.steps"):
        with TrainingTelemetry(project="p", run_id="r", grader_calls="step", transport=transport) as tel:
            grade(tel, 1, 2, outcome="timeout")
            tel.step_completed(1)
            grade(tel, 2, 4, outcome="unavailable")  # the job gives up on step 2 (say, to restore and redo it)
            assert tel.discard_step(2) == 4
            grade(tel, 2, 1)
            tel.step_completed(2)
            grade(tel, 3, 3, outcome="unavailable")  # the judge refuses the credentials: the job stops in step 3
        held = tel.held_graders
        assert held is not None
    spans = [r for r in transport.records("spans") if r["kind"] == "GRADER"]
    assert [(r["step"], r["outcome"]) for r in spans] == [(1, "timeout"), (1, "timeout"), (2, "ok")]
    assert (held.held, held.published, held.discarded, held.dropped) == (0, 3, 7, 0)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["run r/1: 3 grader calls of steps never completed (3) not published, as seed 001 has it; "
                    "7 discarded and 0 dropped at the buffer's bound in all (grader_calls='step')"]
    # RUN_END counts the spans this writer numbered: the discarded calls never had a number
    end = [r for r in transport.records("steps") if r["type"] == "RUN_END"]
    assert [e["spans_sent"] for e in end] == [3]


def test_held_calls_count_against_the_buffers_bound_and_a_drop_is_counted_as_any(caplog: pytest.LogCaptureFixture) -> None:
    tel = make(grader_calls="step", buffer_bytes=2_000)  # a grader call here is estimated at 434 bytes
    held = tel.held_graders
    assert held is not None
    with caplog.at_level(logging.WARNING, logger="rlpulse.producers.sdk.queue"):
        grade(tel, 1, 6)
    assert (held.held, held.held_bytes, held.dropped) == (4, 4 * 434, 2)
    assert tel.dropped == 2  # the writer's drops, published as every STEP's and heartbeat's dropped_events
    assert [r.getMessage() for r in caplog.records] == [
        "telemetry buffer full (1736 of 2000 bytes undelivered): 1 events dropped so far"]  # then at most every 10 s
    tel.rollout(step=1, rollout_id="x", reward=1.0)  # 480 more bytes: the held calls' bytes are taken
    assert tel.dropped == 3
    tel.step_completed(1)  # the held calls go out within their reservation; the STEP itself does not fit
    assert len(queued_graders(tel)) == 4 and held.held_bytes == 0 and tel.dropped == 4


def test_a_discarded_steps_bytes_are_given_back_to_the_buffer() -> None:
    tel = make(grader_calls="step", buffer_bytes=2_000)
    grade(tel, 1, 4)  # 1,736 of 2,000 bytes reserved
    tel.rollout(step=1, rollout_id="x", reward=1.0)
    assert tel.dropped == 1
    assert tel.discard_step(1) == 4
    tel.rollout(step=1, rollout_id="x", reward=1.0)
    assert tel.dropped == 1 and [r["kind"] for _, _, r in tel.sender.queued_records()] == ["ROLLOUT"]


def test_a_rank_other_than_0_releases_its_own_calls_and_sends_no_step() -> None:
    tel = make(grader_calls="step", rank=1, world_size=2)
    grade(tel, 1, 2)
    tel.step_completed(1)
    assert queued_graders(tel) == [(1, "s1-0"), (1, "s1-1")]
    assert [r for _, _, r in tel.sender.queued_records() if r.get("type") == "STEP"] == []


def test_a_bad_mode_a_bad_step_and_a_refused_step_change_nothing() -> None:
    with pytest.raises(ValueError, match="grader_calls must be one of call, step; got 'steps'"):
        make(grader_calls="steps")
    tel = make(grader_calls="step")
    grade(tel, 1, 1)
    with pytest.raises(ValueError, match="step must be a non-negative integer"):
        tel.discard_step(-1)
    with pytest.raises(ValueError, match="mfu must be a fraction"):
        tel.step_completed(1, mfu=1.7)  # refused before anything changed: the call stays held
    assert tel.held_graders is not None and tel.held_graders.held == 1 and tel.step_count == 0


@pytest.mark.parametrize("mfu", [1.7, 100.0, -0.01, 1.0000001])
def test_mfu_outside_0_to_1_is_refused_naming_the_value_and_the_range(mfu: float) -> None:
    tel = make()
    with pytest.raises(ValueError) as raised:
        tel.step_completed(step=1, mfu=mfu)
    assert str(raised.value) == (f"mfu must be a fraction from 0 to 1 (model FLOPs utilization; seed 001), got {mfu!r}; "
                                 "a percentage must be divided by 100")
    assert tel.step_count == 0


@pytest.mark.parametrize("mfu", [0, 0.0, 0.41, 1, 1.0, None])
def test_mfu_from_0_to_1_is_published(mfu: float | None) -> None:
    tel = make()
    tel.step_completed(step=1, mfu=mfu)
    (step,) = [r for _, _, r in tel.sender.queued_records() if r.get("type") == "STEP"]
    assert step["mfu"] == (None if mfu is None else float(mfu))


def test_a_failed_term_of_a_batch_counts_zero_and_adds_nothing_to_the_reward() -> None:
    tel = make()
    with tel.rollouts(step=4) as batch:
        for rid, judged in (("a", 1.0), ("b", None), ("c", 0.5), ("d", None)):
            batch.term(rid, "format", 0.25)
            if rid == "d":
                batch.failed(rid, "judge")
            else:
                batch.term(rid, "judge", judged)
    shares = {r["rollout_id"]: (r["term_shares"], r["reward"]) for _, _, r in tel.sender.queued_records()}
    assert shares == {"a": ({"format": 0.25, "judge": 1.0}, 1.25), "b": ({"format": 0.25, "judge": 0.0}, 0.25),
                      "c": ({"format": 0.25, "judge": 0.5}, 0.75), "d": ({"format": 0.25, "judge": 0.0}, 0.25)}
