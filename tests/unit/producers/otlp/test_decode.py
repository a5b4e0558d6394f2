"""OTLP requests from bytes: protobuf and the Collector's JSON (hex ids) give the same request,
and each bound refuses with a reason naming it."""

from __future__ import annotations

import base64
import json

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from rlpulse.producers.otlp.decode import METRICS, TRACES, OtlpLimits, decode, is_json, trace_key
from rlpulse.producers.otlp.identity import OtlpRejected, any_value, identity

TRACE_ID = bytes(range(16))
SPAN_ID = bytes(range(8, 16))


def request(spans: int = 1) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    group = req.resource_spans.add()
    kv = group.resource.attributes.add()
    kv.key, kv.value.string_value = "akka.optimize.training.run.id", "r1"
    scope = group.scope_spans.add()
    for i in range(spans):
        span = scope.spans.add()
        span.trace_id, span.span_id, span.parent_span_id = TRACE_ID, SPAN_ID[:7] + bytes([i]), SPAN_ID
        span.name, span.start_time_unix_nano, span.end_time_unix_nano = f"s{i}", 2**62 + 1, 2**62 + 2
    return req


def collector_json(req: ExportTraceServiceRequest) -> bytes:
    """As the Collector's otlp_json writes: ids as hex, 64-bit integers as strings."""
    tree = json_format.MessageToDict(req)
    for span in tree["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        for key in ("traceId", "spanId", "parentSpanId"):
            span[key] = base64.b64decode(span[key]).hex()
    return json.dumps(tree, indent=1).encode()


def test_protobuf_and_the_collectors_json_give_the_same_request() -> None:
    req = request(3)
    assert decode(TRACES, req.SerializeToString()) == req
    data = collector_json(req)
    assert is_json(data) and not is_json(req.SerializeToString())
    decoded = decode(TRACES, b"  \n" + data)
    assert decoded == req  # ids are the bytes sent, not hex read as base64
    assert decoded.resource_spans[0].scope_spans[0].spans[0].start_time_unix_nano == 2**62 + 1
    assert trace_key(decoded) == TRACE_ID.hex().encode()


def test_json_with_base64_ids_is_read_as_protobuf_json_too() -> None:
    req = request(1)
    assert decode(TRACES, json_format.MessageToJson(req).encode()) == req


@pytest.mark.parametrize("data, reason", [
    (None, "tombstone"),
    (b"\x0a\xff\xff\x03abc", "not an OTLP traces request in protobuf"),
    (b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":5}]}]}]}', "not an OTLP request in JSON"),
    (b"[1, 2]", "must be an object"),
    (b'{"a":' + b"[" * 40 + b"]" * 40 + b"}", "nested deeper than the limit of 32"),
    (b'{"resourceSpans":' + b"[" * 5000 + b"]" * 5000 + b"}", "not JSON"),
    (b"{not json", "not JSON"),
])
def test_each_bad_message_is_refused_with_its_reason(data: bytes | None, reason: str) -> None:
    with pytest.raises(OtlpRejected, match=reason):
        decode(TRACES, data)


def test_size_and_count_limits() -> None:
    limits = OtlpLimits(max_bytes=1000, max_spans=2, max_attributes=1)
    with pytest.raises(OtlpRejected, match="over the limit of 1000"):
        decode(TRACES, b"\x0a" * 1001, limits)
    with pytest.raises(OtlpRejected, match="more than 2 spans"):
        decode(TRACES, request(3).SerializeToString(), limits)
    req = request(1)
    kv = req.resource_spans[0].resource.attributes.add()
    kv.key, kv.value.bool_value = "extra", True
    with pytest.raises(OtlpRejected, match="more than 1 attributes on a resource"):
        decode(TRACES, req.SerializeToString(), limits)
    metrics = ExportMetricsServiceRequest()
    metric = metrics.resource_metrics.add().scope_metrics.add().metrics.add()
    metric.name = "h"
    point = metric.histogram.data_points.add()
    point.bucket_counts.extend([0] * 10)
    with pytest.raises(OtlpRejected, match="more than 5 buckets"):
        decode(METRICS, metrics.SerializeToString(), OtlpLimits(max_buckets=5))


def test_attribute_values_are_plain_and_bounded_in_depth() -> None:
    req = request(1)
    value = req.resource_spans[0].scope_spans[0].spans[0].attributes.add().value
    value.kvlist_value.values.add(key="k").value.array_value.values.add().int_value = 7
    assert any_value(value) == {"k": [7]}
    deep = value
    for _ in range(6):
        deep = deep.array_value.values.add()
    with pytest.raises(OtlpRejected, match="nests deeper than 4"):
        any_value(value)


def test_identity_reads_seed_names_then_rlpulse_names_and_refuses_without_a_run() -> None:
    point = {"akka.optimize.training.run.attempt": "3"}
    resource = {"rlpulse.run_id": "r9", "service.name": "trainer", "akka.optimize.training.run.attempt": 1}
    ident = identity(point, resource)
    assert (ident.project, ident.run_id, ident.attempt, ident.stage) == ("trainer", "r9", 3, "")
    with pytest.raises(OtlpRejected, match="no run id: set the resource attribute akka.optimize.training.run.id"):
        identity({"service.name": "x"})
    with pytest.raises(OtlpRejected, match="the run attempt must be an integer"):
        identity({"rlpulse.run_id": "r", "rlpulse.attempt": True})
    with pytest.raises(OtlpRejected, match="the run id must be 1 to 256 characters"):
        identity({"rlpulse.run_id": "r" * 257})
