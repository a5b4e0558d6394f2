"""vLLM's metrics into engine figures (producers/pollers/engine_metrics.py): the allowlist, counters as rates
with resets, TTFT percentiles as Prometheus's histogram_quantile computes them, and what is refused."""

from __future__ import annotations

import math

import pytest

from rlpulse.producers.pollers.engine_metrics import (GENERATION_TOKENS, PREEMPTIONS, PROMPT_TOKENS, Reading, interval, parse,
                                              quantile, vllm_name)

INF = math.inf
TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.96
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 0.0
vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="weights_offloaded"} 1.0
vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="discard_all"} 0.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="m"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 8.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 8.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 9.5
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 40.0
"""


def test_parse_keeps_the_allowed_names_per_engine_and_ignores_the_rest() -> None:
    parsed = parse(TEXT)
    assert sorted(parsed.engines) == ["0", "1"] and not parsed.refused
    e0, e1 = parsed.engines["0"], parsed.engines["1"]
    assert e0.gauges == {"vllm:num_requests_running": 7.0, "vllm:num_requests_waiting": 3.0,
                         "vllm:gpu_cache_usage_perc": 0.5, "vllm:kv_cache_usage_perc": 0.96}
    assert e0.awake == 0.0 and e0.model_name == "m"  # the awake series, not weights_offloaded
    assert e0.counters == {PROMPT_TOKENS: 1000.0}
    assert e0.ttft == {0.1: 2.0, 1.0: 6.0, INF: 8.0}
    assert e1.gauges == {"vllm:num_requests_running": 2.0, "vllm:gpu_cache_usage_perc": 0.25} and e1.awake is None
    assert parsed.ignored == 3  # TTFT _count and _sum, request_success: read past


def test_ray_cluster_metric_names_read_as_vllms() -> None:
    assert vllm_name("ray_vllm_num_requests_running") == "vllm:num_requests_running"
    assert vllm_name("ray_vllm_generation_tokens_total") == "vllm:generation_tokens_total"
    parsed = parse('ray_vllm_kv_cache_usage_perc{engine="0",akka_optimize_training_run_id="r"} 0.5\n'
                   'ray_vllm_generation_tokens_total{engine="0"} 12\n')
    assert parsed.engines["0"].gauges == {"vllm:kv_cache_usage_perc": 0.5}
    assert parsed.engines["0"].counters == {GENERATION_TOKENS: 12.0}


def test_what_is_refused_is_counted_by_reason() -> None:
    hostile = (
        'vllm:num_requests_running{engine="0"} NaN\n'
        'vllm:num_requests_waiting{engine="0"} -1\n'
        'vllm:kv_cache_usage_perc{engine="0"} +Inf\n'
        f'vllm:num_requests_running{{engine="{"x" * 300}"}} 1\n'
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="soon"} 1\n'
        + "".join(f'vllm:num_requests_running{{engine="{i}"}} 1\n' for i in range(1, 6))
    )
    parsed = parse(hostile, max_engines=3)
    assert dict(parsed.refused) == {"not a finite value >= 0": 3, "label too long": 1, "bucket without a bound": 1,
                                    "too many engines": 2}
    assert sorted(parsed.engines) == ["1", "2", "3"]  # a refused sample makes no engine
    assert dict(parse(hostile, max_series=2).refused)["too many series"] == 8
    assert dict(parse("vllm:num_requests_running{engine=\"0\" 1\n").refused) == {"unparseable": 1}
    assert parse("not metrics at all { ").engines == {}


def test_quantiles_interpolate_as_histogram_quantile() -> None:
    buckets = [(0.1, 2.0), (1.0, 6.0), (INF, 8.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.1 + 0.9 * (4 - 2) / 4)  # rank 4 in (0.1, 1.0]
    assert quantile(0.25, buckets) == pytest.approx(0.1)  # rank 2: the top of the first bucket
    assert quantile(0.1, buckets) == pytest.approx(0.1 * 0.8 / 2)  # the first bucket starts at 0
    assert quantile(0.99, buckets) == 1.0  # in +Inf: the largest finite bound
    assert quantile(0.5, [(0.1, 0.0), (INF, 0.0)]) is None  # nothing observed
    assert quantile(0.5, [(0.1, 1.0), (1.0, 2.0)]) is None  # no +Inf bucket: not a histogram


def reading(prompt: float, gen: float, preempt: float, ttft: dict[float, float]) -> Reading:
    return Reading("0", counters={PROMPT_TOKENS: prompt, GENERATION_TOKENS: gen, PREEMPTIONS: preempt}, ttft=ttft)


def test_counters_become_rates_and_buckets_percentiles_of_the_interval() -> None:
    first = reading(1000, 500, 2, {0.1: 2, 1.0: 6, INF: 8})
    second = reading(3000, 1500, 2, {0.1: 2, 1.0: 10, INF: 12})  # 4 first tokens, all in (0.1, 1.0]
    got = interval(first, second, 4.0)
    assert got.rates == {PREEMPTIONS: 0.0, PROMPT_TOKENS: 500.0, GENERATION_TOKENS: 250.0}
    assert got.ttft_count == 4 and got.resets == 0
    assert got.ttft == pytest.approx((0.1 + 0.9 * 2 / 4, 0.1 + 0.9 * 3.6 / 4, 0.1 + 0.9 * 3.96 / 4))
    assert interval(None, second, None).rates == dict.fromkeys((PREEMPTIONS, PROMPT_TOKENS, GENERATION_TOKENS))
    quiet = interval(second, second, 5.0)
    assert quiet.ttft_count == 0 and quiet.ttft == (None, None, None) and quiet.rates[PROMPT_TOKENS] == 0.0


def test_a_counter_reset_counts_from_zero_as_prometheus_rate_does() -> None:
    before = reading(5000, 4000, 7, {0.1: 50, 1.0: 90, INF: 100})
    restarted = reading(300, 200, 1, {0.1: 1, 1.0: 3, INF: 4})  # the engine restarted between the scrapes
    got = interval(before, restarted, 2.0)
    assert got.rates == {PREEMPTIONS: 0.5, PROMPT_TOKENS: 150.0, GENERATION_TOKENS: 100.0}
    assert got.resets == 4  # three counters and the histogram
    assert got.ttft_count == 4 and got.ttft[0] == pytest.approx(0.1 + 0.9 * (2 - 1) / 2)
    rebucketed = interval(before, reading(5000, 4000, 7, {0.5: 60, INF: 110}), 2.0)  # other bounds: a new histogram
    assert rebucketed.resets == 1 and rebucketed.ttft_count == 110


def test_a_counter_missing_from_either_scrape_has_no_rate() -> None:
    before = Reading("0", counters={PROMPT_TOKENS: 10.0})
    after = Reading("0", counters={PROMPT_TOKENS: 20.0, GENERATION_TOKENS: 5.0})
    got = interval(before, after, 1.0)
    assert got.rates == {PREEMPTIONS: None, PROMPT_TOKENS: 10.0, GENERATION_TOKENS: None}
    assert interval(before, after, 0.0).rates[PROMPT_TOKENS] is None  # no time passed: no rate
