"""The engine figures series by series, against real ``prometheus_client`` exporters declaring vLLM 0.33's
metrics (tests/vllm_exporter.py): a non-finite sample is refused for its series and scrape and is neither a
restart nor a wrong delta at the next scrape; under Ray, replicas under one engine label are rated one by one
(a reset per series) and then added up, as Prometheus's ``sum(rate(...))``; one ``--pod`` for two URLs is
refused at the start."""

from __future__ import annotations

import math

import pytest

from rlpulse.producers.pollers.engine_metrics import GENERATION_TOKENS, PROMPT_TOKENS, TTFT, Reading, interval, parse
from rlpulse.producers.pollers.engine_poller import EnginePoller, EngineRun
from rlpulse.producers.sdk.sender import Outgoing
from rlpulse.base.settings import Settings

pytestmark = pytest.mark.full

pytest.importorskip("prometheus_client")
from tests.vllm_exporter import TTFT_BUCKETS, RayExporter, VllmExporter, histogram_quantile  # noqa: E402

SETTINGS = Settings(topic_prefix="t")
TTFT_BUCKET = "vllm:time_to_first_token_seconds_bucket"


class Clock:
    def __init__(self) -> None:
        self.s = 0.0

    def ns(self) -> int:
        return 1_700_000_000_000_000_000 + int(self.s * 1e9)

    def mono(self) -> float:
        return self.s


def poller(urls: list[str], pod: str = "") -> tuple[EnginePoller, list[Outgoing], Clock]:
    out: list[Outgoing] = []
    clock = Clock()
    p = EnginePoller(urls, out.append, SETTINGS, run=EngineRun(run_id="r", pod=pod), clock=clock.ns, monotonic=clock.mono)
    return p, out, clock


def spread(n: int, seed: int) -> tuple[float, ...]:
    """``n`` first-token times across vLLM's buckets, reproducibly."""
    return tuple(0.003 * ((i * 7 + seed) % 97 + 1) ** 1.4 for i in range(n))


def ttft_truth(observed: tuple[float, ...]) -> tuple[float | None, ...]:
    return tuple(histogram_quantile(q, list(observed), TTFT_BUCKETS) for q in (0.5, 0.9, 0.99))


@pytest.mark.parametrize(("le", "value"), [("0.5", math.nan), ("+Inf", math.inf), ("0.01", math.inf), ("+Inf", math.nan)])
def test_a_non_finite_ttft_bucket_is_refused_for_that_scrape_and_is_no_restart(le: str, value: float) -> None:
    before, served, after = spread(283, 1), spread(40, 2), spread(10, 3)
    with VllmExporter() as vllm:
        p, _, clock = poller([vllm.url])
        vllm.serve(ttft=before, generation=1000)
        p.scrape()
        clock.s = 5.0
        vllm.serve(ttft=served, generation=400)
        vllm.spoil(TTFT_BUCKET, value, le=le)
        [bad] = p.scrape()
        clock.s = 10.0
        vllm.unspoil()
        vllm.serve(ttft=after, generation=100)
        [good] = p.scrape()
    # the spoiled scrape: no TTFT figure (not 323 observations, not a restart); the rest as served
    assert (bad["ttft_count"], bad["ttft_p50_s"], bad["ttft_p90_s"], bad["ttft_p99_s"]) == (None, None, None, None)
    assert bad["counter_resets"] == 0 and bad["generation_tokens_per_s"] == 80.0
    assert p.refused == {"not a finite value >= 0": 1, "histogram series left out (a sample refused)": 1}
    # the next one: what was observed since the last whole histogram, 50, no restart
    assert good["ttft_count"] == 50 and good["counter_resets"] == 0 and good["generation_tokens_per_s"] == 20.0
    assert (good["ttft_p50_s"], good["ttft_p90_s"], good["ttft_p99_s"]) == pytest.approx(ttft_truth(served + after))


def test_a_non_finite_counter_is_refused_and_the_next_rate_spans_from_its_last_good_value() -> None:
    with VllmExporter() as vllm:
        p, _, clock = poller([vllm.url])
        vllm.serve(generation=1000, prompt=3000)
        p.scrape()
        clock.s = 5.0
        vllm.serve(generation=400, prompt=500)
        vllm.spoil("vllm:generation_tokens_total", math.inf)
        [bad] = p.scrape()
        clock.s = 10.0
        vllm.unspoil()
        vllm.serve(generation=100, prompt=500)
        [good] = p.scrape()
    assert bad["generation_tokens_per_s"] is None and bad["prompt_tokens_per_s"] == 100.0 and bad["counter_resets"] == 0
    # 500 tokens since the last good value, 10 s before: 50/s (not None, not a reset of 1,500)
    assert good["generation_tokens_per_s"] == 50.0 and good["prompt_tokens_per_s"] == 100.0
    assert good["counter_resets"] == 0 and p.refused == {"not a finite value >= 0": 1}


def test_two_ray_replicas_under_one_engine_label_one_restarting_are_rated_one_by_one() -> None:
    r1_before, r2_before, r1_served, r2_served = spread(20, 4), spread(30, 5), spread(10, 6), spread(5, 7)
    with RayExporter(replicas=("1", "2")) as ray:
        p, _, clock = poller([ray.url])
        ray.serve("1", generation=200_000, prompt=50_000, ttft=r1_before)
        ray.serve("2", generation=300_000, prompt=80_000, ttft=r2_before)
        ray.set("1", running=3, kv=0.4)
        ray.set("2", running=4, kv=0.7)
        [first] = p.scrape()
        clock.s = 10.0
        ray.restart("2")  # the same labels, counting from zero again
        ray.serve("1", generation=16_150, prompt=4_000, ttft=r1_served)
        ray.serve("2", generation=16_150, prompt=2_000, ttft=r2_served)
        ray.set("2", running=1, kv=0.2)
        [got] = p.scrape()
        clock.s = 20.0
        ray.serve("1", generation=1_000)
        ray.serve("2", generation=2_000, ttft=(0.3,))
        [later] = p.scrape()
    assert first["engine"] == "0" and (first["requests_running"], first["kv_cache_usage"]) == (7.0, 0.7)
    assert (got["generation_tokens_per_s"], got["prompt_tokens_per_s"]) == (3_230.0, 600.0)
    assert got["ttft_count"] == 15
    assert (got["ttft_p50_s"], got["ttft_p90_s"], got["ttft_p99_s"]) == pytest.approx(ttft_truth(r1_served + r2_served))
    assert got["counter_resets"] == 3  # replica 2's prompt and generation counters and its TTFT histogram
    assert (got["requests_running"], got["kv_cache_usage"]) == (4.0, 0.4)
    assert (later["generation_tokens_per_s"], later["ttft_count"], later["counter_resets"]) == (300.0, 1, 0)
    assert not p.refused


def test_a_non_finite_sample_of_one_replica_leaves_the_engines_sum_out_then_comes_back_exact() -> None:
    r1_b, r2_b, r1_c, r2_c = spread(6, 8), spread(4, 9), spread(3, 10), spread(2, 11)
    with RayExporter(replicas=("1", "2")) as ray:
        p, _, clock = poller([ray.url])
        ray.serve("1", generation=5_000, ttft=spread(9, 12))
        ray.serve("2", generation=7_000, ttft=spread(9, 13))
        p.scrape()
        clock.s = 10.0
        ray.serve("1", generation=1_000, prompt=100, ttft=r1_b)
        ray.serve("2", generation=2_000, prompt=300, ttft=r2_b)
        ray.spoil("2", "vllm:generation_tokens_total", math.nan)
        ray.spoil("2", TTFT_BUCKET, math.inf, le="0.25")
        [bad] = p.scrape()
        clock.s = 20.0
        ray.unspoil()
        ray.serve("1", generation=1_000, prompt=100, ttft=r1_c)
        ray.serve("2", generation=1_000, prompt=100, ttft=r2_c)
        [good] = p.scrape()
    # a sum without one of its replicas is no figure (not replica 1's 100/s alone), and no restart
    assert (bad["generation_tokens_per_s"], bad["ttft_count"], bad["ttft_p50_s"], bad["counter_resets"]) == (None, None, None, 0)
    assert bad["prompt_tokens_per_s"] == 40.0
    # replica 1 over its 10 s, replica 2 from its last good value 20 s before: 100/s + 150/s
    assert (good["generation_tokens_per_s"], good["prompt_tokens_per_s"], good["counter_resets"]) == (250.0, 20.0, 0)
    assert good["ttft_count"] == len(r1_c + r2_b + r2_c)
    assert (good["ttft_p50_s"], good["ttft_p90_s"], good["ttft_p99_s"]) == pytest.approx(ttft_truth(r1_c + r2_b + r2_c))
    assert p.refused == {"not a finite value >= 0": 2, "histogram series left out (a sample refused)": 1}


def test_parse_refuses_a_bad_sample_for_its_series_only() -> None:
    text = (
        'vllm:num_requests_running{engine="0",replica="a"} 3\n'
        'vllm:num_requests_running{engine="0",replica="b"} NaN\n'  # a sum without it would be wrong: no figure
        'vllm:num_requests_waiting{engine="0",replica="a"} 2\n'
        'vllm:generation_tokens_total{engine="0",replica="a"} 10\n'
        'vllm:generation_tokens_total{engine="0",replica="b"} -5\n'
        'vllm:time_to_first_token_seconds_bucket{engine="0",replica="a",le="0.1"} 1\n'
        'vllm:time_to_first_token_seconds_bucket{engine="0",replica="a",le="+Inf"} 2\n'
        'vllm:time_to_first_token_seconds_bucket{engine="0",replica="b",le="0.1"} 1\n'
        'vllm:time_to_first_token_seconds_bucket{engine="0",replica="b",le="+Inf"} +Inf\n')
    parsed = parse(text)
    e0 = parsed.engines["0"]
    assert e0.gauges == {"vllm:num_requests_waiting": 2.0}
    assert dict(parsed.refused) == {"not a finite value >= 0": 3, "histogram series left out (a sample refused)": 1}
    assert set(e0.series_refused) == {("vllm:num_requests_running", (("engine", "0"), ("replica", "b"))),
                                      (GENERATION_TOKENS, (("engine", "0"), ("replica", "b"))),
                                      (TTFT, (("engine", "0"), ("replica", "b")))}
    assert e0.counters == {} and e0.buckets == {}  # an engine's total is not known with a part of it refused


def test_readings_built_by_hand_are_one_series_each() -> None:
    """The aggregates alone (no series detail) still rate as one series: a reset is a reset."""
    got = interval(Reading("0", counters={PROMPT_TOKENS: 100.0}, buckets={TTFT: {1.0: 1, math.inf: 2}}),
                   Reading("0", counters={PROMPT_TOKENS: 40.0}, buckets={TTFT: {1.0: 1, math.inf: 1}}), 2.0)
    assert got.rates[PROMPT_TOKENS] == 20.0 and got.resets == 2 and got.ttft_count == 1


def test_one_pod_for_two_metrics_urls_is_refused_at_the_start() -> None:
    from rlpulse.cli import build_parser

    urls = ["http://rollout-0:8000/metrics", "http://rollout-0:8001/metrics"]
    with pytest.raises(ValueError, match="one --pod for 2 --metrics-url"):
        EnginePoller(urls, print, SETTINGS, run=EngineRun(pod="rollout-0"))
    args = build_parser().parse_args(["engine-poller", "--metrics-url", urls[0], "--metrics-url", urls[1],
                                      "--pod", "rollout-0"])
    with pytest.raises(ValueError, match="one --pod for 2 --metrics-url"):
        args.func(args)  # before a sender is made or anything is scraped
    EnginePoller(urls[:1], print, SETTINGS, run=EngineRun(pod="rollout-0"))  # one URL, one pod: fine


def test_without_a_pod_two_urls_have_two_keys() -> None:
    with VllmExporter() as a, VllmExporter() as b:
        p, out, _ = poller([a.url, b.url])
        p.scrape()
    assert sorted(o.key for o in out) == sorted([f"{a.url}/0", f"{b.url}/0"])
