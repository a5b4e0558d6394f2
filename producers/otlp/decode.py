"""OTLP export requests from bytes, bounded before they are trusted: protobuf or JSON, decoded by
``opentelemetry-proto``'s own classes, never by hand.

Every bound is checked before the next step costs more: the size of the bytes (and of what a
gzip body inflates to, read by the receiver), the JSON nesting, then the counts of resources,
spans, data points, attributes and buckets in the parsed request. What breaks one raises
:class:`OtlpRejected` with the reason, which the ingest writes on the dead letter.

The encoding is told apart by the first byte: an OTLP request in protobuf starts with field 1
(a length-delimited resource list, ``0x0a``); JSON starts with ``{`` (after any white space).
The Collector's ``otlp_json`` writes trace and span ids as hex, as OTLP/JSON requires, while
protobuf's JSON reader takes bytes as base64 and would give wrong ids without an error: hex ids
are turned into base64 first.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from rlpulse.producers.otlp.identity import OtlpRejected

TRACES = "traces"
METRICS = "metrics"
REQUESTS: dict[str, type[Message]] = {TRACES: ExportTraceServiceRequest, METRICS: ExportMetricsServiceRequest}


@dataclass(frozen=True)
class OtlpLimits:
    """What one request may hold. A job's export per step is far below each; the Collector's own
    record limit (``max_message_bytes``, 1,000,000 by default) is below ``max_bytes``."""

    max_bytes: int = 8 * 1024 * 1024
    max_json_depth: int = 32
    max_resources: int = 1_000
    max_spans: int = 20_000
    max_points: int = 50_000
    max_scopes: int = 10_000  # of all resources together (an empty scope costs as much as a span to read)
    max_metrics: int = 50_000  # of all scopes together, with or without points
    max_attributes: int = 512  # on one resource, scope, span, event or data point
    max_events: int = 1_000  # events and links of one span, together
    max_buckets: int = 4_096  # of one histogram point (explicit or either side of an exponential one)


def decode(signal: str, data: bytes | None, limits: OtlpLimits | None = None) -> Message:
    """The request of ``signal`` (``traces`` or ``metrics``) in ``data``; raises OtlpRejected."""
    limits = limits or OtlpLimits()
    if signal not in REQUESTS:
        raise OtlpRejected(f"unknown OTLP signal {signal!r}: traces or metrics")
    if data is None:
        raise OtlpRejected("an empty message (a tombstone) is no OTLP request")
    if len(data) > limits.max_bytes:
        raise OtlpRejected(f"an OTLP request of {len(data)} bytes, over the limit of {limits.max_bytes}")
    request = REQUESTS[signal]()
    if is_json(data):
        _parse_json(data, request, limits)
    else:
        try:
            request.ParseFromString(data)
        except (DecodeError, RecursionError, ValueError) as exc:
            raise OtlpRejected(f"not an OTLP {signal} request in protobuf: {exc or type(exc).__name__}") from None
    check_counts(signal, request, limits)
    return request


def is_json(data: bytes) -> bool:
    # ``[`` too: no OTLP request in protobuf starts with it (field 11 as a group), and a JSON array
    # is then refused for what it is
    return data[:64].lstrip()[:1] in (b"{", b"[")


_HEX = re.compile(r"[0-9a-fA-F]*")
_ID_FIELDS = {"traceId": 16, "spanId": 8, "parentSpanId": 8}


def _parse_json(data: bytes, request: Message, limits: OtlpLimits) -> None:
    try:
        # The C parser refuses nesting past the interpreter's recursion limit with RecursionError;
        # the tree's depth is then bounded far lower before protobuf reads it.
        tree = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise OtlpRejected(f"not JSON: {str(exc)[:200] or type(exc).__name__}") from None
    if not isinstance(tree, dict):
        raise OtlpRejected(f"OTLP JSON must be an object, not {type(tree).__name__}")
    depth = _tree_depth(tree, limits.max_json_depth)
    if depth > limits.max_json_depth:
        raise OtlpRejected(f"OTLP JSON nested deeper than the limit of {limits.max_json_depth} levels")
    _hex_ids(tree)
    try:
        # Unknown fields are ignored, as OTLP/JSON receivers must (a newer sender's fields).
        json_format.ParseDict(tree, request, ignore_unknown_fields=True, max_recursion_depth=limits.max_json_depth)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
        raise OtlpRejected(f"not an OTLP request in JSON: {str(exc)[:500]}") from None


def _tree_depth(tree: Any, limit: int) -> int:
    """The nesting of objects and arrays in ``tree``, read without recursion; stops past ``limit``."""
    deepest = 0
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def _hex_ids(node: Any) -> None:
    """Trace and span ids written as hex (OTLP/JSON) into base64 (protobuf's JSON form of bytes), in place."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                size = _ID_FIELDS.get(key)
                if size is not None and isinstance(value, str) and len(value) == 2 * size and _HEX.fullmatch(value):
                    item[key] = base64.b64encode(bytes.fromhex(value)).decode()
                elif isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(item, list):
            stack.extend(v for v in item if isinstance(v, (dict, list)))


def check_counts(signal: str, request: Any, limits: OtlpLimits) -> None:
    """Refuse a request over a count limit (a small message may still list a million empty spans)."""
    if signal == TRACES:
        groups = request.resource_spans
        _at_most(len(groups), limits.max_resources, "resources")
        spans = scopes = 0
        for group in groups:
            _attrs(group.resource.attributes, limits, "a resource")
            scopes += len(group.scope_spans)
            _at_most(scopes, limits.max_scopes, "scopes")
            for scope in group.scope_spans:
                _attrs(scope.scope.attributes, limits, "a scope")
                spans += len(scope.spans)
                _at_most(spans, limits.max_spans, "spans")
                for span in scope.spans:
                    _attrs(span.attributes, limits, "a span")
                    _at_most(len(span.events) + len(span.links), limits.max_events, "events and links of a span")
                    for event in span.events:
                        _attrs(event.attributes, limits, "a span event")
        return
    groups = request.resource_metrics
    _at_most(len(groups), limits.max_resources, "resources")
    points = scopes = metrics = 0
    for group in groups:
        _attrs(group.resource.attributes, limits, "a resource")
        scopes += len(group.scope_metrics)
        _at_most(scopes, limits.max_scopes, "scopes")
        for scope in group.scope_metrics:
            _attrs(scope.scope.attributes, limits, "a scope")
            metrics += len(scope.metrics)
            _at_most(metrics, limits.max_metrics, "metrics")
            for metric in scope.metrics:
                kind = metric.WhichOneof("data")
                if kind is None:
                    continue
                data_points = getattr(metric, kind).data_points
                points += len(data_points)
                _at_most(points, limits.max_points, "data points")
                for point in data_points:
                    _attrs(point.attributes, limits, "a data point")
                    if kind == "histogram":
                        _at_most(len(point.bucket_counts), limits.max_buckets, "buckets of a histogram point")
                        _at_most(len(point.explicit_bounds), limits.max_buckets, "bounds of a histogram point")
                    elif kind == "exponential_histogram":
                        _at_most(len(point.positive.bucket_counts), limits.max_buckets, "positive buckets of a point")
                        _at_most(len(point.negative.bucket_counts), limits.max_buckets, "negative buckets of a point")


def _attrs(attributes: Any, limits: OtlpLimits, where: str) -> None:
    _at_most(len(attributes), limits.max_attributes, f"attributes on {where}")


def _at_most(count: int, limit: int, what: str) -> None:
    if count > limit:
        raise OtlpRejected(f"more than {limit} {what} in one OTLP request")


def trace_key(request: Any) -> bytes | None:
    """The Collector's key for a trace request: the first span's trace id as hex text."""
    for group in request.resource_spans:
        for scope in group.scope_spans:
            for span in scope.spans:
                return span.trace_id.hex().encode()
    return None
