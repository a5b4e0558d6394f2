"""``emit_reward``: a reward at its place in the rollout (seed 003), as the export and the reward helpers read it."""

from __future__ import annotations

import math
from typing import Any

import pytest

from rlpulse.producers import InMemoryTransport, TrainingTelemetry
from rlpulse.producers.tracing import Tracer, bind_rollout, emit_reward, observe_processor

pytestmark = pytest.mark.full


def published(fn: Any) -> list[dict[str, Any]]:
    transport = InMemoryTransport()
    with TrainingTelemetry(project="p", run_id="run", transport=transport) as tel, Tracer(tel):
        fn()
    return sorted(transport.records("spans"), key=lambda r: r["sequence_id"])


def test_intermediate_and_final_rewards_are_spans_in_start_order_and_the_final_is_the_rollouts() -> None:
    @observe_processor(kind="ROLLOUT")  # explicit: this test's name says "reward", which the inference reads
    def episode(*, step: int, rollout_id: str) -> None:
        emit_reward(0.25)
        emit_reward(0.5, name="format")
        emit_reward(1.0, final=True)

    spans = published(lambda: episode(step=2, rollout_id="r-1"))
    rollout = next(s for s in spans if s["kind"] == "ROLLOUT")
    notes = [s for s in spans if s["kind"] == "ANNOTATION"]
    assert [(s["name"], s["reward"], s["attributes"]["rlpulse.reward.final"], s["attributes"]["rlpulse.reward.name"])
            for s in notes] == [("rlpulse.reward", 0.25, False, "reward"), ("rlpulse.reward", 0.5, False, "format"),
                                ("rlpulse.reward", 1.0, True, "final")]
    assert rollout["reward"] == 1.0  # the final one is the rollout's, so the streams count it
    assert all(s["parent_span_id"] == rollout["span_id"] and s["rollout_id"] == "r-1" and s["step"] == 2 for s in notes)
    assert rollout["sequence_id"] < notes[0]["sequence_id"] < notes[1]["sequence_id"] < notes[2]["sequence_id"]


def test_an_intermediate_reward_is_not_the_rollouts() -> None:
    @observe_processor(kind="ROLLOUT")  # explicit: this test's name says "reward", which the inference reads
    def episode(*, step: int, rollout_id: str) -> None:
        emit_reward(0.25)

    rollout = next(s for s in published(lambda: episode(step=0, rollout_id="r")) if s["kind"] == "ROLLOUT")
    assert rollout["reward"] is None


def test_a_bound_rollout_takes_rewards_outside_an_entry() -> None:
    def outside() -> None:
        with bind_rollout(rollout_id="r-9", step=4):
            emit_reward(0.75, final=True)

    (span,) = published(outside)
    assert (span["kind"], span["rollout_id"], span["step"], span["reward"]) == ("ANNOTATION", "r-9", 4, 0.75)


@pytest.mark.parametrize("call,message", [
    (lambda: emit_reward(math.nan), "reward"),
    (lambda: emit_reward(1.0, final=1), "final must be True or False"),
    (lambda: emit_reward(1.0, name=""), "name"),
    (lambda: emit_reward(1.0), "must be called inside a rollout"),
])
def test_bad_calls_raise_naming_what_is_wrong(call: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        published(call)
