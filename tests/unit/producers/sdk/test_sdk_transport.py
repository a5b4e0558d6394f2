"""The SDK end to end through an ``InMemoryTransport``: no broker, the same containers Kafka would get.

What a user of the SDK checks: the messages decode (``rlpulse.schemas.codec``) to exactly the records of
the calls made; sequence ids rise by one per topic; a failing destination keeps the buffer and
``flush()`` says how many events wait; a full buffer drops and counts; nothing arrives twice.
"""

from __future__ import annotations

import ast
import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rlpulse.producers import AsyncTrainingTelemetry, InMemoryTransport, TrainingTelemetry
from rlpulse.producers.sdk.records import span_id, trace_id
from rlpulse.producers.sdk.sender import SenderConfig
from rlpulse.producers.sdk.sequence import TAG_BITS
from rlpulse.schemas import enums
from rlpulse.schemas.codec import load_schemas, record_count
from rlpulse.base.settings import Settings

SETTINGS = Settings.load({"RLPULSE_TOPIC_PREFIX": "mem", "RLPULSE_HEARTBEAT_INTERVAL": "1h"})
NOW = 7_000_000_000
ROOT = Path(__file__).resolve().parents[4]


def telemetry(transport: InMemoryTransport, **kwargs) -> TrainingTelemetry:
    return TrainingTelemetry(project="p", run_id="r", settings=SETTINGS, clock=lambda: NOW, transport=transport, **kwargs)


def test_calls_arrive_as_exactly_the_records_given():
    transport = InMemoryTransport()
    with telemetry(transport, stage="rl") as tel:
        tel.rollout(step=3, rollout_id="a", reward=0.75, term_shares={"judge": 0.5, "format": 0.25},
                    completion_tokens=1024, max_tokens=1024, sample_id="prompt-1", duration_s=2.0, attributes={"t": 0.5})
        tel.grader(step=3, rollout_id="a", term="judge", outcome="timeout", duration_s=1.0, score=0.9, input_tokens=11)
        tel.grader(step=3, rollout_id="a", term="format", outcome="ok", duration_s=0.5, score=1.0)
        tel.step_completed(step=3, tokens=4000, duration_s=2.0, mfu=0.25)
        writer, tag = tel.writer_id, tel.sequence.tag
    # sequence_id is the start order (rlpulse.producers.sdk.sequence): this fake clock is before its
    # 2020 epoch, so the ticks start at 1 and count up in start order, still unique in the writer
    assert {(topic, key) for topic, key, _ in transport.messages} == {("mem.spans", b"p/r"), ("mem.steps", b"p/r")}
    identity = dict(project="p", run_id="r", attempt=1, stage="rl", writer_id=writer, time_ns=NOW, end_time_ns=NOW)
    nulls = dict(parent_span_id=None, status_message="", attempt_id="", attributes={}, term=None, outcome=None, score=None,
                 judge_input_tokens=None, judge_output_tokens=None, reward=None, term_shares={}, completion_tokens=None,
                 max_tokens=None, clipped=None, sample_id=None, policy_version=None, finish_reason=None,
                 checkpoint_op=None, checkpoint_bytes=None, metrics={})
    rollout_span = span_id("r/1/a/rollout")
    expected_spans = [
        {**nulls, **identity, "writer_sequence": 1, "sequence_id": 1 << TAG_BITS | tag,
         "trace_id": trace_id("r/1/a"), "span_id": rollout_span, "name": "rollout",
         "kind": "ROLLOUT", "start_time_ns": NOW - 2_000_000_000, "status": "OK", "rollout_id": "a", "step": 3,
         "attributes": {"t": 0.5}, "reward": 0.75, "term_shares": {"judge": 0.5, "format": 0.25},
         "completion_tokens": 1024, "max_tokens": 1024, "clipped": True, "sample_id": "prompt-1"},
        {**nulls, **identity, "writer_sequence": 2, "sequence_id": 2 << TAG_BITS | tag,
         "trace_id": trace_id("r/1/a"), "parent_span_id": rollout_span,
         "name": "grader judge", "kind": "GRADER", "start_time_ns": NOW - 1_000_000_000, "status": "ERROR",
         "status_message": "timeout", "rollout_id": "a", "step": 3, "term": "judge", "outcome": "timeout",
         "score": None, "judge_input_tokens": 11},  # a failed grader's score is no score
        {**nulls, **identity, "writer_sequence": 3, "sequence_id": 3 << TAG_BITS | tag,
         "trace_id": trace_id("r/1/a"), "parent_span_id": rollout_span,
         "name": "grader format", "kind": "GRADER", "start_time_ns": NOW - 500_000_000, "status": "OK",
         "rollout_id": "a", "step": 3, "term": "format", "outcome": "ok", "score": 1.0},
    ]
    spans = transport.records("spans")
    assert [len(r.pop("span_id")) for r in spans[1:]] == [8, 8]  # a grader span's own id is random
    assert spans == expected_spans
    step_identity = dict(project="p", run_id="r", attempt=1, stage="rl", writer_id=writer, time_ns=NOW, trainer="rl",
                         dropped_events=0)
    none = dict(step=-1, tokens=0, duration_s=0.0, throughput=0.0, mfu=None, spans_sent=0, metrics={}, status=None, config={})
    assert transport.records("steps") == [
        {**step_identity, **none, "sequence_id": 1, "type": "RUN_START", "step_count": 0},
        {**step_identity, "sequence_id": 2, "type": "STEP", "step": 3, "step_count": 1, "tokens": 4000, "duration_s": 2.0,
         "throughput": 2000.0, "mfu": 0.25, "spans_sent": 0, "metrics": {}, "status": None, "config": {}},
        {**step_identity, **none, "sequence_id": 3, "type": "RUN_END", "step_count": 1, "spans_sent": 3, "status": "finished"},
    ]
    assert tel.delivered == 6 and tel.pending == 0 and tel.dropped == 0


def test_sequence_ids_strictly_increase_per_topic_across_threads_and_messages():
    transport = InMemoryTransport()
    tel = telemetry(transport, sender_config=SenderConfig(batch_records=50))
    tel.start()

    def work(t: int) -> None:
        for i in range(200):
            tel.rollout(step=i, rollout_id=f"t{t}-{i}", reward=0.5)
            tel.grader(step=i, rollout_id=f"t{t}-{i}", term="judge", outcome="ok", duration_s=0.1, score=1.0)
            if i % 20 == 0:
                tel.step_completed(step=i)
                assert tel.flush(10) == 0  # several rounds, so several messages per topic

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert tel.close(10) == 0
    spans = transport.values("spans")
    assert len(spans) >= 16 and all(record_count(v) <= 50 for v in spans)
    assert [r["writer_sequence"] for r in transport.records("spans")] == list(range(1, 4 * 200 * 2 + 1))
    step_ids = [r["sequence_id"] for r in transport.records("steps")]
    assert step_ids == list(range(1, 1 + 4 * 10 + 2))  # RUN_START, 40 steps, RUN_END


def test_a_failing_transport_keeps_the_buffer_and_flush_reports_what_waits():
    transport = InMemoryTransport()
    transport.fail()
    tel = telemetry(transport)
    tel.start()  # RUN_START
    for i in range(20):
        tel.rollout(step=0, rollout_id=f"a{i}", reward=float(i))
    assert tel.flush(timeout=0.5) == 21  # every event still waits, none lost
    assert tel.pending == 21 and tel.delivered == 0 and tel.dropped == 0 and transport.messages == []
    assert transport.attempts >= 2  # it was retried, not given up on
    transport.heal()
    assert tel.flush(timeout=15) == 0
    assert [r["reward"] for r in transport.records("spans")] == [float(i) for i in range(20)]  # once each, in order
    assert [r["type"] for r in transport.records("steps")] == ["RUN_START"]
    assert tel.close(10) == 0 and tel.delivered == 22


def test_a_few_failed_sends_are_retried_in_order():
    transport = InMemoryTransport()
    transport.fail(ConnectionResetError("connection reset"), messages=3)
    with telemetry(transport) as tel:
        for i in range(5):
            tel.rollout(step=i, rollout_id=f"a{i}", reward=0.5)
            assert tel.flush(15) == 0
    assert [r["step"] for r in transport.records("spans")] == [0, 1, 2, 3, 4]
    assert [r["sequence_id"] for r in transport.records("steps")] == [1, 2]
    assert transport.attempts == len(transport.messages) + 3


def test_a_full_buffer_drops_and_counts_and_the_rest_arrives():
    transport = InMemoryTransport()
    transport.fail()
    tel = telemetry(transport, buffer_bytes=20_000)
    tel.start()
    calls = 200
    for i in range(calls):
        tel.grader(step=0, rollout_id=f"r{i}", term="judge", outcome="ok", duration_s=0.1, score=1.0)
    accepted_spans = tel.pending - 1  # RUN_START is queued too
    assert 0 < accepted_spans < calls and tel.dropped == calls - accepted_spans
    assert tel.flush(timeout=0.3) == accepted_spans + 1
    transport.heal()
    assert tel.flush(timeout=15) == 0
    tel.close(10)
    spans = transport.records("spans")
    # What was accepted arrives, in call order, numbered without gaps (a dropped event takes no id).
    assert [r["rollout_id"] for r in spans] == [f"r{i}" for i in range(accepted_spans)]
    assert [r["writer_sequence"] for r in spans] == list(range(1, accepted_spans + 1))
    # The run's last step event tells the streams how many events this writer dropped.
    assert transport.records("steps")[-1]["dropped_events"] == calls - accepted_spans
    assert tel.delivered == accepted_spans + 2 and tel.dropped == calls - accepted_spans


def test_close_gives_up_after_its_timeout_and_a_later_flush_delivers_what_it_left():
    transport = InMemoryTransport()
    transport.fail()
    tel = telemetry(transport)
    tel.start()
    tel.rollout(step=0, rollout_id="a", reward=0.5)
    assert tel.close(timeout=0.5) == 3  # RUN_START, the rollout, RUN_END
    assert tel.pending == 3 and transport.messages == [] and not tel.sender.running
    transport.heal()
    assert tel.flush(timeout=15) == 0  # a thread starts again for what was left
    assert [r["type"] for r in transport.records("steps")] == ["RUN_START", "RUN_END"]
    assert [r["rollout_id"] for r in transport.records("spans")] == ["a"]


def test_a_message_the_destination_refuses_as_too_large_is_halved_until_it_fits():
    transport = InMemoryTransport(max_message_bytes=8_000)
    with telemetry(transport) as tel:
        for i in range(100):
            tel.rollout(step=i, rollout_id=f"a{i}", reward=0.5, attributes={"note": "n" * 200})
    assert all(len(v) <= 8_000 for v in transport.values())
    assert [r["step"] for r in transport.records("spans")] == list(range(100)) and tel.dropped == 0


def test_the_async_face_delivers_through_the_same_transport():
    transport = InMemoryTransport()

    async def job() -> None:
        async with AsyncTrainingTelemetry(project="p", run_id="r", settings=SETTINGS, transport=transport) as tel:
            await tel.rollout(step=0, rollout_id="a", reward=1.0)
            await tel.grader(step=0, rollout_id="a", term="judge", outcome="unreadable", duration_s=0.5)

    asyncio.run(job())
    assert [(r["kind"], r["outcome"]) for r in transport.records("spans")] == [("ROLLOUT", None), ("GRADER", "unreadable")]
    assert [r["type"] for r in transport.records("steps")] == ["RUN_START", "RUN_END"]


# -- names from one place ---------------------------------------------------------------------
def test_enum_names_are_the_avsc_symbols():
    schemas = load_schemas()
    span = {f["name"]: f for f in schemas["rlpulse.v1.Span"]["fields"]}
    step = {f["name"]: f for f in schemas["rlpulse.v1.Step"]["fields"]}
    assert enums.SPAN_KINDS == tuple(span["kind"]["type"]["symbols"]) == (
        "ROLLOUT", "REWARD", "LLM", "TOOL", "GRADER", "ANNOTATION", "CUSTOM", "CHECKPOINT")
    assert enums.SPAN_KIND_DEFAULT == span["kind"]["type"]["default"] == "CUSTOM"
    assert enums.TRAINERS == ("rl", "sft") and set(enums.TRAINERS) < set(step["trainer"]["type"]["symbols"])
    assert enums.FAILURE_CAUSES == ("timeout", "unavailable", "unreadable", "ungradable", "error")
    assert enums.RUN_STATUSES == ("finished", "failed", "cancelled")
    # The outcome is a string on the wire; its documentation names the same outcomes.
    assert all(o in span["outcome"]["doc"] for o in enums.GRADER_OUTCOMES)


def test_no_module_lists_the_enum_symbols_again():
    """Every tuple of string literals under producers/, streams/ and sinks/ that holds two or more
    span kinds, step types, trainers or grader outcomes is a copy that should import rlpulse.schemas.enums."""
    names = set(enums.SPAN_KINDS) | set(enums.enum_symbols("Step", "type")) | set(enums.GRADER_OUTCOMES)
    copies = []
    for folder in ("producers", "streams", "sinks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                    strings = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                    if len(strings & names) >= 2:
                        copies.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert copies == []


def test_a_span_kind_outside_the_enum_is_refused_and_the_exporter_maps_it_to_the_default():
    tel = TrainingTelemetry(project="p", run_id="r", settings=SETTINGS)  # never started
    span = dict(time_ns=2, trace_id=b"t" * 16, span_id=b"s" * 8, name="chat", start_time_ns=1, end_time_ns=2)
    with pytest.raises(ValueError, match="kind must be one of ROLLOUT, REWARD, LLM, TOOL, GRADER, ANNOTATION, CUSTOM"):
        tel.publish_span(dict(span, kind="WEIRD"))
    for kind in enums.SPAN_KINDS:
        assert tel.publish_span(dict(span, kind=kind))
    assert [r["kind"] for _, _, r in tel.sender.queued_records()] == list(enums.SPAN_KINDS)


# -- import arrows ----------------------------------------------------------------------------
def imports_of(path: Path) -> set[str]:
    """Every rlpulse module ``path`` imports anywhere: at the top, inside functions, under TYPE_CHECKING."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)  # ``from pkg import module``
    return {name for name in out if name.startswith("rlpulse.")}


def test_the_sdks_imports_run_one_way():
    modules = {f"rlpulse.{folder}.{p.stem}": p for folder in ("producers", "schemas")
               for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"}
    graph = {name: imports_of(path) & modules.keys() for name, path in modules.items()}
    for name in graph:  # depth-first: a module reaching itself again is a circle
        seen, todo = set(), list(graph[name])
        while todo:
            other = todo.pop()
            assert other != name, f"import circle through {name}"
            if other not in seen:
                seen.add(other)
                todo.extend(graph[other])
    for name in modules:
        if name.startswith("rlpulse.schemas."):
            assert not {i for i in graph[name] if i.startswith("rlpulse.producers")}, f"{name} imports upward"
    assert not any(i.startswith(("rlpulse.streams", "rlpulse.sinks", "rlpulse.cli", "rlpulse.commands",
                                 "rlpulse.services", "rlpulse.pipeline"))
                   for p in (ROOT / "producers").rglob("*.py") for i in imports_of(p))


def test_importing_the_sdk_imports_no_faust_and_no_clickhouse():
    code = ("import json, sys; import rlpulse.producers; from rlpulse import TrainingTelemetry; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('faust', 'clickhouse_connect', 'chdb', "
            "'rlpulse') )))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    loaded = json.loads(out.stdout)
    assert not [m for m in loaded if not m.startswith("rlpulse")]
    assert not [m for m in loaded if m.startswith(("rlpulse.streams", "rlpulse.sinks", "rlpulse.cli", "rlpulse.services"))]
