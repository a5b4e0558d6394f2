"""A reinforcement training job instrumented as seed 001 describes, through the real OpenTelemetry
SDK and its OTLP/HTTP exporters, and nothing of rlpulse: what a user's job sends a Collector (or
``rlpulse otlp``). Runs in ``.venv-otel`` (tests/otel_clients/otel_venv.py).

    python seed001_job.py --endpoint http://127.0.0.1:4318 --run-id r1 --attempt 1 --steps 2 \
        --rollouts 8 --temporality cumulative --seed 1

Per step it scores ``--rollouts`` rollouts with two terms, ``judge`` and ``format``, whose shares add
up to the reward, records every instrument of the contract (docs: /work/notes/otlp-contract.md) with
seed 001's names, ends the step's root span (one child span per rollout), and calls
``force_flush()`` on both providers: one metrics export and one traces export per step (the metric
reader's interval is infinite, so nothing else exports). After the last step it sets
``akka.optimize.training.run.ended`` to 1, flushes once more and shuts down.

It prints ONE JSON line, the truth computed from the job's own values: per step, the reward
histogram per term (bucket counts by OTel's rule, x <= bound, the first bucket x <= 0; count, sum,
min, max), the grader figures per term, the completion-length histogram's count, sum, min, max and
zero count, every gauge, the GPU's and pools' values; the span ids; and what the exporters sent
(requests, the ``rl.step.count`` points in order, spans), counted in the exporters themselves.
Everything but timestamps is a function of ``--seed`` and ``--run-id`` (span ids included).

Grader duration buckets (s), chosen here: 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60 (a judge call
takes 0.05-3 s; a timeout is recorded at the judge's 30 s limit).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import statistics
import sys
from typing import Any

from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider, ObservableCounter, ObservableUpDownCounter, UpDownCounter
from opentelemetry.sdk.metrics.export import AggregationTemporality, MetricExportResult, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, ExponentialBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator

P = "akka.optimize.training."
REWARD_BOUNDS = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0, 2.0, 5.0]
GRADER_BOUNDS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0]
TERMS = ("judge", "format")
MAX_LEN = 512  # completion tokens; a completion of MAX_LEN was clipped
PROMPT_LEN = 100
JUDGE_TIMEOUT_S = 30.0
HW_ID = "GPU-5eed0001-0000-4000-8000-00000000a100"  # a fixed fake NVML UUID
GIB = 1 << 30
POOL = {P + "pool": "a100-pool", P + "pool.serving": False, P + "pool.accelerator": "a100", P + "instance": "trainer-0"}
# Judge failures by rollout index (the format term fails on ungradable rows only).
JUDGE_FAILS = {3: "timeout", 4: "unavailable", 5: "unreadable"}
FORMAT_FAILS = {6: "ungradable"}


class SeededIds(IdGenerator):
    """Trace and span ids from the job's own seeded generator: the same seed gives the same ids."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def generate_span_id(self) -> int:
        return self.rng.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        return self.rng.getrandbits(128) or 1


class CountingMetricExporter(OTLPMetricExporter):
    """The OTLP/HTTP exporter, counting what it sends: requests and the step counter's points."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.requests, self.failed, self.step_count_points = 0, 0, []

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        for rm in metrics_data.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name == P + "rl.step.count":
                        self.step_count_points += [int(p.value) for p in metric.data.data_points]
        result = super().export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        self.requests += 1
        self.failed += result is not MetricExportResult.SUCCESS
        return result


class CountingSpanExporter(OTLPSpanExporter):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.requests, self.failed, self.spans = 0, 0, 0

    def export(self, spans: Any) -> SpanExportResult:
        result = super().export(spans)
        self.requests += 1
        self.spans += len(spans)
        self.failed += result is not SpanExportResult.SUCCESS
        return result


def bucket_counts(values: list[float], bounds: list[float]) -> list[int]:
    """OTel's explicit-bucket rule: bucket i holds bounds[i-1] < x <= bounds[i]; the last, x > bounds[-1]."""
    counts = [0] * (len(bounds) + 1)
    for x in values:
        counts[bisect.bisect_left(bounds, x)] += 1
    return counts


def summary(values: list[float], bounds: list[float]) -> dict[str, Any]:
    return {"bucket_counts": bucket_counts(values, bounds), "count": len(values), "sum": sum(values),
            "min": min(values), "max": max(values)}


def rollout(rng: random.Random, i: int) -> dict[str, Any]:
    """One rollout's scores and completion, with the edges a histogram must bucket right."""
    judge_fail, format_fail = JUDGE_FAILS.get(i), FORMAT_FAILS.get(i)
    if i == 0:
        judge, fmt, length = 0.0, 0.0, 0  # an empty completion: reward exactly 0
    elif i == 1:
        judge, fmt, length = 0.5, 0.5, rng.randint(50, 400)  # exactly 1.0
    elif i == 2:
        judge, fmt, length = 0.1, 0.2, rng.randint(50, 400)  # 0.30000000000000004: above the 0.3 bound
    elif i == 7:
        judge, fmt, length = 1.0, 0.5, MAX_LEN  # weights are not normalized: 1.5; clipped
    else:
        judge, fmt = round(rng.uniform(0.0, 0.8), 3), rng.choice((0.0, 0.2))
        length = MAX_LEN if i % 4 == 3 else rng.randint(1, MAX_LEN - 1)
    judge = 0.0 if judge_fail else judge  # a failed score counts as zero for its term
    fmt = 0.0 if format_fail else fmt
    durations = {"judge": JUDGE_TIMEOUT_S if judge_fail == "timeout" else round(rng.uniform(0.05, 3.0), 3),
                 "format": round(rng.uniform(0.001, 0.04), 4)}
    answered = judge_fail not in ("timeout", "unavailable")  # the judge replied (maybe with no verdict)
    tokens = (PROMPT_LEN + 200 + length, rng.randint(5, 50)) if answered else (0, 0)
    return {"shares": {"judge": judge, "format": fmt}, "reward": judge + fmt, "length": length,
            "failures": {"judge": judge_fail, "format": format_fail}, "durations": durations, "judge_tokens": tokens}


def build(args: argparse.Namespace, rng: random.Random) -> tuple[Any, ...]:
    instance = f"seed001-{args.run_id}-{args.attempt}"  # fixed per job: the SDK's default is random per process
    resource = Resource.create({
        "service.name": "seed001-job", "service.instance.id": instance, "host.name": "node-a",
        P + "run.id": args.run_id, P + "run.attempt": args.attempt, P + "project": args.project,
    })
    temporality = (AggregationTemporality.DELTA if args.temporality == "delta" else AggregationTemporality.CUMULATIVE)
    preferred = {Counter: temporality, Histogram: temporality, ObservableCounter: temporality,
                 # up-down sums stay cumulative under a delta preference, as the OTLP exporter's own does
                 UpDownCounter: AggregationTemporality.CUMULATIVE, ObservableUpDownCounter: AggregationTemporality.CUMULATIVE}
    endpoint = args.endpoint.rstrip("/")
    metric_exporter = CountingMetricExporter(endpoint=f"{endpoint}/v1/metrics", preferred_temporality=preferred)
    # An infinite interval: no export thread; the job exports when it calls force_flush().
    reader = PeriodicExportingMetricReader(metric_exporter, export_interval_millis=float("inf"))
    views = [
        View(instrument_name=P + "rl.rollout.reward", aggregation=ExplicitBucketHistogramAggregation(REWARD_BOUNDS)),
        View(instrument_name=P + "rl.rollout.completion.length", aggregation=ExponentialBucketHistogramAggregation()),
        View(instrument_name=P + "rl.grader.duration", aggregation=ExplicitBucketHistogramAggregation(GRADER_BOUNDS)),
    ]
    meters = MeterProvider(resource=resource, metric_readers=[reader], views=views)
    span_exporter = CountingSpanExporter(endpoint=f"{endpoint}/v1/traces")
    tracers = TracerProvider(resource=resource, id_generator=SeededIds(random.Random(f"{args.seed}/{args.run_id}/ids")))
    tracers.add_span_processor(BatchSpanProcessor(span_exporter, schedule_delay_millis=3_600_000))
    return resource, meters, tracers, metric_exporter, span_exporter


def instruments(meter: Any) -> dict[str, Any]:
    g, c, h = meter.create_gauge, meter.create_counter, meter.create_histogram
    names = {
        "step_count": c(P + "rl.step.count", unit="{step}"), "tokens": g(P + "rl.step.tokens", unit="{token}"),
        "throughput": g(P + "rl.step.throughput", unit="{token}/s"), "mfu": g(P + "rl.step.mfu", unit="1"),
        "ended": g(P + "run.ended", unit="1"), "clipped_ratio": g(P + "rl.step.completion.clipped_ratio", unit="1"),
        "reward_mean": g(P + "rl.step.reward.mean"), "reward_std": g(P + "rl.step.reward.std"),
        "reward_zero_fraction": g(P + "rl.step.reward.zero_fraction", unit="1"),
        "share_mean": g(P + "rl.step.term.share.mean"), "share_std": g(P + "rl.step.term.share.std"),
        "completion_mean": g(P + "rl.step.completion.length.mean", unit="{token}"),
        "completion_min": g(P + "rl.step.completion.length.min", unit="{token}"),
        "completion_max": g(P + "rl.step.completion.length.max", unit="{token}"),
        "reward": h(P + "rl.rollout.reward"), "length": h(P + "rl.rollout.completion.length", unit="{token}"),
        "grader_duration": h(P + "rl.grader.duration", unit="s"),
        "grader_failures": c(P + "rl.grader.failures", unit="{failure}"),
        "grader_tokens": c(P + "rl.grader.tokens", unit="{token}"), "placement": g(P + "job.placement", unit="1"),
        "hw.power": g("hw.power", unit="W"), "hw.temperature": g("hw.temperature", unit="Cel"),
        "hw.gpu.utilization": g("hw.gpu.utilization", unit="1"), "hw.gpu.memory.usage": g("hw.gpu.memory.usage", unit="By"),
        "hw.gpu.memory.limit": g("hw.gpu.memory.limit", unit="By"),
        "hw.gpu.memory.utilization": g("hw.gpu.memory.utilization", unit="1"), "hw.energy": c("hw.energy", unit="J"),
        "gpu.memory.activity": g(P + "gpu.memory.activity", unit="1"), "gpu.clock.sm": g(P + "gpu.clock.sm", unit="MHz"),
        "gpu.clock.throttle_reasons": g(P + "gpu.clock.throttle_reasons", unit="1"),
        "gpu.xid.errors": c(P + "gpu.xid.errors", unit="{error}"), "gpu.xid.last": g(P + "gpu.xid.last", unit="1"),
    }
    for name in ("pool.devices.declared", "pool.devices.observed", "pool.devices.claimed", "pool.claims",
                 "project.devices.claimed", "project.devices.quota"):
        names[name] = g(P + name, unit="{device}" if "devices" in name else "{claim}")
    return names


def pools(m: dict[str, Any], project: str) -> dict[str, Any]:
    """The trainer service's capacity gauges, fixed values (what the job-side test expects back)."""
    figures = {"declared": 8, "observed": 8, "devices_claimed": {"GRANTED": 4, "QUEUED": 2},
               "claims": {"GRANTED": 1, "QUEUED": 1}, "project_claimed": {"GRANTED": 4, "QUEUED": 2}, "project_quota": 8}
    m["pool.devices.declared"].set(figures["declared"], POOL)
    m["pool.devices.observed"].set(figures["observed"], POOL)
    for state in ("GRANTED", "QUEUED"):
        m["pool.devices.claimed"].set(figures["devices_claimed"][state], {**POOL, P + "claim.state": state})
        m["pool.claims"].set(figures["claims"][state], {**POOL, P + "claim.state": state})
        m["project.devices.claimed"].set(figures["project_claimed"][state],
                                         {P + "project": project, P + "claim.state": state, P + "instance": "trainer-0"})
    m["project.devices.quota"].set(figures["project_quota"], {P + "project": project, P + "instance": "trainer-0"})
    return figures


def gpu(m: dict[str, Any], rng: random.Random, step: int, duration_s: float) -> dict[str, Any]:
    usage = rng.randint(20, 70) * GIB
    values: dict[str, Any] = {
        "hw.power": round(rng.uniform(200, 400), 1), "hw.temperature": rng.randint(50, 80),
        "hw.gpu.utilization": round(rng.uniform(0.5, 1.0), 3), "hw.gpu.memory.usage": usage,
        "hw.gpu.memory.limit": 80 * GIB, "hw.gpu.memory.utilization": usage / (80 * GIB),
        "gpu.memory.activity": round(rng.uniform(0.1, 0.9), 3), "gpu.clock.sm": rng.randint(1400, 1980),
        "gpu.clock.throttle_reasons": 1 if step % 2 else 1 | 8, "gpu.xid.last": 0,
    }
    attrs = {"hw.id": HW_ID, P + "gpu.index": 0}
    for name, value in values.items():
        m[name].set(value, attrs)
    energy = round(values["hw.power"] * duration_s, 1)
    m["hw.energy"].add(energy, attrs)
    m["gpu.xid.errors"].add(0, attrs)  # published from zero, so increase() sees the first XID
    return {**values, "hw.id": HW_ID, "energy_added_j": energy, "xid_errors_added": 0}


def step(n: int, args: argparse.Namespace, rng: random.Random, m: dict[str, Any], tracer: Any) -> dict[str, Any]:
    rolls = [rollout(rng, i) for i in range(args.rollouts)]
    rewards, lengths = [r["reward"] for r in rolls], [r["length"] for r in rolls]
    spans: dict[str, Any] = {"step": n, "rollouts": []}
    with tracer.start_as_current_span("rl.step", attributes={P + "rl.step": n}) as root:
        for i, r in enumerate(rolls):
            rollout_id = f"s{n}-r{i}"
            with tracer.start_as_current_span("rollout", attributes={
                    P + "rl.step": n, P + "rl.rollout.id": rollout_id, "gen_ai.operation.name": "chat",
                    "gen_ai.request.model": "policy-model", "gen_ai.usage.input_tokens": PROMPT_LEN,
                    "gen_ai.usage.output_tokens": r["length"]}) as child:
                spans["rollouts"].append({"rollout_id": rollout_id, "span_id": f"{child.get_span_context().span_id:016x}"})
            m["reward"].record(r["reward"], {P + "rl.term": "total"})
            for term in TERMS:
                m["reward"].record(r["shares"][term], {P + "rl.term": term})
                m["grader_duration"].record(r["durations"][term], {P + "rl.term": term})
                if r["failures"][term]:
                    m["grader_failures"].add(1, {P + "rl.term": term, P + "rl.grader.failure.cause": r["failures"][term]})
            if r["judge_tokens"] != (0, 0):
                m["grader_tokens"].add(r["judge_tokens"][0], {P + "rl.term": "judge", "gen_ai.token.type": "input"})
                m["grader_tokens"].add(r["judge_tokens"][1], {P + "rl.term": "judge", "gen_ai.token.type": "output"})
            m["length"].record(r["length"])
        ctx = root.get_span_context()
        spans.update(trace_id=f"{ctx.trace_id:032x}", span_id=f"{ctx.span_id:016x}")
    tokens = sum(lengths) + PROMPT_LEN * len(rolls)
    duration_s = round(rng.uniform(10.0, 20.0), 2)
    clipped = sum(x == MAX_LEN for x in lengths)
    gauges: dict[str, Any] = {
        "tokens": tokens, "throughput": tokens / duration_s, "mfu": round(rng.uniform(0.2, 0.5), 4),
        "clipped_ratio": clipped / len(rolls), "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards), "reward_zero_fraction": sum(x == 0 for x in rewards) / len(rolls),
        "completion_mean": statistics.fmean(lengths), "completion_min": min(lengths), "completion_max": max(lengths),
    }
    for name, value in gauges.items():
        m[name].set(value)
    shares: dict[str, Any] = {}
    for term in TERMS:
        values = [r["shares"][term] for r in rolls]
        shares[term] = {"mean": statistics.fmean(values), "std": statistics.pstdev(values)}
        m["share_mean"].set(shares[term]["mean"], {P + "rl.term": term})
        m["share_std"].set(shares[term]["std"], {P + "rl.term": term})
    graders: dict[str, Any] = {}
    for term in TERMS:
        durations = [r["durations"][term] for r in rolls]
        causes = [r["failures"][term] for r in rolls if r["failures"][term]]
        graders[term] = {"graded": len(rolls), "failures": {c: causes.count(c) for c in sorted(set(causes))},
                         "duration": summary(durations, GRADER_BOUNDS),
                         "input_tokens": sum(r["judge_tokens"][0] for r in rolls) if term == "judge" else 0,
                         "output_tokens": sum(r["judge_tokens"][1] for r in rolls) if term == "judge" else 0}
    m["placement"].set(1, {P + "job.rank": 0, P + "job.role": "trainer", "k8s.pod.name": "seed001-pod-0",
                           "k8s.node.name": "node-a", "hw.id": HW_ID})
    m["step_count"].add(1)
    return {
        "step": n, "rollouts": len(rolls), "clipped": clipped, "duration_s": duration_s, "gauges": gauges,
        "term_shares": shares, "graders": graders,
        "reward": {"total": summary(rewards, REWARD_BOUNDS),
                   **{t: summary([r["shares"][t] for r in rolls], REWARD_BOUNDS) for t in TERMS}},
        "length": {"count": len(lengths), "sum": sum(lengths), "min": min(lengths), "max": max(lengths),
                   "zero_count": sum(x == 0 for x in lengths)},
        "gpu": gpu(m, rng, n, duration_s), "pools": pools(m, args.project), "spans": spans,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"),
                        help="the OTLP/HTTP base URL (/v1/traces and /v1/metrics are added)")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--attempt", type=int, default=1)
    parser.add_argument("--project", default="seed001")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--temporality", choices=("cumulative", "delta"), default="cumulative")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.rollouts < 1 or args.steps < 1:
        parser.error("--steps and --rollouts must be at least 1")
    rng = random.Random(f"{args.seed}/{args.run_id}")
    resource, meters, tracers, metric_exporter, span_exporter = build(args, rng)
    m = instruments(meters.get_meter("seed001-job"))
    tracer = tracers.get_tracer("seed001-job")
    steps = []
    for n in range(1, args.steps + 1):
        steps.append(step(n, args, rng, m, tracer))
        # one export per step: everything in it belongs to this step (the contract's rule)
        tracers.force_flush()
        meters.force_flush()
    m["ended"].set(1)
    meters.force_flush()
    tracers.shutdown()
    meters.shutdown()
    failed = metric_exporter.failed + span_exporter.failed
    print(json.dumps({
        "run_id": args.run_id, "attempt": args.attempt, "project": args.project, "temporality": args.temporality,
        "seed": args.seed, "service_instance_id": resource.attributes["service.instance.id"], "hw_id": HW_ID,
        "max_len": MAX_LEN, "reward_bounds": REWARD_BOUNDS, "grader_bounds": GRADER_BOUNDS, "steps": steps,
        "exported": {"metric_requests": metric_exporter.requests, "step_count_points": metric_exporter.step_count_points,
                     "span_requests": span_exporter.requests, "spans": span_exporter.spans, "failed": failed},
    }))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
