"""Start order and propagation (``sequence_id``, ``inject`` / ``continue_trace``) and seed 000's
return shapes (``RewardOutput`` / ``RolloutOutput``), through a real ``TrainingTelemetry`` whose
spans are read back decoded from its in-memory transport."""

from __future__ import annotations

import enum
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rlpulse.producers import InMemoryTransport, TrainingTelemetry
from rlpulse.producers.sdk.sequence import TAG_BITS, StartSequence, ticks
from rlpulse.producers.tracing import (Tracer, continue_trace, extract, inject, observe_processor, observe_tool,
                                       reward_metrics, set_reward)

REPO = Path(__file__).resolve().parents[4]


class TaskStatus(enum.Enum):  # seed 000's names
    SUCCESS = "success"
    FAILED = "failed"


@dataclass
class Reward:
    reward_score: float
    reward_metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardOutput:
    reward: Reward | None
    status: TaskStatus = TaskStatus.SUCCESS
    error: str | None = None


@dataclass
class RolloutOutput:
    messages: list[dict[str, Any]]
    status: TaskStatus = TaskStatus.SUCCESS
    error: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


def spans_of(fn: Any, *, content: bool = False, clock: Any = None, run_id: str = "run") -> list[dict[str, Any]]:
    transport = InMemoryTransport()
    extra = {"clock": clock} if clock is not None else {}
    with TrainingTelemetry(project="p", run_id=run_id, transport=transport, **extra) as tel, Tracer(tel, content=content):
        fn()
    return sorted(transport.records("spans"), key=lambda r: r["sequence_id"])


# -- the clock -------------------------------------------------------------------------------

def test_the_start_clock_never_goes_back_and_continues_after_a_propagated_id() -> None:
    now = [1_800_000_000_000_000_000]
    clock = StartSequence(lambda: now[0], tag=5)
    a = clock.take()
    now[0] -= 10**9  # the wall clock steps back a second
    b = clock.take()
    assert b > a and ticks(b) == ticks(a) + 1 and b & (2**TAG_BITS - 1) == 5
    ahead = (ticks(a) + 5_000_000) << TAG_BITS | 7  # a parent on a machine five seconds ahead
    c = clock.take(after=ahead)
    assert ticks(c) == ticks(ahead) + 1
    # spans published after the fact sort at their start, and never repeat an id of the writer
    early = clock.at(now[0] - 10**9)
    again = clock.at(now[0] - 10**9)
    assert early < a and again == early + (1 << TAG_BITS)


# -- the order of traced spans ---------------------------------------------------------------

@observe_tool(name="lookup")
def lookup(query: str) -> str:
    return query.upper()


@observe_processor(kind="REWARD")
def judge(answer: str, *, rollout_id: str, step: int) -> RewardOutput:
    reward_metrics({"exact": 1.0})
    return RewardOutput(reward=Reward(reward_score=0.0 if answer == "wrong" else 0.75,
                                      reward_metrics={"format": 1.0, "note": "not a number"}))


def test_sequence_id_is_start_order_and_the_writers_publish_order_is_apart() -> None:
    @observe_processor(kind="ROLLOUT", name="rollout")
    def rollout(*, step: int, rollout_id: str) -> None:
        lookup("a")
        judge("right", rollout_id=rollout_id, step=step)
        lookup("b")

    records = spans_of(lambda: rollout(step=1, rollout_id="r1"))
    assert [(r["kind"], r["name"]) for r in records] == [("ROLLOUT", "rollout"), ("TOOL", "lookup"),
                                                         ("REWARD", "judge"), ("TOOL", "lookup")]
    assert [r["start_time_ns"] for r in records] == sorted(r["start_time_ns"] for r in records)
    # published as each ended: the entry last
    assert [r["kind"] for r in sorted(records, key=lambda r: r["writer_sequence"])] == ["TOOL", "REWARD", "TOOL", "ROLLOUT"]
    entry, reward = records[0], records[2]
    assert entry["reward"] == 0.75 and reward["reward"] == 0.75  # RewardOutput's score, passed to the rollout
    assert reward["metrics"] == {"exact": 1.0, "format": 1.0}  # reward_metrics() and the output's, not the string
    assert reward["attributes"]["rlpulse.metrics_skipped"] == 1


def test_a_reward_scored_zero_counts_zero() -> None:
    @observe_processor(kind="ROLLOUT", name="rollout")
    def rollout(*, step: int, rollout_id: str) -> None:
        judge("wrong", rollout_id=rollout_id, step=step)

    records = spans_of(lambda: rollout(step=1, rollout_id="r0"))
    assert [(r["kind"], r["reward"], r["status"]) for r in records] == [("ROLLOUT", 0.0, "OK"), ("REWARD", 0.0, "OK")]


def test_failed_outputs_mark_the_entry_error_and_take_no_reward() -> None:
    @observe_processor(kind="REWARD")
    def timed_out(*, rollout_id: str, step: int) -> RewardOutput:
        return RewardOutput(reward=Reward(reward_score=1.0), status=TaskStatus.FAILED, error="judge timed out: key sk-123456789")

    @observe_processor(kind="ROLLOUT")
    def scored_by_no_one(*, step: int, rollout_id: str) -> RolloutOutput:
        timed_out(rollout_id=rollout_id, step=step)
        return RolloutOutput(messages=[])

    @observe_processor(kind="ROLLOUT")
    def broke(*, step: int, rollout_id: str) -> RolloutOutput:
        set_reward(1.0)  # a failed status overrides it: the rollout is in no reward figure
        return RolloutOutput(messages=[], status=TaskStatus.FAILED, error="tool crashed")

    @observe_processor(kind="ROLLOUT")
    def fine(*, step: int, rollout_id: str) -> RolloutOutput:
        set_reward(0.5)
        return RolloutOutput(messages=[], metrics={"turns": 3})

    def run() -> None:
        scored_by_no_one(step=2, rollout_id="a")
        broke(step=2, rollout_id="b")
        fine(step=2, rollout_id="c")

    records = spans_of(run, content=True)
    got = {(r["rollout_id"], r["kind"]): (r["status"], r["status_message"], r["reward"]) for r in records}
    assert got == {("a", "REWARD"): ("ERROR", "status FAILED", None), ("a", "ROLLOUT"): ("ERROR", "reward status FAILED", None),
                   ("b", "ROLLOUT"): ("ERROR", "status FAILED", 1.0), ("c", "ROLLOUT"): ("OK", "", 0.5)}
    reward_span = next(r for r in records if r["kind"] == "REWARD")
    assert reward_span["attributes"]["rlpulse.error.message"].startswith("judge timed out")
    assert next(r for r in records if r["rollout_id"] == "c")["metrics"] == {"turns": 3.0}


# -- propagation -----------------------------------------------------------------------------

def test_inject_and_extract_round_trip_and_hostile_headers_are_refused() -> None:
    seen: dict[str, str] = {}

    @observe_processor(kind="ROLLOUT", name="rollout")
    def rollout(*, step: int, rollout_id: str) -> None:
        seen.update(inject())

    records = spans_of(lambda: rollout(step=4, rollout_id="r/ü 1"))
    entry = records[0]
    assert seen["traceparent"] == f"00-{entry['trace_id'].hex()}-{entry['span_id'].hex()}-01"
    assert (seen["x-rollout-id"], seen["x-attempt-id"], seen["x-sequence-id"]) == \
        ("r%2F%C3%BC%201", "1", str(entry["sequence_id"]))  # the entry is the writer's latest start
    context = extract(seen)
    assert context is not None
    assert (context.rollout_id, context.span_id, context.sequence_id, context.step, context.run_id, context.attempt) == \
        ("r/ü 1", entry["span_id"], entry["sequence_id"], 4, "run", 1)
    assert extract({"X-Rollout-Id": "r2", "X-Sequence-Id": "17"}).sequence_id == 17  # seed 003's headers alone
    assert extract({"content-type": "application/json"}) is None
    for bad, named in (({"traceparent": "00-" + "0" * 32 + "-" + "1" * 16 + "-01", "x-rollout-id": "r"}, "traceparent"),
                       ({"x-rollout-id": "r", "x-sequence-id": "-1"}, "x-sequence-id"),
                       ({"x-rollout-id": "r", "x-sequence-id": "9" * 30}, "x-sequence-id"),
                       ({"x-rollout-id": "r", "baggage": "rlpulse.step=1e9"}, "rlpulse.step"),
                       ({"x-rollout-id": "r" * 300}, "rollout id"),
                       ({"baggage": "x" * 9000}, "baggage")):
        with pytest.raises(ValueError, match=named):
            extract(bad)


def test_a_reward_entry_in_another_process_continues_the_rollouts_order(tmp_path: Path) -> None:
    """The REWARD entry runs in a child process whose clock is 30 s behind: it still hangs under the
    span that called it and starts after it in sequence_id, and the rollout's next span after that."""
    child = tmp_path / "grader.py"
    child.write_text('''
import json, sys, time
from rlpulse.producers import InMemoryTransport, TrainingTelemetry
from rlpulse.producers.tracing import Tracer, continue_trace, observe_processor
headers = json.loads(sys.stdin.read())
@observe_processor(kind="REWARD")
def grade(*, rollout_id: str):
    return 1.0
transport = InMemoryTransport()
def behind():
    return time.time_ns() - 30 * 10**9
with TrainingTelemetry(project="p", run_id="run", transport=transport, clock=behind) as tel, Tracer(tel, clock=behind):
    with continue_trace(headers) as context:
        grade(rollout_id=context.rollout_id)
print(json.dumps([{k: (v.hex() if isinstance(v, bytes) else v) for k, v in r.items() if k != "attributes"}
                  for r in transport.records("spans")]))
''')
    remote: list[dict[str, Any]] = []

    @observe_processor(kind="ROLLOUT", name="rollout")
    def rollout(*, step: int, rollout_id: str) -> None:
        lookup("before")
        done = subprocess.run([sys.executable, str(child)], input=json.dumps(inject()), capture_output=True, text=True,
                              timeout=60, cwd=REPO, check=True)
        remote.extend(json.loads(done.stdout))
        lookup("after")

    local = spans_of(lambda: rollout(step=0, rollout_id="x"))
    [grade] = remote
    merged = sorted([(r["sequence_id"], r["kind"], r["name"], r["span_id"].hex() if isinstance(r["span_id"], bytes)
                      else r["span_id"]) for r in local] + [(grade["sequence_id"], grade["kind"], grade["name"],
                                                              grade["span_id"])])
    assert [(kind, name) for _, kind, name, _ in merged] == [("ROLLOUT", "rollout"), ("TOOL", "lookup"),
                                                           ("REWARD", "grade"), ("TOOL", "lookup")]
    assert grade["parent_span_id"] == local[0]["span_id"].hex() and grade["rollout_id"] == "x" and grade["step"] == 0
    assert grade["start_time_ns"] < local[1]["start_time_ns"]  # its clock says it started first; sequence_id knows better
    assert grade["writer_id"] != local[0]["writer_id"] and grade["reward"] == 1.0


def test_a_context_of_another_run_is_refused() -> None:
    def run() -> None:
        with pytest.raises(ValueError, match="run 'other' attempt 1"):
            with continue_trace({"baggage": "rlpulse.run_id=other,rlpulse.attempt=1,rlpulse.rollout_id=r"}):
                pass

    spans_of(run)


def test_a_propagated_id_far_ahead_is_followed_only_five_minutes_and_same_start_ids_stay_apart() -> None:
    now = [1_800_000_000_000_000_000]
    clock = StartSequence(lambda: now[0], tag=1)
    base = ticks(clock.take())
    hostile = clock.take(after=2**63 - 1)  # an x-sequence-id of Avro long's maximum
    assert ticks(hostile) == base + 300_000_000 + 1  # five minutes ahead at most, not year 2091
    assert clock.take(after=-5) > hostile  # nonsense is ignored, the clock still rises
    batch = [clock.at(now[0] - 10**9) for _ in range(20_000)]  # a batch's graders, one start time
    assert len(set(batch)) == len(batch) and batch == sorted(batch)
    assert ticks(clock.at(2**63 - 1)) < 2**51  # a start after 2091 still fits an Avro long


def test_nested_contexts_and_a_foreign_traceparent() -> None:
    got: list[Any] = []

    @observe_tool(name="probe")
    def probe() -> None:
        pass

    def run() -> None:
        outer = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "x-rollout-id": "A",
                 "baggage": "rlpulse.step=7,rlpulse.rollout_id=A"}
        with continue_trace(outer):
            with continue_trace({"x-rollout-id": "B"}) as inner:
                got.append(inner)
                probe()

    records = spans_of(run)
    [span] = records
    # rollout B's span: not A's step or parent; and A's traceparent named a trace not rlpulse's: not a parent either
    assert (span["rollout_id"], span["step"], span["parent_span_id"]) == ("B", None, records[0]["parent_span_id"])
    from rlpulse.producers.sdk.records import span_id as rollout_span
    assert span["parent_span_id"] == rollout_span("run/1/B/rollout")
    with pytest.raises(ValueError, match="mapping"):
        extract(["traceparent"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="x-rollout-id"):
        extract({"x-rollout-id": "r%FF1"})
    assert extract({"x-rollout-id": "r", "x-attempt-id": "at-9f2c"}).attempt is None  # seed 003's own attempt id
