"""Hostile OTLP on the OTLP topics against the real ``rlpulse otlp-ingest``, ``rlpulse streams`` and
``rlpulse sink``.

Between two good trace requests (two spans each, protobuf and JSON), anyone who can write to an
OTLP topic sends:

* an oversized request: 9 MiB, gzip-compressed on the wire so the broker takes it;
* deep nesting: an attribute value nested 40 arrays deep (protobuf), and JSON nested 100 levels;
* lying lengths: a protobuf whose length prefix claims more bytes than follow;
* wrong types: JSON whose span name is a number, and a span whose trace id has 3 bytes;
* no run id: a well-formed request that names no run;
* random bytes.

Each is one dead letter with its reason; the good requests land whole (4 spans in ClickHouse,
exactly); nothing of a hostile request reaches a table; the ingest never restarted.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import time
from collections.abc import Iterator

import pytest
from aiokafka import AIOKafkaProducer
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from rlpulse.base.settings import Settings
from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.producers.otlp.ingest import ingest_group
from rlpulse.schemas.catalogue import DLQ_TOPIC, OTLP_METRICS_TOPIC, OTLP_SPANS_TOPIC
from rlpulse.schemas.dead_letters import REASON, SOURCE_TOPIC
from rlpulse.schemas.topics import ensure_topics, read_topic
from tests.integration import until

pytestmark = [pytest.mark.integration, pytest.mark.full]

PROJECT = "otlp-hostile"
T0 = time.time_ns() // 1_000_000_000 * 1_000_000_000  # recent: older rows fall to the tables' TTL


def trace_request(run: str, spans: int = 2, salt: int = 0) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    group = request.resource_spans.add()
    for key, value in (("service.name", "agent"), ("akka.optimize.training.project", PROJECT),
                       ("akka.optimize.training.run.id", run), ("akka.optimize.training.run.attempt", 1)):
        kv = group.resource.attributes.add()
        kv.key = key
        if isinstance(value, int):
            kv.value.int_value = value
        else:
            kv.value.string_value = value
    scope = group.scope_spans.add()
    for i in range(spans):
        span = scope.spans.add()
        span.trace_id = bytes([salt + 1] * 16)
        span.span_id = bytes([salt + 1] * 7 + [i + 1])
        span.name = f"chat {i}"
        span.start_time_unix_nano = T0 + i * 1_000_000
        span.end_time_unix_nano = T0 + i * 1_000_000 + 500_000
        kv = span.attributes.add()
        kv.key, kv.value.string_value = "gen_ai.operation.name", "chat"
    return request


def as_json(request: ExportTraceServiceRequest) -> bytes:
    """OTLP/JSON as the Collector writes it: ids in hex, 64-bit integers as strings."""
    from google.protobuf import json_format

    tree = json_format.MessageToDict(request)
    for group in tree["resourceSpans"]:
        for scope in group["scopeSpans"]:
            for span in scope["spans"]:
                for key in ("traceId", "spanId"):
                    span[key] = base64.b64decode(span[key]).hex()
    return json.dumps(tree).encode()


def deep_attribute() -> bytes:
    request = trace_request("deep", spans=1, salt=7)
    value: AnyValue = request.resource_spans[0].scope_spans[0].spans[0].attributes.add().value
    request.resource_spans[0].scope_spans[0].spans[0].attributes[-1].key = "deep"
    for _ in range(40):
        value = value.array_value.values.add()
    value.string_value = "bottom"
    return request.SerializeToString()


def lying_length() -> bytes:
    good = trace_request("liar", spans=1, salt=8).SerializeToString()
    return b"\x0a\xff\xff\x03" + good[2:]  # field 1 claims 65,535 bytes; far fewer follow


def short_trace_id() -> bytes:
    request = trace_request("short-id", spans=1, salt=9)
    request.resource_spans[0].scope_spans[0].spans[0].trace_id = b"\x01\x02\x03"
    return request.SerializeToString()


def no_run() -> bytes:
    request = ExportMetricsServiceRequest()
    group = request.resource_metrics.add()
    kv = group.resource.attributes.add()
    kv.key, kv.value.string_value = "service.name", "no-run"
    metric = group.scope_metrics.add().metrics.add()
    metric.name = "akka.optimize.training.rl.step.count"
    metric.sum.is_monotonic = True
    metric.sum.aggregation_temporality = 2
    point = metric.sum.data_points.add()
    point.as_int, point.time_unix_nano = 1, T0
    return request.SerializeToString()


HOSTILE = [  # topic, value, what its dead letter's reason says
    (OTLP_SPANS_TOPIC, b"\x0a" + os.urandom(16) * (9 << 16), "over the limit of"),
    (OTLP_SPANS_TOPIC, deep_attribute(), "nests deeper than"),
    (OTLP_SPANS_TOPIC, b'{"resourceSpans":' + b"[" * 100 + b"]" * 100 + b"}", "nested deeper than the limit"),
    (OTLP_SPANS_TOPIC, lying_length(), "not an OTLP traces request in protobuf"),
    (OTLP_SPANS_TOPIC, b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":5}]}]}]}', "not an OTLP request in JSON"),
    (OTLP_SPANS_TOPIC, short_trace_id(), "trace_id must be 16 bytes"),
    (OTLP_METRICS_TOPIC, no_run(), "no run id"),
    (OTLP_SPANS_TOPIC, bytes(range(256)) * 4, "not an OTLP traces request"),
]


async def _produce(settings: Settings, messages: list[tuple[str, bytes]]) -> None:
    producer = AIOKafkaProducer(compression_type="gzip", max_request_size=64 << 20, max_batch_size=64 << 20,
                                **settings.kafka_client_kwargs())
    await producer.start()
    try:
        for short, value in messages:
            await producer.send_and_wait(settings.topic(short), value=value)
    finally:
        await producer.stop()


@pytest.fixture(scope="module")
def ran(module_settings: Settings) -> Iterator[tuple[Settings, dict]]:
    settings = module_settings
    ensure_topics(settings)
    pipeline = Pipeline(settings)
    try:
        pipeline.start(("otlp-ingest", "streams", "sink"))
        wait_groups_ready(settings, (settings.app_id, settings.sink_group, ingest_group(settings)), pipeline)
        messages = [(OTLP_SPANS_TOPIC, trace_request("before").SerializeToString())]
        messages += [(topic, value) for topic, value, _ in HOSTILE]
        messages.append((OTLP_SPANS_TOPIC, as_json(trace_request("after", salt=3))))
        asyncio.run(_produce(settings, messages))
        pipeline.wait_caught_up(until=until.counts(settings, {
            f"SELECT count() FROM $db.spans FINAL WHERE project = '{PROJECT}'": 4}))
        pipeline.check_alive()
        answers = {
            "spans": until.query(settings, f"SELECT run_id, count(), groupArray(kind) FROM $db.spans FINAL "
                                           f"WHERE project = '{PROJECT}' GROUP BY run_id ORDER BY run_id"),
            "hostile": until.query(settings, "SELECT count() FROM $db.spans WHERE run_id IN "
                                             "('deep', 'liar', 'short-id')"),
        }
        yield settings, answers
    finally:
        pipeline.stop()


def test_the_good_requests_land_whole(ran) -> None:
    _, answers = ran
    assert answers["spans"] == [("after", 2, ["LLM", "LLM"]), ("before", 2, ["LLM", "LLM"])]
    assert answers["hostile"] == [(0,)]


def test_each_hostile_request_is_one_dead_letter_with_its_reason(ran) -> None:
    settings, _ = ran
    letters = asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic(DLQ_TOPIC)))
    reasons = []
    for letter in letters:
        headers = {k: v.decode() for k, v in letter.headers}
        reasons.append((headers[SOURCE_TOPIC], headers[REASON]))
    assert len(reasons) == len(HOSTILE), reasons
    unmatched = list(reasons)
    for short, _, reason in HOSTILE:
        match = next((r for r in unmatched if r[0] == settings.topic(short) and reason in r[1]), None)
        assert match is not None, (short, reason, unmatched)
        unmatched.remove(match)


def test_the_ingest_counted_each_and_never_restarted(ran) -> None:
    settings, _ = ran
    log = (settings.home / "logs" / "otlp-ingest.log").read_text()
    assert log.count("dead-lettering") == len(HOSTILE)
    assert f"({len(HOSTILE)} so far)" in log
    assert log.count("reading ") == 1  # started once


def test_gzip_bodies_are_what_the_collector_may_send() -> None:
    """The 9 MiB request is refused on its size before any parse: the bound comes first."""
    from rlpulse.producers.otlp.decode import decode
    from rlpulse.producers.otlp.identity import OtlpRejected

    big = HOSTILE[0][1]
    assert len(gzip.compress(big)) < 1 << 20 < len(big)
    with pytest.raises(OtlpRejected, match="over the limit of"):
        decode("traces", big)
