"""Review of issue 31's OTLP ingest: each test is a hostile or edge input that broke a bound, the
all-or-nothing rule or the numbering before its fix."""

from __future__ import annotations

import time
from typing import Any

import pytest
from google.protobuf.internal.encoder import _VarintBytes
from opentelemetry.proto.metrics.v1 import metrics_pb2 as pb

from rlpulse.base.settings import Settings
from rlpulse.producers.otlp import receiver as receiver_module
from rlpulse.producers.otlp.decode import OtlpLimits, decode
from rlpulse.producers.otlp.identity import OtlpRejected, Out
from rlpulse.producers.otlp.ingest import Translator, containers, number
from rlpulse.producers.otlp.metrics import MetricTranslator
from rlpulse.schemas.catalogue import OTLP_SPANS_TOPIC
from tests.unit.producers.otlp.test_metrics import (CODEC, CUMULATIVE, DELTA, RUN, S, SEC, T0, checked, counter, gauge,
                                                    kv, of, request)
from tests.unit.producers.otlp.test_spans import request as span_request
from tests.unit.producers.otlp.test_spans import span

pytestmark = pytest.mark.full

LENGTH = S + "rl.rollout.completion.length"


def _field(number_: int, payload: bytes) -> bytes:
    return bytes([number_ << 3 | 2]) + _VarintBytes(len(payload)) + payload


# -- bounds ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("signal", ["metrics", "traces"])
def test_a_million_empty_scopes_are_refused_by_count_not_read_for_seconds(signal: str) -> None:
    # 1 resource, 1,000,000 empty scopes: 2 MB, within max_bytes; each scope cost ~2.7 µs to translate (9 s a message)
    resource = pb.ResourceMetrics(resource=request().resource_metrics[0].resource).SerializeToString()
    body = _field(1, resource + b"\x12\x00" * 1_000_000)
    started = time.monotonic()
    with pytest.raises(OtlpRejected, match="more than 10000 scopes"):
        decode(signal, body)
    assert time.monotonic() - started < 2.0


def test_a_million_empty_metrics_are_refused_by_count() -> None:
    body = _field(1, _field(2, b"\x12\x00" * 1_000_000))  # one scope holding 1,000,000 metrics without data
    with pytest.raises(OtlpRejected, match="more than 50000 metrics"):
        decode("metrics", body, OtlpLimits())


def _exp_point(offset: int, count: int, t: int, scale: int = 0, **attrs: Any) -> pb.ExponentialHistogramDataPoint:
    return pb.ExponentialHistogramDataPoint(
        start_time_unix_nano=T0, time_unix_nano=t, count=count, sum=float(count), scale=scale,
        positive=pb.ExponentialHistogramDataPoint.Buckets(offset=offset, bucket_counts=[count]),
        attributes=kv({S + k: v for k, v in attrs.items()}))


def _lengths(temporality: int, *points: pb.ExponentialHistogramDataPoint) -> pb.Metric:
    return pb.Metric(name=LENGTH, exponential_histogram=pb.ExponentialHistogram(
        data_points=list(points), aggregation_temporality=temporality))


def test_two_length_series_far_apart_are_downscaled_not_spread_over_every_bucket_between() -> None:
    # two series of one step at scale 10, offsets 0 and 100,000: the record held 100,001 dense buckets
    # (at scale 20, offsets 0 and 2^29 asked for a 2^29-long list: MemoryError / the OOM killer)
    req = request(counter("rl.step.count", 1, T0 + SEC), _lengths(
        DELTA, _exp_point(0, 1, T0 + SEC, scale=10, x="a"), _exp_point(100_000, 2, T0 + SEC, scale=10, x="b")))
    h = of(checked(MetricTranslator().translate(req, T0 + SEC)), "CompletionLengthHistogram")[0]
    assert len(h["bucket_counts"]) <= 512 and sum(h["bucket_counts"]) == h["count"] == 3
    assert (h["scale"], h["offset"], len(h["bucket_counts"]), h["bucket_counts"][-1]) == (2, 0, 391, 2)  # 100000 >> 8


def test_a_bucket_offset_beyond_any_double_is_refused() -> None:
    req = request(counter("rl.step.count", 1, T0 + SEC), _lengths(DELTA, _exp_point(2**31 - 600, 1, T0 + SEC)))
    with pytest.raises(OtlpRejected, match="offset 2147483048 out of range"):
        MetricTranslator().translate(req, T0 + SEC)


def test_a_cumulative_length_series_at_the_top_of_the_double_range_is_differenced() -> None:
    # scale 20, offset 2^30-1000: the bucket edges' base ** i overflowed (OverflowError, not a rejection:
    # the receiver's handler thread died without an answer)
    offset = 2**30 - 1  # its upper edge is 2^1024
    req = request(counter("rl.step.count", 1, T0 + 2 * SEC),
                  _lengths(CUMULATIVE, _exp_point(offset, 1, T0 + SEC, scale=20), _exp_point(offset, 3, T0 + 2 * SEC, scale=20)))
    h = of(checked(MetricTranslator().translate(req, T0 + 2 * SEC)), "CompletionLengthHistogram")[0]
    assert (h["scale"], h["offset"], h["bucket_counts"], h["count"]) == (20, offset, [3], 3)


# -- all or nothing ----------------------------------------------------------------------------------
def test_a_step_count_past_an_avro_long_is_refused_before_the_state_changes() -> None:
    # rl.step.count = 1e30: translated, then the encoder refused the Step in the ingest (dead letter),
    # but the state had committed: the attempt's RUN_START was never published
    m = MetricTranslator()
    with pytest.raises(OtlpRejected, match="out of range"):
        m.translate(request(counter("rl.step.count", 1e30, T0 + SEC)), T0 + SEC)
    outs = checked(m.translate(request(counter("rl.step.count", 1, T0 + 2 * SEC)), T0 + 2 * SEC))
    assert [o.record["type"] for o in outs] == ["RUN_START", "STEP"]


def test_step_tokens_past_an_avro_long_are_refused_not_dead_lettered_after_commit() -> None:
    m = MetricTranslator()
    with pytest.raises(OtlpRejected, match="Step record"):
        m.translate(request(counter("rl.step.count", 1, T0 + SEC), gauge("rl.step.tokens", 1e30, T0 + SEC)), T0 + SEC)
    assert m.series_count == 0


def test_two_reward_series_whose_counts_add_past_an_avro_long_are_refused() -> None:
    n = 2**62 + 2**61
    points = [pb.HistogramDataPoint(start_time_unix_nano=T0, time_unix_nano=T0 + SEC, count=n, sum=1.0,
                                    bucket_counts=[n] + [0] * 14, explicit_bounds=[0, .1, .2, .3, .4, .5, .6, .7, .8, .9,
                                                                                   .99, 1, 2, 5],
                                    attributes=kv({S + "rl.term": "total", S + "x": x})) for x in ("a", "b")]
    reward = pb.Metric(name=S + "rl.rollout.reward", histogram=pb.Histogram(data_points=points,
                                                                           aggregation_temporality=DELTA))
    m = Translator()
    with pytest.raises(OtlpRejected, match="StepStats record"):
        m.translate("metrics", request(counter("rl.step.count", 1, T0 + SEC), reward).SerializeToString(), T0 + SEC)
    assert m.metrics.series_count == 0


# -- wrong types -------------------------------------------------------------------------------------
@pytest.mark.parametrize("attempt", ["--1", "²"])
def test_an_attempt_that_only_looks_like_digits_is_a_clear_rejection(attempt: str) -> None:
    # str.isdigit() accepts both; int() then raised ValueError, not OtlpRejected
    with pytest.raises(OtlpRejected, match="the run attempt must be an integer"):
        MetricTranslator().translate(request(counter("rl.step.count", 1, T0 + SEC),
                                             resource={**RUN, S + "run.attempt": attempt}), T0 + SEC)


def test_a_negative_span_status_code_is_refused() -> None:
    # -1 read as ERROR (STATUSES[-1]); -4 raised IndexError
    for code in (-1, -4):
        with pytest.raises(OtlpRejected, match=f"unknown status code {code}"):
            Translator().translate("traces", span_request(span(1, "s", {}, status=code)).SerializeToString(), T0)


def test_the_receiver_answers_400_when_the_translator_raises_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(request: Any, now_ns: int) -> list[Out]:
        raise IndexError("a translator bug")
    monkeypatch.setattr(receiver_module, "translate_spans", broken)
    receiver = receiver_module.OtlpReceiver(Settings(), port=0)
    try:
        body = span_request(span(1, "s", {})).SerializeToString()
        assert receiver.accept("traces", OTLP_SPANS_TOPIC, body) == (400, "the translator failed: IndexError")
        assert receiver.refused == 1
    finally:
        receiver._server.server_close()


# -- numbering ---------------------------------------------------------------------------------------
def test_the_first_message_of_a_partition_gives_no_mark_of_zero() -> None:
    # offset 0, index 0 gave writer_sequence 0: the streams read ``writer_sequence or sequence_id``, took the
    # span's start order (~2^60) as its mark and skipped every later span of that writer as a replay
    outs = Translator().translate("traces", span_request(span(1, "a", {}), span(2, "b", {}, start=5)).SerializeToString(),
                                  T0)
    number(outs, partition=0, offset=0)
    later = Translator().translate("traces", span_request(span(3, "c", {})).SerializeToString(), T0)
    number(later, partition=0, offset=1)
    marks = [o.record["writer_sequence"] for o in outs + later]
    assert all(m > 0 for m in marks) and marks == sorted(set(marks))
    assert all(CODEC.decode(v).records for _, _, v in containers(CODEC, outs + later))
