"""The real OpenTelemetry Collector, built from ``deploy/otelcol/builder.yaml`` and run on
``deploy/otelcol/otelcol.yaml`` as a user deploys it, between a job instrumented as seed 001 says
(the real OpenTelemetry SDK, OTLP/HTTP; tests/otel_clients/seed001_job.py) and the shared broker.

What a user checks before pointing ``rlpulse otlp-ingest`` at it: the records on
``<prefix>.otlp-spans`` and ``<prefix>.otlp-metrics`` are whole OTLP export requests that
opentelemetry-proto's own classes parse, in both encodings the config offers (``otlp_json`` after
turning its hex trace and span ids into the base64 protobuf's JSON mapping expects), and they
hold exactly what the job sent: every span with its ids, one record per step's trace keyed by the
trace id, and the step counter's points in the order the job exported them.

The Collector build takes about 90 s cold (cached outside the clone afterwards, tests/otelcol.py);
it needs ``go``: without it the test skips, and fails under ``CI=true``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from rlpulse.base.settings import Settings
from rlpulse.schemas.catalogue import OTLP_METRICS_TOPIC, OTLP_SPANS_TOPIC
from rlpulse.schemas.topics import ensure_topics, read_topic
from tests import otelcol
from tests.conftest import unavailable
from tests.otel_clients import otel_venv

pytestmark = pytest.mark.full

P = "akka.optimize.training."
STEPS, ROLLOUTS = 2, 8
ID_KEYS = ("traceId", "spanId", "parentSpanId")  # hex in the exporter's JSON, base64 in protobuf's mapping


@pytest.fixture(scope="module")
def collector() -> Path:
    if not otelcol.binary_path().exists() and shutil.which("go") is None:
        unavailable("`go` is not on PATH: building the OpenTelemetry Collector needs Go 1.26 (go.dev/dl)")
    return otelcol.ensure(log=lambda line: print(line, file=sys.stderr))


@pytest.fixture(scope="module")
def otel_python() -> Path:
    return otel_venv.ensure(log=lambda line: print(line, file=sys.stderr))


def _hex_ids_to_base64(node: Any) -> Any:
    """The Collector's otlp_json writes ids as hex; protobuf's JSON parser would read them as base64,
    silently giving other bytes (interop.md)."""
    if isinstance(node, dict):
        return {k: (base64.b64encode(bytes.fromhex(v)).decode() if k in ID_KEYS and isinstance(v, str) else _hex_ids_to_base64(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_hex_ids_to_base64(x) for x in node]
    return node


def _parse(value: bytes, encoding: str, message: Any) -> Any:
    if encoding == "otlp_proto":
        return message.FromString(value)
    return json_format.ParseDict(_hex_ids_to_base64(json.loads(value)), message)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in kvs}


def _run_through_collector(collector: Path, otel_python: Path, settings: Settings, encoding: str, temporality: str,
                           tmp_path: Path) -> dict[str, Any]:
    """The job's truth, after the job ran against the Collector and the Collector stopped (a stop
    drains its sending queue into Kafka, so everything it accepted is on the topics)."""
    http_port, grpc_port = otelcol.free_port(), otelcol.free_port()
    log = tmp_path / f"otelcol-{encoding}.log"
    process = otelcol.start(otelcol.CONFIG, {
        "OTLP_HTTP_ENDPOINT": f"127.0.0.1:{http_port}", "OTLP_GRPC_ENDPOINT": f"127.0.0.1:{grpc_port}",
        "RLPULSE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap, "RLPULSE_TOPIC_PREFIX": settings.topic_prefix,
        "OTLP_KAFKA_ENCODING": encoding}, binary=collector, log_path=log)
    try:
        otelcol.wait_ready(http_port, process, log_path=log)
        job = subprocess.run([str(otel_python), str(otel_venv.SEED001_JOB), "--endpoint", f"http://127.0.0.1:{http_port}",
                              "--run-id", f"run-{encoding}", "--attempt", "1", "--steps", str(STEPS),
                              "--rollouts", str(ROLLOUTS), "--temporality", temporality, "--seed", "7"],
                             capture_output=True, text=True, timeout=120)
    finally:
        code = otelcol.stop(process)
    assert job.returncode == 0, f"the job failed:\n{job.stderr[-3000:]}"
    assert code == 0, f"the Collector exited {code}:\n{log.read_text()[-3000:]}"
    return json.loads(job.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("encoding", "temporality"), [("otlp_proto", "cumulative"), ("otlp_json", "delta")])
def test_collector_writes_what_the_job_sent(collector: Path, otel_python: Path, settings: Settings, encoding: str,
                                            temporality: str, tmp_path: Path) -> None:
    ensure_topics(settings)
    truth = _run_through_collector(collector, otel_python, settings, encoding, temporality, tmp_path)
    kafka = settings.kafka_client_kwargs()
    span_records = asyncio.run(read_topic(kafka, settings.topic(OTLP_SPANS_TOPIC)))
    metric_records = asyncio.run(read_topic(kafka, settings.topic(OTLP_METRICS_TOPIC)))

    # What the job's exporters say they sent: one traces and one metrics export per step, one more
    # metrics export for run.ended; every span; the counter's points (cumulative repeats the total).
    sent = truth["exported"]
    assert sent["failed"] == 0
    assert sent["span_requests"] == STEPS and sent["spans"] == STEPS * (ROLLOUTS + 1)
    assert sent["metric_requests"] == STEPS + 1
    assert sent["step_count_points"] == ([1, 2, 2] if temporality == "cumulative" else [1, 1])

    # Spans: one record per step (a step is one trace), keyed by its trace id as hex text.
    steps_by_trace = {s["spans"]["trace_id"]: s for s in truth["steps"]}
    assert sorted(r.key.decode() for r in span_records) == sorted(steps_by_trace)
    got_spans: dict[str, dict[str, Any]] = {}
    for record in span_records:
        request = _parse(record.value, encoding, ExportTraceServiceRequest())
        for rs in request.resource_spans:
            resource = _attrs(rs.resource.attributes)
            assert resource[P + "run.id"] == truth["run_id"]
            assert resource["service.instance.id"] == truth["service_instance_id"]
            for span in (s for ss in rs.scope_spans for s in ss.spans):
                assert span.trace_id.hex() == record.key.decode()
                got_spans[span.span_id.hex()] = {"trace": span.trace_id.hex(), "parent": span.parent_span_id.hex(),
                                                 "name": span.name, "attrs": _attrs(span.attributes)}
    assert len(got_spans) == sent["spans"]
    for trace_id, step in steps_by_trace.items():
        root = got_spans[step["spans"]["span_id"]]
        assert (root["trace"], root["parent"], root["name"]) == (trace_id, "", "rl.step")
        for rollout in step["spans"]["rollouts"]:
            child = got_spans[rollout["span_id"]]
            assert (child["trace"], child["parent"], child["name"]) == (trace_id, step["spans"]["span_id"], "rollout")
            assert child["attrs"][P + "rl.rollout.id"] == rollout["rollout_id"]
            assert child["attrs"]["gen_ai.operation.name"] == "chat"

    # Metrics: one record per export (one resource each), in the job's order on one partition.
    requests = [_parse(r.value, encoding, ExportMetricsServiceRequest())
                for r in sorted(metric_records, key=lambda r: (r.partition, r.offset))]
    assert len(requests) == sent["metric_requests"]
    assert len({r.partition for r in metric_records}) == 1 and len({r.key for r in metric_records}) == 1
    counts, rewards = [], []
    for request in requests:
        (rm,) = request.resource_metrics
        assert _attrs(rm.resource.attributes)[P + "run.id"] == truth["run_id"]
        for metric in (m for sm in rm.scope_metrics for m in sm.metrics):
            if metric.name == P + "rl.step.count":
                counts += [p.as_int for p in metric.sum.data_points]
                assert metric.sum.is_monotonic
                assert metric.sum.aggregation_temporality == (2 if temporality == "cumulative" else 1)
            if metric.name == P + "rl.rollout.reward":
                rewards += [list(p.bucket_counts) for p in metric.histogram.data_points
                            if _attrs(p.attributes)[P + "rl.term"] == "total"]
    assert counts == sent["step_count_points"]
    # The reward histogram's buckets, exactly the job's (cumulative: the running total per export).
    per_step = [s["reward"]["total"]["bucket_counts"] for s in truth["steps"]]
    if temporality == "cumulative":
        per_step = [[sum(col) for col in zip(*per_step[:i + 1], strict=True)] for i in range(STEPS)] + [
            [sum(col) for col in zip(*per_step, strict=True)]]
    assert rewards == per_step
