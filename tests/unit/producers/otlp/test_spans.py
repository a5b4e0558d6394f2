"""OTLP trace requests -> rlpulse Span records (``rlpulse.producers.otlp.spans``).

Requests are built with opentelemetry-proto's classes (and one from OTLP/JSON), as a Collector's
Kafka exporter would carry them. What is checked is what a reader of the spans table would see:
the kind, the typed fields, and the attribute keys ``rlpulse export`` and the UI read (the same as
rlpulse's own tracer writes), and that every record encodes with the Span schema.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from google.protobuf.json_format import Parse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue, KeyValueList
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from rlpulse.producers.otlp.identity import OtlpRejected
from rlpulse.producers.otlp.spans import CONTENT_LIMIT, MARKER, translate_spans
from rlpulse.producers.sdk.sequence import EPOCH_NS, TAG_BITS
from rlpulse.schemas.catalogue import SPANS_TOPIC
from rlpulse.schemas.codec import Codec

pytestmark = pytest.mark.full

T0 = 1_750_000_000_000_000_000  # ns since the epoch
NOW = T0 + 10_000_000_000
TRACE = bytes(range(1, 17))
RUN = {"akka.optimize.training.run.id": "r1", "akka.optimize.training.run.attempt": 2,
       "akka.optimize.training.project": "p", "akka.optimize.training.stage": "rl", "service.name": "agent",
       "service.instance.id": "pod-7"}
CODEC = Codec()


def value(x: Any) -> AnyValue:
    if isinstance(x, bool):
        return AnyValue(bool_value=x)
    if isinstance(x, int):
        return AnyValue(int_value=x)
    if isinstance(x, float):
        return AnyValue(double_value=x)
    if isinstance(x, list):
        return AnyValue(array_value=ArrayValue(values=[value(i) for i in x]))
    if isinstance(x, dict):
        return AnyValue(kvlist_value=KeyValueList(values=kvs(x)))
    return AnyValue(string_value=x)


def kvs(d: dict[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=k, value=value(x)) for k, x in d.items()]


def span(n: int, name: str, attrs: dict[str, Any], parent: int | None = None, start: int = 0, end: int = 1_000_000,
         status: int = 0, message: str = "") -> Span:
    return Span(trace_id=TRACE, span_id=n.to_bytes(8, "big"), parent_span_id=parent.to_bytes(8, "big") if parent else b"",
                name=name, kind=Span.SPAN_KIND_INTERNAL, start_time_unix_nano=T0 + start, end_time_unix_nano=T0 + end,
                attributes=kvs(attrs), status=Status(code=status, message=message))


def request(*spans: Span, resource: dict[str, Any] | None = None) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=Resource(attributes=kvs(RUN if resource is None else resource)),
        scope_spans=[ScopeSpans(scope=InstrumentationScope(name="test"), spans=list(spans))])])


def records(req: ExportTraceServiceRequest) -> list[dict[str, Any]]:
    outs = translate_spans(req, NOW)
    for out in outs:
        assert (out.topic, out.key, out.record_type) == (SPANS_TOPIC, "p/r1", "Span")
        CODEC.encode("Span", [out.record])  # every field present and of its type: the encoder refuses anything else
    return [o.record for o in outs]


def test_genai_chat_span_reads_as_the_tracers_llm_span() -> None:
    messages = [{"role": "system", "parts": [{"type": "text", "content": "Be brief."}]},
                {"role": "user", "parts": [{"type": "text", "content": "2+2?"}]}]
    output = [{"role": "assistant", "parts": [{"type": "text", "content": "4"}], "finish_reason": "stop"}]
    [r] = records(request(span(1, "chat qwen", {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai", "gen_ai.request.model": "qwen-7b",
        "gen_ai.response.model": "qwen-7b-0601", "gen_ai.response.id": "chatcmpl-1", "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 3, "gen_ai.response.finish_reasons": ["stop"], "gen_ai.request.max_tokens": 64,
        "gen_ai.input.messages": json.dumps(messages), "gen_ai.output.messages": json.dumps(output),
        "akka.optimize.training.rl.rollout.id": "ro-1", "akka.optimize.training.rl.step": 5}, parent=9)))
    a = r["attributes"]
    assert (r["kind"], r["rollout_id"], r["step"], r["completion_tokens"], r["finish_reason"], r["max_tokens"]) == \
        ("LLM", "ro-1", 5, 3, "stop", 64)
    assert json.loads(a["gen_ai.input.messages"]) == [{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": "2+2?"}]
    assert json.loads(a["gen_ai.output.messages"]) == [{"role": "assistant", "content": "4"}]
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"], a["gen_ai.response.finish_reasons"],
            a["gen_ai.response.id"], a["gen_ai.request.model"], a["gen_ai.response.model"]) == \
        (12, 3, "stop", "chatcmpl-1", "qwen-7b", "qwen-7b-0601")
    assert (r["project"], r["run_id"], r["attempt"], r["stage"], r["writer_id"]) == ("p", "r1", 2, "rl", "otlp/pod-7")
    assert (r["time_ns"], r["start_time_ns"], r["end_time_ns"]) == (T0 + 1_000_000, T0, T0 + 1_000_000)
    assert r["parent_span_id"] == (9).to_bytes(8, "big") and r["trace_id"] == TRACE


def test_openinference_llm_span_with_flattened_messages_and_tool_calls() -> None:
    # the names openinference-instrumentation-openai writes (openinference.semconv.trace)
    [r] = records(request(span(1, "ChatCompletion", {
        "openinference.span.kind": "LLM", "llm.system": "openai", "llm.model_name": "gpt-4o-mini",
        "llm.token_count.prompt": 20, "llm.token_count.completion": 7, "llm.token_count.total": 27,
        "llm.invocation_parameters": json.dumps({"max_tokens": 128, "temperature": 0.2}),
        "llm.input_messages.0.message.role": "system", "llm.input_messages.0.message.content": "You add.",
        "llm.input_messages.1.message.role": "user",
        "llm.input_messages.1.message.contents.0.message_content.type": "text",
        "llm.input_messages.1.message.contents.0.message_content.text": "1+1",
        "llm.output_messages.0.message.role": "assistant",
        "llm.output_messages.0.message.tool_calls.0.tool_call.id": "call_1",
        "llm.output_messages.0.message.tool_calls.0.tool_call.function.name": "add",
        "llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments": '{"a":1,"b":1}',
        "input.value": json.dumps({"messages": [], "model": "gpt-4o-mini"}), "input.mime_type": "application/json",
        "llm.finish_reason": "tool_calls", "session.id": "s-1"})))
    a = r["attributes"]
    assert r["kind"] == "LLM" and r["completion_tokens"] == 7 and r["max_tokens"] == 128
    assert json.loads(a["gen_ai.input.messages"]) == [{"role": "system", "content": "You add."},
                                                      {"role": "user", "content": "1+1"}]
    assert json.loads(a["gen_ai.output.messages"]) == [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":1}'}}]}]
    assert (a["gen_ai.request.model"], a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"],
            a["gen_ai.response.finish_reasons"], a["gen_ai.operation.name"]) == ("gpt-4o-mini", 20, 7, "tool_calls", "chat")
    assert a["session.id"] == "s-1" and a["llm.token_count.total"] == 27  # the span's own attributes stay
    # folded into the messages, not kept twice
    assert not [k for k in a if k.startswith("llm.input_messages") or k.startswith("llm.output_messages")]
    assert "input.value" not in a


def test_openinference_response_id_from_output_value() -> None:
    # openinference-instrumentation-openai 0.1.66 records the response id only in output.value (the response
    # body), which is folded into gen_ai.output.messages: the id is kept as the tracer's key
    body = {"id": "chatcmpl-9", "object": "chat.completion", "model": "m-served", "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "42"}}]}
    [r] = records(request(span(1, "ChatCompletion", {
        "openinference.span.kind": "LLM", "llm.model_name": "m-served", "output.value": json.dumps(body),
        "output.mime_type": "application/json", "llm.output_messages.0.message.role": "assistant",
        "llm.output_messages.0.message.content": "42"})))
    a = r["attributes"]
    assert (a["gen_ai.response.id"], json.loads(a["gen_ai.output.messages"])) == \
        ("chatcmpl-9", [{"role": "assistant", "content": "42"}])
    assert "output.value" not in a
    [r] = records(request(span(1, "ChatCompletion", {"openinference.span.kind": "LLM", "output.value": "plain text"})))
    assert "gen_ai.response.id" not in r["attributes"]


def test_openllmetry_indexed_prompt_and_usage() -> None:
    [r] = records(request(span(1, "openai.chat", {
        "llm.request.type": "chat", "gen_ai.system": "openai", "gen_ai.request.model": "m",
        "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "hi",
        "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "hello",
        "gen_ai.completion.0.finish_reason": "length", "llm.usage.prompt_tokens": 2, "llm.usage.completion_tokens": 1})))
    a = r["attributes"]
    assert (r["kind"], r["finish_reason"], r["completion_tokens"]) == ("LLM", "length", 1)
    assert json.loads(a["gen_ai.input.messages"]) == [{"role": "user", "content": "hi"}]
    assert json.loads(a["gen_ai.output.messages"]) == [{"role": "assistant", "content": "hello"}]
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (2, 1)


def test_tool_spans_genai_and_openinference() -> None:
    rs = records(request(
        span(1, "execute_tool add", {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "add",
                                     "gen_ai.tool.call.id": "call_1", "gen_ai.tool.call.arguments": '{"a":1}',
                                     "gen_ai.tool.call.result": "2"}, parent=7, start=10),
        span(2, "search", {"openinference.span.kind": "TOOL", "tool.name": "search", "input.value": '{"q":"x"}',
                           "output.value": "nothing found"}, parent=7, start=20, status=2, message="timeout")))
    assert [r["kind"] for r in rs] == ["TOOL", "TOOL"]
    a, b = rs[0]["attributes"], rs[1]["attributes"]
    assert (a["gen_ai.tool.name"], a["gen_ai.tool.call.id"], json.loads(a["gen_ai.tool.call.arguments"]),
            json.loads(a["gen_ai.tool.call.result"])) == ("add", "call_1", {"a": 1}, 2)
    assert (b["gen_ai.tool.name"], json.loads(b["gen_ai.tool.call.arguments"]), json.loads(b["gen_ai.tool.call.result"])) == \
        ("search", {"q": "x"}, "nothing found")
    assert (rs[1]["status"], rs[1]["status_message"]) == ("ERROR", "timeout")


def test_agent_root_is_the_rollout_and_children_inherit_its_ids() -> None:
    rs = records(request(
        span(2, "llm", {"openinference.span.kind": "LLM"}, parent=1, start=100, end=200),
        span(1, "agent", {"openinference.span.kind": "AGENT", "akka.optimize.training.rl.rollout.id": "ro-9",
                          "akka.optimize.training.rl.rollout.attempt": "ra-1", "akka.optimize.training.rl.step": 3,
                          "akka.optimize.training.rl.reward": 0.75}, start=0, end=1000, status=1),
        span(3, "inner agent", {"openinference.span.kind": "AGENT"}, parent=1, start=50, end=300),
        span(4, "judge", {"openinference.span.kind": "EVALUATOR", "akka.optimize.training.rl.term": "accuracy",
                          "akka.optimize.training.rl.grader.score": 1.0, "gen_ai.usage.input_tokens": 40,
                          "gen_ai.usage.output_tokens": 2}, parent=1, start=400, end=900)))
    assert [r["name"] for r in rs] == ["agent", "inner agent", "llm", "judge"]  # start order
    assert [r["kind"] for r in rs] == ["ROLLOUT", "CUSTOM", "LLM", "GRADER"]
    assert {(r["rollout_id"], r["attempt_id"], r["step"]) for r in rs} == {("ro-9", "ra-1", 3)}
    root, judge = rs[0], rs[3]
    assert (root["reward"], root["status"], root["parent_span_id"]) == (0.75, "OK", None)
    assert (judge["term"], judge["outcome"], judge["score"], judge["judge_input_tokens"], judge["judge_output_tokens"]) == \
        ("accuracy", "ok", 1.0, 40, 2)
    # start order, deterministic: (µs since 2020 of the start) << 12 | a tag of the span id
    assert [r["sequence_id"] >> TAG_BITS for r in rs] == [(T0 + s - EPOCH_NS) // 1000 for s in (0, 50, 100, 400)]
    assert [r["sequence_id"] for r in rs] == [r["sequence_id"] for r in records(request(
        span(4, "judge", {}, parent=1, start=400, end=900), span(1, "agent", {}, start=0, end=1000),
        span(2, "llm", {}, parent=1, start=100, end=200), span(3, "inner agent", {}, parent=1, start=50, end=300)))]
    # publish order: rising through the request, never 0 (0 would make the streams use sequence_id);
    # the ingest renumbers by Kafka position (tests/unit/producers/otlp/test_ingest_numbers.py)
    assert [r["writer_sequence"] for r in rs] == [1, 2, 3, 4]


def test_genai_invoke_agent_root_and_failed_grader() -> None:
    rs = records(request(
        span(1, "invoke_agent solver", {"gen_ai.operation.name": "invoke_agent"}, end=5000),
        span(2, "grade", {"rlpulse.kind": "GRADER", "rlpulse.term": "format",
                          "akka.optimize.training.rl.grader.failure.cause": "timeout",
                          "akka.optimize.training.rl.grader.score": 0.0}, parent=1, start=10, end=4000, status=2)))
    assert [r["kind"] for r in rs] == ["ROLLOUT", "GRADER"]
    assert (rs[1]["term"], rs[1]["outcome"], rs[1]["score"]) == ("format", "timeout", None)  # a failed score is no score


def test_request_from_otlp_json() -> None:
    body = {"resourceSpans": [{"resource": {"attributes": [
        {"key": "rlpulse.run_id", "value": {"stringValue": "r1"}}, {"key": "rlpulse.project", "value": {"stringValue": "p"}},
        {"key": "service.name", "value": {"stringValue": "svc"}}]},
        "scopeSpans": [{"scope": {"name": "x"}, "spans": [{
            "traceId": TRACE.hex(), "spanId": "0000000000000001", "name": "root", "startTimeUnixNano": str(T0),
            "endTimeUnixNano": str(T0 + 5), "status": {"code": "STATUS_CODE_ERROR", "message": "boom"},
            "attributes": [{"key": "rlpulse.rollout_id", "value": {"stringValue": "ro-1"}},
                           {"key": "tags", "value": {"arrayValue": {"values": [{"stringValue": "a"}, {"intValue": "2"}]}}},
                           {"key": "big", "value": {"intValue": "1"}}, {"key": "ratio", "value": {"doubleValue": 0.5}}]}]}]}]}
    # OTLP/JSON ids are hex (the spec), not protobuf JSON's base64: as the receiver does, turn them into bytes
    req = ExportTraceServiceRequest()
    for rs in body["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for s in ss["spans"]:
                s["traceId"], s["spanId"] = (__import__("base64").b64encode(bytes.fromhex(s[k])).decode()
                                             for k in ("traceId", "spanId"))
    Parse(json.dumps(body), req)
    [r] = records(req)
    assert (r["kind"], r["status"], r["status_message"], r["rollout_id"], r["writer_id"]) == \
        ("ROLLOUT", "ERROR", "boom", "ro-1", "otlp/svc")
    assert (r["attributes"]["tags"], r["attributes"]["big"], r["attributes"]["ratio"]) == ('["a", 2]', 1, 0.5)


def test_content_over_the_cap_is_cut_and_marked() -> None:
    long = "x" * (CONTENT_LIMIT + 5000)
    [r] = records(request(span(1, "chat", {"gen_ai.operation.name": "chat", "gen_ai.input.messages": json.dumps(
        [{"role": "user", "content": long}])})))
    a = r["attributes"]
    [message] = json.loads(a["gen_ai.input.messages"])  # still JSON: the string was cut, not the structure
    assert len(a["gen_ai.input.messages"]) <= CONTENT_LIMIT
    assert message["content"].endswith(MARKER.format(a["rlpulse.content.cut_chars"]))
    assert a["rlpulse.content.cut_chars"] > 5000


def test_many_attributes_are_bounded_and_counted() -> None:
    [r] = records(request(span(1, "custom", {f"k{i}": "v" * 5000 for i in range(200)})))
    a = r["attributes"]
    assert len(a) == 127 and a["rlpulse.otlp.attributes_dropped"] == 200 - 125  # room kept for the counts
    assert sum(len(x) for x in a.values() if isinstance(x, str)) <= 256 * 1024
    assert a["rlpulse.otlp.cut_chars"] > 0 and a["k0"].endswith("characters cut]")


@pytest.mark.parametrize("resource, attrs, reason", [
    ({"service.name": "agent"}, {}, "no run id"),
    (RUN, {"akka.optimize.training.run.attempt": "two"}, "the run attempt must be an integer"),
    (RUN, {"deep": [[[[["x"]]]]]}, "nests deeper"),
    (RUN, {"rlpulse.rollout_id": "ro", "akka.optimize.training.rl.reward": "high"}, "the reward must be a number"),
])
def test_a_bad_span_refuses_the_whole_request(resource: dict[str, Any], attrs: dict[str, Any], reason: str) -> None:
    good = span(1, "fine", {"rlpulse.run_id": "r1"}) if resource is not RUN else span(1, "fine", {})
    req = request(good, span(2, "bad one", attrs), resource=resource)
    with pytest.raises(OtlpRejected, match=reason) as raised:
        translate_spans(req, NOW)
    assert "span 'bad one'" in str(raised.value)


@pytest.mark.parametrize("change, reason", [
    ({"trace_id": b"\1" * 8}, "trace_id must be 16 bytes"),
    ({"trace_id": b"\0" * 16}, "trace_id must be 16 bytes, not all zero"),
    ({"span_id": b"\1" * 4}, "span_id must be 8 bytes"),
    ({"parent_span_id": b"\1" * 5}, "parent_span_id must be empty or 8 bytes"),
    ({"start_time_unix_nano": 0}, "start and end times must be set"),
    ({"end_time_unix_nano": T0 - 1}, "before its start"),
])
def test_bad_ids_and_times_are_refused(change: dict[str, Any], reason: str) -> None:
    bad = span(2, "bad", {})
    for field, x in change.items():
        setattr(bad, field, x)
    with pytest.raises(OtlpRejected, match=reason):
        translate_spans(request(span(1, "fine", {}), bad), NOW)


def test_run_wide_trace_gives_no_rollout_to_a_span_outside_its_rollouts() -> None:
    rs = records(request(
        span(1, "run", {}, start=0, end=9000),
        span(2, "rollout a", {"rlpulse.kind": "ROLLOUT", "rlpulse.rollout_id": "a"}, parent=1, start=10, end=500),
        span(3, "rollout b", {"rlpulse.kind": "ROLLOUT", "rlpulse.rollout_id": "b"}, parent=1, start=20, end=600),
        span(4, "call in b", {"gen_ai.operation.name": "chat"}, parent=3, start=30, end=400),
        span(5, "agent under a caller", {"openinference.span.kind": "AGENT"}, parent=1, start=40, end=700),
        span(6, "optimizer step", {}, parent=1, start=50, end=800)))
    assert [(r["name"], r["kind"], r["rollout_id"]) for r in rs] == [
        ("run", "CUSTOM", ""), ("rollout a", "ROLLOUT", "a"), ("rollout b", "ROLLOUT", "b"), ("call in b", "LLM", "b"),
        ("agent under a caller", "CUSTOM", ""), ("optimizer step", "CUSTOM", "")]
