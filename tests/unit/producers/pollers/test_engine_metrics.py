"""vLLM's metrics into engine figures (producers/pollers/engine_metrics.py): the allowlist, counters as rates
with resets, TTFT percentiles as Prometheus's histogram_quantile computes them, the prefix cache's hit rate,
queue-time and inter-token-latency means and percentiles (older vLLM names where the new ones are absent), and
what is refused."""

from __future__ import annotations

import math

import pytest

from rlpulse.producers.pollers.engine_metrics import (GENERATION_TOKENS, ITL, ITL_OLD, PREEMPTIONS, PREFIX_HITS,
                                                      PREFIX_HITS_OLD, PREFIX_QUERIES, PREFIX_QUERIES_OLD, PROMPT_TOKENS,
                                                      QUEUE_TIME, TTFT, Reading, interval, parse, quantile, vllm_name)

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
    return Reading("0", counters={PROMPT_TOKENS: prompt, GENERATION_TOKENS: gen, PREEMPTIONS: preempt}, buckets={TTFT: ttft})


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


def test_the_prefix_cache_hit_rate_is_hits_over_queries_in_the_interval() -> None:
    before = Reading("0", counters={PREFIX_QUERIES: 10_000, PREFIX_HITS: 6_000})
    after = Reading("0", counters={PREFIX_QUERIES: 10_800, PREFIX_HITS: 6_600})  # 800 tokens looked up, 600 found
    got = interval(before, after, 5.0)
    assert (got.prefix_cache_queries, got.prefix_cache_hit_rate, got.resets) == (800, 0.75, 0)
    quiet = interval(after, after, 5.0)  # nothing looked up: no rate, not 0
    assert (quiet.prefix_cache_queries, quiet.prefix_cache_hit_rate) == (0, None)
    assert interval(None, after, None).prefix_cache_hit_rate is None  # the first scrape has no interval
    restarted = interval(after, Reading("0", counters={PREFIX_QUERIES: 400, PREFIX_HITS: 100}), 5.0)
    assert (restarted.prefix_cache_queries, restarted.prefix_cache_hit_rate, restarted.resets) == (400, 0.25, 2)
    assert interval(Reading("0"), after, 5.0).prefix_cache_hit_rate is None  # not in the previous scrape


def test_vllm_0_9_1s_gpu_prefix_cache_names_are_read_only_where_the_new_ones_are_absent() -> None:
    old = interval(Reading("0", counters={PREFIX_QUERIES_OLD: 100, PREFIX_HITS_OLD: 10}),
                   Reading("0", counters={PREFIX_QUERIES_OLD: 300, PREFIX_HITS_OLD: 60}), 1.0)
    assert (old.prefix_cache_queries, old.prefix_cache_hit_rate) == (200, 0.25)
    both = {PREFIX_QUERIES: 100, PREFIX_HITS: 50, PREFIX_QUERIES_OLD: 999, PREFIX_HITS_OLD: 0}  # 0.9.2-0.10.2 export both
    got = interval(Reading("0", counters=both), Reading("0", counters={**both, PREFIX_QUERIES: 200, PREFIX_HITS: 140}), 1.0)
    assert (got.prefix_cache_queries, got.prefix_cache_hit_rate) == (100, 0.9)


def histogram(buckets: dict[float, float], total: float) -> tuple[dict[float, float], dict[str, float]]:
    return buckets, {"sum": total, "count": buckets[INF]}


def test_queue_time_and_inter_token_latency_give_a_mean_and_percentiles_of_the_interval() -> None:
    q0, qt0 = histogram({1.0: 4, 5.0: 6, INF: 6}, 7.0)
    q1, qt1 = histogram({1.0: 4, 5.0: 10, INF: 10}, 19.0)  # 4 requests waited 12 s in all, each in (1, 5]
    i0, it0 = histogram({0.05: 100, 0.1: 100, INF: 100}, 3.0)
    i1, it1 = histogram({0.05: 140, 0.1: 200, INF: 200}, 8.0)  # 100 gaps, 5 s in all: 40 <= 0.05 s, 60 in (0.05, 0.1]
    before = Reading("0", buckets={QUEUE_TIME: q0, ITL: i0}, totals={QUEUE_TIME: qt0, ITL: it0})
    after = Reading("0", buckets={QUEUE_TIME: q1, ITL: i1}, totals={QUEUE_TIME: qt1, ITL: it1})
    got = interval(before, after, 5.0)
    queue, itl = got.histograms[QUEUE_TIME], got.histograms[ITL]
    assert (queue.count, queue.mean) == (4, 3.0)
    assert queue.quantiles[:2] == pytest.approx((1.0 + 4.0 * 2 / 4, 1.0 + 4.0 * 3.6 / 4))  # ranks 2 and 3.6 in (1, 5]
    assert (itl.count, itl.mean) == (100, 0.05)
    assert itl.quantiles[:2] == pytest.approx((0.05 + 0.05 * 10 / 60, 0.05 + 0.05 * 50 / 60))  # ranks 50 and 90
    assert got.resets == 0 and got.histograms[TTFT].count is None  # TTFT not exported here: null
    assert interval(after, after, 5.0).histograms[QUEUE_TIME].mean is None  # nothing observed: no mean


def test_time_per_output_token_is_the_inter_token_latency_of_vllm_before_0_10_2() -> None:
    i0, it0 = histogram({0.05: 10, INF: 10}, 0.2)
    i1, it1 = histogram({0.05: 30, INF: 30}, 0.8)
    old = interval(Reading("0", buckets={ITL_OLD: i0}, totals={ITL_OLD: it0}),
                   Reading("0", buckets={ITL_OLD: i1}, totals={ITL_OLD: it1}), 1.0)
    assert (old.histograms[ITL].count, old.histograms[ITL].mean) == (20, pytest.approx(0.03))
    # 0.10.2-0.11 export both with the same observations; a differing old one shows which is read
    both = interval(Reading("0", buckets={ITL: i0, ITL_OLD: i0}, totals={ITL: it0, ITL_OLD: it0}),
                    Reading("0", buckets={ITL: i1, ITL_OLD: i0}, totals={ITL: it1, ITL_OLD: it0}), 1.0)
    assert both.histograms[ITL].count == 20


def test_a_histogram_whose_sum_or_count_went_down_was_reset() -> None:
    q0, qt0 = histogram({1.0: 50, INF: 60}, 90.0)
    restarted = interval(Reading("0", buckets={QUEUE_TIME: q0}, totals={QUEUE_TIME: qt0}),
                         Reading("0", buckets={QUEUE_TIME: {1.0: 2, INF: 3}}, totals={QUEUE_TIME: {"sum": 2.4, "count": 3}}),
                         1.0)
    assert restarted.resets == 1 and restarted.histograms[QUEUE_TIME].count == 3
    assert restarted.histograms[QUEUE_TIME].mean == pytest.approx(0.8)
    # only _sum and _count (no buckets): a mean, no percentiles
    totals_only = interval(Reading("0", totals={QUEUE_TIME: {"sum": 1.0, "count": 1}}),
                           Reading("0", totals={QUEUE_TIME: {"sum": 4.0, "count": 3}}), 1.0).histograms[QUEUE_TIME]
    assert (totals_only.count, totals_only.mean, totals_only.quantiles) == (2, 1.5, (None, None, None))


def test_parse_reads_the_new_figures_and_rays_names_for_them() -> None:
    parsed = parse(
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 800\n'
        'ray_vllm_prefix_cache_hits_total{engine="0"} 600\n'
        'vllm:request_queue_time_seconds_bucket{engine="0",le="1.0"} 3\n'
        'vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf"} 4\n'
        'vllm:request_queue_time_seconds_sum{engine="0"} 2.5\n'
        'vllm:request_queue_time_seconds_count{engine="0"} 4\n'
        'ray_vllm_time_per_output_token_seconds_count{engine="0"} 9\n'
        'vllm:time_to_first_token_seconds_sum{engine="0"} 1.0\n'
        'vllm:request_time_per_output_token_seconds_count{engine="0"} 2\n')
    e0 = parsed.engines["0"]
    assert e0.counters == {PREFIX_QUERIES: 800.0, PREFIX_HITS: 600.0}
    assert e0.buckets == {QUEUE_TIME: {1.0: 3.0, INF: 4.0}}
    assert e0.totals == {QUEUE_TIME: {"sum": 2.5, "count": 4.0}, ITL_OLD: {"count": 9.0}}
    assert parsed.ignored == 2  # TTFT's sum (its mean is not a figure) and the per-request TPOT


def test_a_hostile_scrape_gives_no_rate_above_1_and_no_count_beyond_a_long() -> None:
    more_hits = interval(Reading("0", counters={PREFIX_QUERIES: 100, PREFIX_HITS: 0}),
                         Reading("0", counters={PREFIX_QUERIES: 200, PREFIX_HITS: 500}), 1.0)
    assert (more_hits.prefix_cache_queries, more_hits.prefix_cache_hit_rate) == (100, None)  # 500 hits of 100 lookups
    huge = interval(Reading("0", counters={PREFIX_QUERIES: 0, PREFIX_HITS: 0}),
                    Reading("0", counters={PREFIX_QUERIES: 1e20, PREFIX_HITS: 1e19}), 1.0)
    assert (huge.prefix_cache_queries, huge.prefix_cache_hit_rate) == (None, None)
    q0, qt0 = histogram({1.0: 0, INF: 0}, 0.0)
    q1, qt1 = histogram({1.0: 1e20, INF: 1e20}, 1e20)
    got = interval(Reading("0", buckets={QUEUE_TIME: q0}, totals={QUEUE_TIME: qt0}),
                   Reading("0", buckets={QUEUE_TIME: q1}, totals={QUEUE_TIME: qt1}), 1.0)
    queue = got.histograms[QUEUE_TIME]
    assert (queue.count, queue.mean, set(queue.quantiles)) == (None, None, {None})
