"""MetricTranslator: OTLP metric export requests (built with opentelemetry-proto) -> rlpulse records."""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2 as pb
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from rlpulse.producers.otlp.identity import OtlpRejected, Out
from rlpulse.producers.otlp.metrics import MetricTranslator
from rlpulse.schemas.codec import Codec

pytestmark = pytest.mark.full

S = "akka.optimize.training."
SEC = 10**9
T0 = 1_700_000_000 * SEC
DELTA = pb.AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA
CUMULATIVE = pb.AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
REWARD_BOUNDS = [0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1, 2, 5]
DURATION_BOUNDS = [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]
RUN = {"service.name": "trainer", "service.instance.id": "i-1", S + "run.id": "r1", S + "project": "p1",
       S + "run.attempt": 1, S + "stage": "rl"}
CODEC = Codec()


def _any(v: Any) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    return AnyValue(string_value=v)


def kv(attrs: dict[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=k, value=_any(v)) for k, v in attrs.items()]


def request(*metrics: pb.Metric, resource: dict[str, Any] = RUN) -> ExportMetricsServiceRequest:
    return ExportMetricsServiceRequest(resource_metrics=[pb.ResourceMetrics(
        resource=Resource(attributes=kv(resource)), scope_metrics=[pb.ScopeMetrics(metrics=list(metrics))])])


def counter(name: str, value: float, t: int, start: int = T0, temporality: int = CUMULATIVE, **attrs: Any) -> pb.Metric:
    point = pb.NumberDataPoint(start_time_unix_nano=start, time_unix_nano=t, attributes=kv(_attrs(attrs)))
    if isinstance(value, int):
        point.as_int = value
    else:
        point.as_double = value
    return pb.Metric(name=S + name, sum=pb.Sum(data_points=[point], aggregation_temporality=temporality, is_monotonic=True))


def gauge(name: str, value: float, t: int, **attrs: Any) -> pb.Metric:
    point = pb.NumberDataPoint(time_unix_nano=t, attributes=kv(_attrs(attrs)))
    if isinstance(value, int):
        point.as_int = value
    else:
        point.as_double = value
    return pb.Metric(name=name if name.startswith("hw.") else S + name, gauge=pb.Gauge(data_points=[point]))


def _attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    names = {"term": S + "rl.term", "cause": S + "rl.grader.failure.cause", "token_type": "gen_ai.token.type",
             "hw_id": "hw.id"}
    return {names.get(k, S + k.replace("_", ".")): v for k, v in attrs.items()}


def hist(name: str, values: list[float], t: int, start: int = T0, temporality: int = CUMULATIVE,
         bounds: list[float] = REWARD_BOUNDS, **attrs: Any) -> pb.Metric:
    counts = [0] * (len(bounds) + 1)
    for v in values:
        counts[bisect_left(bounds, v)] += 1  # OTel's rule: bounds[i-1] < v <= bounds[i]
    point = pb.HistogramDataPoint(start_time_unix_nano=start, time_unix_nano=t, count=len(values), sum=sum(values),
                                  bucket_counts=counts, explicit_bounds=bounds, attributes=kv(_attrs(attrs)))
    if values:
        point.min, point.max = min(values), max(values)
    return pb.Metric(name=S + name, histogram=pb.Histogram(data_points=[point], aggregation_temporality=temporality))


def exp_index(v: float, scale: int) -> int:
    return math.ceil(math.log2(v) * 2**scale) - 1


def exp_point(values: list[float], scale: int) -> tuple[int, list[int], int]:
    idx = [exp_index(v, scale) for v in values if v > 0]
    if not idx:
        return 0, [], len(values)
    counts = [0] * (max(idx) - min(idx) + 1)
    for i in idx:
        counts[i - min(idx)] += 1
    return min(idx), counts, sum(1 for v in values if v == 0)


def exphist(values: list[float], t: int, scale: int = 3, start: int = T0, temporality: int = CUMULATIVE) -> pb.Metric:
    offset, counts, zeros = exp_point(values, scale)
    point = pb.ExponentialHistogramDataPoint(
        start_time_unix_nano=start, time_unix_nano=t, count=len(values), sum=sum(values), scale=scale, zero_count=zeros,
        positive=pb.ExponentialHistogramDataPoint.Buckets(offset=offset, bucket_counts=counts))
    if values:
        point.min, point.max = min(values), max(values)
    return pb.Metric(name=S + "rl.rollout.completion.length",
                     exponential_histogram=pb.ExponentialHistogram(data_points=[point], aggregation_temporality=temporality))


def checked(outs: list[Out]) -> list[Out]:
    """Every record is complete per its .avsc: the codec encodes it."""
    for o in outs:
        CODEC.encode(o.record_type, [o.record])
    return outs


def of(outs: list[Out], record_type: str) -> list[dict[str, Any]]:
    return [o.record for o in outs if o.record_type == record_type]


# -- a job's two steps, as the SDK would export them in either temporality ---------------------------
STEPS = [  # what each step observed
    {"count": 1, "total": [0.2, 0.30000000000000004, 0.5], "acc": [0.1, 0.2, 0.3], "lengths": [10.0, 20.0, 300.0],
     "durations": [0.2, 1.5], "timeout": 1, "unreadable": 1, "input": 100, "output": 20, "tokens": 1000},
    {"count": 1, "total": [0.0, 1.0, 0.35], "acc": [0.0, 0.5, 0.05], "lengths": [5.0, 1000.0],
     "durations": [0.1, 3.0], "timeout": 1, "unreadable": 2, "input": 50, "output": 10, "tokens": 2000},
]


def job_requests(temporality: int) -> list[ExportMetricsServiceRequest]:
    """One export per step (force_flush after each), cumulative: everything so far since T0; delta:
    this step's, starting at the previous export."""
    out, seen = [], {k: [] if isinstance(v, list) else 0 for k, v in STEPS[0].items()}
    for n, step in enumerate(STEPS, 1):
        t, start = T0 + n * 10 * SEC, T0 + (n - 1) * 10 * SEC
        for k, v in step.items():
            seen[k] = seen[k] + v
        cur = seen if temporality == CUMULATIVE else step
        start = T0 if temporality == CUMULATIVE else start
        out.append(request(
            counter("rl.step.count", cur["count"], t, start, temporality),
            gauge("rl.step.tokens", step["tokens"], t), gauge("rl.step.throughput", 500.0, t),
            gauge("rl.step.mfu", 0.4, t), gauge("rl.step.completion.clipped_ratio", 1 / 3, t),
            gauge("rl.step.reward.mean", sum(step["total"]) / 3, t), gauge("rl.step.reward.std", 0.1, t),
            gauge("rl.step.term.share.mean", 0.2, t, term="acc"),
            hist("rl.rollout.reward", cur["total"], t, start, temporality, term="total"),
            hist("rl.rollout.reward", cur["acc"], t, start, temporality, term="acc"),
            exphist(cur["lengths"], t, 3, start, temporality),
            hist("rl.grader.duration", cur["durations"], t, start, temporality, DURATION_BOUNDS, term="acc"),
            counter("rl.grader.failures", cur["timeout"], t, start, temporality, term="acc", cause="timeout"),
            counter("rl.grader.failures", cur["unreadable"], t, start, temporality, term="acc", cause="unreadable"),
            counter("rl.grader.tokens", cur["input"], t, start, temporality, term="acc", token_type="input"),
            counter("rl.grader.tokens", cur["output"], t, start, temporality, term="acc", token_type="output"),
        ))
    return out


def run_job(temporality: int) -> list[list[Out]]:
    tr = MetricTranslator()
    return [checked(tr.translate(r, T0 + 100 * SEC)) for r in job_requests(temporality)]


def test_cumulative_and_delta_give_identical_records() -> None:
    cumulative, delta = run_job(CUMULATIVE), run_job(DELTA)
    assert cumulative == delta
    first, second = cumulative
    steps = of(first, "Step") + of(second, "Step")
    assert [(s["type"], s["step"], s["step_count"], s["sequence_id"]) for s in steps] == [
        ("RUN_START", -1, 0, 1), ("STEP", 1, 1, 2), ("STEP", 2, 2, 3)]
    assert steps[1]["writer_id"] == "otlp/i-1" and steps[1]["trainer"] == "rl" and steps[1]["stage"] == "rl"
    assert (steps[1]["tokens"], steps[1]["throughput"], steps[1]["duration_s"], steps[1]["mfu"]) == (1000, 500.0, 2.0, 0.4)
    stats = of(second, "StepStats")[0]
    assert (stats["step"], stats["rollouts"], stats["clipped"], stats["reward_min"], stats["reward_max"]) == (2, 3, 1, 0.0, 1.0)
    assert (stats["completion_min"], stats["completion_max"], stats["complete"]) == (5, 1000, True)
    total = next(r for r in of(second, "RewardHistogram") if r["term"] == "total")
    assert total["bucket_counts"][0] == 1 and total["bucket_counts"][11] == 1 and total["bucket_counts"][4] == 1
    assert total["zero_fraction"] == pytest.approx(1 / 3)
    term = of(second, "StepTermStats")[0]
    assert (term["term"], term["rollouts"], term["graded"], term["failures"], term["failure_rate"]) == ("acc", 3, 2, 3, 1.5)
    assert (term["judge_input_tokens"], term["judge_output_tokens"], term["duration_max_s"]) == (50, 10, 3.0)
    assert (term["share_mean"], term["failure_cost"]) == (0.2, None)
    lengths = of(second, "CompletionLengthHistogram")[0]
    assert (lengths["count"], lengths["sum"], lengths["min"], lengths["max"]) == (2, 1005.0, 5.0, 1000.0)
    offset, counts, _ = exp_point([5.0, 1000.0], 3)
    assert (lengths["offset"], lengths["bucket_counts"]) == (offset, counts)
    window = of(second, "GraderWindow")[0]
    assert (window["window_start_ns"], window["window_end_ns"], window["graded"], window["failures"]) == (
        T0 + 10 * SEC, T0 + 20 * SEC, 2, 3)
    assert all(o.key == "p1/r1" for o in first + second)


def test_percentiles_interpolate_within_the_bucket() -> None:
    # 10 calls: 4 in (0.1, 0.25], 6 in (0.5, 1]; min 0.12, max 0.9 (a first sight: exact)
    values = [0.12, 0.2, 0.2, 0.2, 0.6, 0.7, 0.8, 0.9, 0.9, 0.9]
    outs = checked(MetricTranslator().translate(request(
        counter("rl.step.count", 1, T0 + SEC), hist("rl.grader.duration", values, T0 + SEC, bounds=DURATION_BOUNDS, term="j")),
        T0))
    term = of(outs, "StepTermStats")[0]
    # p50: rank 5 = the 1st of 6 in (0.5, 0.9] (upper edge clipped to max): 0.5 + 0.4 * 1/6
    assert term["duration_p50_s"] == pytest.approx(0.5 + 0.4 / 6)
    assert term["duration_p90_s"] == pytest.approx(0.5 + 0.4 * 5 / 6)
    assert term["duration_max_s"] == 0.9


def test_cumulative_min_max_unchanged_is_estimated_from_buckets() -> None:
    tr = MetricTranslator()
    tr.translate(request(counter("rl.step.count", 1, T0 + SEC),
                         hist("rl.rollout.reward", [0.05, 1.5], T0 + SEC, term="total")), T0)
    outs = tr.translate(request(counter("rl.step.count", 2, T0 + 2 * SEC),
                                hist("rl.rollout.reward", [0.05, 1.5, 0.55, 0.65], T0 + 2 * SEC, term="total")), T0)
    h = of(outs, "RewardHistogram")[0]
    # the cumulative min (0.05) and max (1.5) did not change: lowest bucket (0.5, 0.6] -> 0.5; highest (0.6, 0.7] -> 0.7
    assert (h["count"], h["min"], h["max"]) == (2, 0.5, 0.7)


def test_exponential_scale_change_downscales_the_previous_point() -> None:
    first, more = [3.0, 5.0, 7.0], [100.0, 6.0]
    tr = MetricTranslator()
    tr.translate(request(counter("rl.step.count", 1, T0 + SEC), exphist(first, T0 + SEC, scale=3)), T0)
    outs = checked(tr.translate(request(counter("rl.step.count", 2, T0 + 2 * SEC),
                                        exphist(first + more, T0 + 2 * SEC, scale=1)), T0))
    h = of(outs, "CompletionLengthHistogram")[0]
    offset, counts, _ = exp_point(more, 1)
    assert (h["scale"], h["offset"], h["bucket_counts"], h["count"], h["sum"]) == (1, offset, counts, 2, 106.0)
    # min unchanged (3): 6's bucket at scale 1 is (2^2.5, 2^3], its lower bound; max changed: exact
    assert (h["min"], h["max"]) == (pytest.approx(2**2.5), 100.0)


def test_counter_reset_starts_the_series_again() -> None:
    tr = MetricTranslator()
    fail = {"term": "acc", "cause": "timeout"}
    tr.translate(request(counter("rl.step.count", 5, T0 + SEC), counter("rl.grader.failures", 3, T0 + SEC, **fail)), T0)
    # the process restarted: a new start time, the counters from 0 again
    restart = T0 + 50 * SEC
    outs = checked(tr.translate(request(counter("rl.step.count", 1, T0 + 60 * SEC, restart),
                                        counter("rl.grader.failures", 1, T0 + 60 * SEC, restart, **fail)), T0))
    step = of(outs, "Step")[0]
    assert (step["type"], step["step"], step["step_count"]) == ("STEP", 1, 1)
    window = of(outs, "GraderFailureWindow")[0]
    assert (window["failures"], window["window_start_ns"], window["window_end_ns"]) == (1, restart, T0 + 60 * SEC)
    # a value that went down with the same start time also starts again
    outs = tr.translate(request(counter("rl.grader.failures", 0, T0 + 70 * SEC, restart, **fail),
                                counter("rl.step.count", 1, T0 + 70 * SEC, restart)), T0)
    assert of(outs, "GraderFailureWindow") == [] and of(outs, "Step")[0]["type"] == "HEARTBEAT"


def test_reward_buckets_exact_as_the_sdk_and_the_streams_place_them() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

    from rlpulse.streams.histograms import RewardHistogram

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], views=[View(
        instrument_name=S + "rl.rollout.reward", aggregation=ExplicitBucketHistogramAggregation(REWARD_BOUNDS))])
    values = [0.0, 1.0, 0.30000000000000004]
    h = provider.get_meter("t").create_histogram(S + "rl.rollout.reward")
    for v in values:
        h.record(v, {S + "rl.term": "total"})
    sdk_point = reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics[0].data.data_points[0]
    metric = hist("rl.rollout.reward", values, T0 + SEC, term="total")
    assert list(metric.histogram.data_points[0].bucket_counts) == list(sdk_point.bucket_counts)
    outs = checked(MetricTranslator().translate(request(counter("rl.step.count", 1, T0 + SEC), metric), T0))
    record = of(outs, "RewardHistogram")[0]
    streams = RewardHistogram()
    for v in values:
        streams.add(v)
    assert record["bucket_counts"] == list(streams.counts)
    assert record["bucket_counts"][0] == 1  # x <= 0
    assert record["bucket_counts"][REWARD_BOUNDS.index(1)] == 1  # (0.99, 1]
    assert record["bucket_counts"][REWARD_BOUNDS.index(0.4)] == 1  # (0.3, 0.4]
    assert (record["min"], record["max"], record["bounds"]) == (0.0, 1.0, [float(b) for b in REWARD_BOUNDS])
    provider.shutdown()


def test_failures_by_cause() -> None:
    tr = MetricTranslator()
    t1, t2 = T0 + 10 * SEC, T0 + 20 * SEC
    tr.translate(request(counter("rl.step.count", 1, t1), counter("rl.grader.failures", 2, t1, term="judge", cause="timeout"),
                         hist("rl.grader.duration", [1.0] * 5, t1, bounds=DURATION_BOUNDS, term="judge")), T0)
    outs = checked(tr.translate(request(
        counter("rl.step.count", 2, t2), counter("rl.grader.failures", 3, t2, term="judge", cause="timeout"),
        counter("rl.grader.failures", 4, t2, term="judge", cause="unreadable"),
        hist("rl.grader.duration", [1.0] * 15, t2, bounds=DURATION_BOUNDS, term="judge")), T0))
    by_cause = {r["cause"]: r for r in of(outs, "GraderFailureWindow")}
    assert {c: (r["failures"], r["graded"], r["window_start_ns"]) for c, r in by_cause.items()} == {
        "timeout": (1, 10, t1), "unreadable": (4, 10, T0)}  # unreadable seen first: its start time
    term = of(outs, "StepTermStats")[0]
    assert (term["graded"], term["failures"], term["failure_rate"]) == (10, 5, 0.5)


@pytest.mark.parametrize("bad, reason", [
    (counter("rl.grader.failures", float("nan"), T0 + 20 * SEC, term="a", cause="timeout"), "not a finite number"),
    (counter("rl.grader.failures", -1, T0 + 20 * SEC, term="a", cause="timeout"), "cannot be negative"),
    (pb.Metric(name=S + "rl.rollout.reward", histogram=pb.Histogram(aggregation_temporality=CUMULATIVE, data_points=[
        pb.HistogramDataPoint(count=1, bucket_counts=[1, 0], explicit_bounds=[0.0, 1.0])])), "must be bounds"),
    (pb.Metric(name=S + "rl.rollout.reward", histogram=pb.Histogram(aggregation_temporality=CUMULATIVE, data_points=[
        pb.HistogramDataPoint(count=3, bucket_counts=[1, 0, 1], explicit_bounds=[0.0, 1.0])])), "not the count"),
    (pb.Metric(name=S + "rl.rollout.completion.length", exponential_histogram=pb.ExponentialHistogram(
        aggregation_temporality=CUMULATIVE, data_points=[pb.ExponentialHistogramDataPoint(scale=21)])), "scale 21"),
    (gauge("rl.step.count", 3, T0 + 20 * SEC), "a gauge where"),
])
def test_a_rejected_request_leaves_the_state_unchanged(bad: pb.Metric, reason: str) -> None:
    good1, good2 = job_requests(CUMULATIVE)
    tr, clean = MetricTranslator(), MetricTranslator()
    tr.translate(good1, T0 + 100 * SEC)
    clean.translate(good1, T0 + 100 * SEC)
    broken = ExportMetricsServiceRequest()
    broken.CopyFrom(good2)
    broken.resource_metrics[0].scope_metrics[0].metrics.append(bad)
    with pytest.raises(OtlpRejected, match=reason):
        tr.translate(broken, T0 + 100 * SEC)
    assert tr.counts["rejected"] == 1
    assert tr.translate(good2, T0 + 100 * SEC) == clean.translate(good2, T0 + 100 * SEC)


def test_run_metrics_without_a_run_id_are_refused() -> None:
    with pytest.raises(OtlpRejected, match="no run id"):
        MetricTranslator().translate(request(counter("rl.step.count", 1, T0), resource={"service.name": "x"}), T0)


def test_figures_of_an_export_without_a_new_step_are_held_for_the_next_step() -> None:
    tr = MetricTranslator()
    tr.translate(request(counter("rl.step.count", 1, T0 + SEC), hist("rl.rollout.reward", [0.5], T0 + SEC, term="total")), T0)
    # a periodic export between steps: the count did not rise, two rollouts of step 2 already in
    outs = tr.translate(request(counter("rl.step.count", 1, T0 + 2 * SEC),
                                hist("rl.rollout.reward", [0.5, 0.1, 0.2], T0 + 2 * SEC, term="total")), T0)
    assert [s["type"] for s in of(outs, "Step")] == ["HEARTBEAT"] and of(outs, "RewardHistogram") == []
    outs = tr.translate(request(counter("rl.step.count", 2, T0 + 3 * SEC),
                                hist("rl.rollout.reward", [0.5, 0.1, 0.2, 0.9], T0 + 3 * SEC, term="total")), T0)
    record = of(outs, "RewardHistogram")[0]
    assert (record["step"], record["count"], record["sum"]) == (2, 3, pytest.approx(1.2))


def test_the_step_attribute_names_the_step() -> None:
    tr = MetricTranslator()
    outs = checked(tr.translate(request(hist("rl.rollout.reward", [0.5, 0.7], T0 + SEC, term="total", rl_step=7)), T0))
    assert [(r["step"], r["count"]) for r in of(outs, "RewardHistogram")] == [(7, 2)]
    assert [s["type"] for s in of(outs, "Step")] == ["RUN_START"]
    # exported again unchanged (a cumulative series lives on): nothing re-sent
    assert of(tr.translate(request(hist("rl.rollout.reward", [0.5, 0.7], T0 + 2 * SEC, term="total", rl_step=7)), T0),
              "RewardHistogram") == []


GPU = {"service.name": "node-agent", "host.name": "h1", "k8s.node.name": "n1", "k8s.pod.name": "pod-1"}


def test_gpu_sample_without_and_with_a_run() -> None:
    t = T0 + SEC
    ids = {"hw_id": "GPU-1", "gpu_index": 2}
    metrics = [gauge("hw.gpu.utilization", 0.85, t, **ids), gauge("hw.power", 300.5, t, **ids),
               gauge("hw.temperature", 70, t, **ids), gauge("hw.gpu.memory.usage", 40 * 2**30, t, **ids),
               gauge("hw.gpu.memory.limit", 80 * 2**30, t, **ids), gauge("gpu.clock.throttle_reasons", 0x48, t, **ids),
               gauge("gpu.xid.last", 79, t, **ids)]
    energy = pb.Metric(name="hw.energy", sum=pb.Sum(aggregation_temporality=CUMULATIVE, is_monotonic=True, data_points=[
        pb.NumberDataPoint(start_time_unix_nano=T0, time_unix_nano=t, as_double=12.5, attributes=kv(_attrs(ids)))]))
    outs = checked(MetricTranslator().translate(request(*metrics, energy, resource=GPU), T0))
    [out] = outs
    r = out.record
    assert (out.key, out.topic, r["project"], r["run_id"], r["attempt"], r["index"]) == ("GPU-1", "hardware", "", "", 0, 2)
    assert (r["gpu_utilization"], r["power_w"], r["temperature_c"], r["memory_utilization"]) == (0.85, 300.5, 70.0, 0.5)
    assert (r["energy_mj"], r["throttle_reason_names"], r["xid_last"], r["xid_class"]) == (
        12500, ["hw_slowdown", "hw_thermal"], 79, "hardware")
    assert (r["host"], r["node"], r["pod"]) == ("h1", "n1", "pod-1")
    outs = checked(MetricTranslator().translate(request(*metrics, resource={**GPU, **RUN}), T0))
    assert [(o.record["project"], o.record["run_id"], o.record["attempt"]) for o in outs if o.record_type == "GpuSample"] == [
        ("p1", "r1", 1)]


def test_placement_on_first_sight_then_at_most_once_a_minute() -> None:
    tr = MetricTranslator()
    place = {"job_rank": 3, "job_role": "actor", "hw_id": "GPU-9", "gpu_index": 1}
    got = []
    for now in (T0, T0 + 30 * SEC, T0 + 61 * SEC):
        got.append(of(checked(tr.translate(request(gauge("job.placement", 1, now, **place),
                                                   resource={**RUN, "k8s.pod.name": "w-3"}), now)), "Placement"))
    assert [len(g) for g in got] == [1, 0, 1]
    p = got[0][0]
    assert (p["run_id"], p["role"], p["rank"], p["hw_id"], p["index"], p["pod"], p["time_ns"]) == (
        "r1", "actor", 3, "GPU-9", 1, "w-3", T0)


def test_capacity_pool_and_project_rows() -> None:
    t = T0 + SEC
    pool = {"pool": "a100", "pool_serving": False, "pool_accelerator": "A100", "instance": "svc-0"}
    outs = checked(MetricTranslator().translate(request(
        gauge("pool.devices.declared", 8, t, **pool), gauge("pool.devices.observed", 8, t, **pool),
        gauge("pool.devices.claimed", 6, t, claim_state="GRANTED", **pool),
        gauge("pool.devices.claimed", 2, t, claim_state="QUEUED", **pool),
        gauge("pool.claims", 3, t, claim_state="GRANTED", **pool),
        gauge("project.devices.claimed", 4, t, project="proj", claim_state="GRANTED", pool="a100", instance="svc-0"),
        gauge("project.devices.quota", 6, t, project="proj", pool="a100", instance="svc-0"),
        resource={"service.name": "trainer-svc"}), T0))
    rows = {o.record["project"]: o for o in outs}
    assert all(o.key == "a100" and o.record_type == "CapacitySample" for o in outs)
    assert {k: v for k, v in rows[""].record.items() if v is not None} == {
        "pool": "a100", "serving": False, "accelerator": "A100", "project": "", "instance": "svc-0", "time_ns": t,
        "devices_declared": 8, "devices_observed": 8, "devices_granted": 6, "devices_queued": 2, "claims_granted": 3}
    proj = rows["proj"].record
    assert (proj["devices_granted"], proj["devices_queued"], proj["quota"], proj["devices_declared"]) == (4, None, 6, None)


def test_run_ended_gives_run_end_once() -> None:
    tr = MetricTranslator()
    tr.translate(job_requests(CUMULATIVE)[0], T0)
    end = request(counter("rl.step.count", 1, T0 + 30 * SEC), gauge("run.ended", 1, T0 + 30 * SEC, run_status="failed"))
    steps = of(checked(tr.translate(end, T0)), "Step")
    assert [(s["type"], s["status"], s["step_count"], s["sequence_id"]) for s in steps] == [
        ("HEARTBEAT", None, 1, 3), ("RUN_END", "failed", 1, 4)]
    assert [s["type"] for s in of(tr.translate(end, T0), "Step")] == ["HEARTBEAT"]


def test_unknown_metrics_are_ignored_and_counted() -> None:
    tr = MetricTranslator()
    outs = tr.translate(request(gauge("trainer.gpu.time", 1.0, T0), counter("rl.step.count", 1, T0 + SEC)), T0)
    assert [s["type"] for s in of(outs, "Step")] == ["RUN_START", "STEP"]
    assert tr.ignored == {S + "trainer.gpu.time": 1}


def test_series_cap_refuses_the_request_and_counts_it() -> None:
    tr = MetricTranslator(max_series=3)
    tr.translate(request(counter("rl.step.count", 1, T0 + SEC)), T0)
    many = request(*(gauge("rl.step.term.share.mean", 0.1, T0 + SEC, term=f"t{i}") for i in range(5)))
    with pytest.raises(OtlpRejected, match="more than 3 series"):
        tr.translate(many, T0)
    assert (tr.counts["series_cap"], tr.series_count) == (1, 1)
    # an hour later the old series are forgotten
    tr.translate(request(gauge("rl.step.term.share.mean", 0.1, T0 + SEC, term="a")), T0 + 3601 * SEC)
    tr.translate(request(gauge("rl.step.term.share.mean", 0.1, T0 + SEC, term="b")), T0 + 3700 * SEC)
    assert tr.series_count == 2
