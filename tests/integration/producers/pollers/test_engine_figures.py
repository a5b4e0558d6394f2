"""The vLLM figures beyond the first eight, end to end: the prefix cache's hit rate, queue time and inter-token
latency, from two real ``prometheus_client`` exporters on loopback, one declaring vLLM 0.33.0's metrics
(names, types, labels and buckets as the vllm 0.33.0 wheel's modules ``vllm.v1.metrics.loggers`` and
``vllm.v1.metrics.buckets`` declare them) and one vLLM 0.9.1's older names (``gpu_cache_usage_perc``, ``gpu_prefix_cache_*``,
``time_per_output_token_seconds``), scraped by the engine poller, through the broker, `rlpulse streams` and
`rlpulse sink` into ClickHouse (chDB).

Counters advance between scrapes by known amounts and latencies are observed from known lists; the stored
rows and the saved query ``engine-by-step`` must equal what those give, computed here from the observations.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from rlpulse.base.settings import Settings
from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.producers import TrainingTelemetry
from rlpulse.producers.pollers.engine_poller import EnginePoller, EngineRun
from rlpulse.producers.sdk.sender import Sender
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.store.clickhouse import open_store
from tests.integration import until

pytest.importorskip("prometheus_client")
from tests.vllm_exporter import ITL_BUCKETS, LATENCY_BUCKETS, VllmExporter, histogram_quantile  # noqa: E402

pytestmark = pytest.mark.full

RUN = "engf-run"
COLUMNS = ("kv_cache_usage", "awake", "prefix_cache_queries", "prefix_cache_hit_rate", "queue_time_count",
           "queue_time_mean_s", "queue_time_p50_s", "queue_time_p90_s", "itl_count", "itl_mean_s", "itl_p50_s",
           "itl_p90_s", "counter_resets")
# What each engine serves between its scrapes: (prefix tokens looked up, found, queue times, inter-token gaps).
STEP0 = {"rollout-new": (2048, 1536, [0.2, 0.4, 1.2, 3.0, 9.0], [0.02] * 30 + [0.06] * 9 + [0.3]),
         "rollout-old": (1000, 250, [0.5, 2.0], [0.03] * 20)}
STEP1 = {"rollout-new": (1000, 900, [0.1], [0.01] * 10), "rollout-old": (0, 0, [], [])}


def truth(served: tuple[int, int, list[float], list[float]]) -> tuple:
    """The row's new figures, from what the engine served in the interval (kv, awake and resets aside)."""
    queries, hits, queued, gaps = served
    q = [histogram_quantile(p, queued, LATENCY_BUCKETS) for p in (0.5, 0.9)]
    i = [histogram_quantile(p, gaps, ITL_BUCKETS) for p in (0.5, 0.9)]
    return (queries, hits / queries if queries else None, len(queued), sum(queued) / len(queued) if queued else None,
            *q, len(gaps), sum(gaps) / len(gaps) if gaps else None, *i)


def engine_run(settings: Settings, sender: Sender, exporters: dict[str, VllmExporter]) -> None:
    """Two steps; each engine is scraped at the run's start (a), after serving STEP0 (b, in step 0) and after
    serving STEP1 (c, in step 1). The interval clock moves 5 s a scrape."""
    mono = [0.0]
    pollers = {pod: EnginePoller([vllm.url], sender.offer, settings, run=EngineRun(RUN, 1, "engf", pod),
                                 monotonic=lambda: mono[0]) for pod, vllm in exporters.items()}

    def scrape() -> None:
        time.sleep(0.05)  # the samples' wall-clock times fall after the STEP event before them
        for poller in pollers.values():
            assert len(poller.scrape()) == 1
        mono[0] += 5.0
        time.sleep(0.05)

    def serve(plan: dict[str, tuple[int, int, list[float], list[float]]]) -> None:
        for pod, (queries, hits, queued, gaps) in plan.items():
            exporters[pod].serve(prefix_queries=queries, prefix_hits=hits, queued=tuple(queued), itl=tuple(gaps))

    with TrainingTelemetry(project="engf", run_id=RUN, attempt=1, settings=settings) as tel:
        exporters["rollout-new"].set(kv=0.5)
        exporters["rollout-old"].set(kv=0.25)  # gpu_cache_usage_perc: the only KV name of 0.9.1
        for pod in exporters:  # served before the first scrape: in no interval
            exporters[pod].serve(prefix_queries=777, prefix_hits=7, queued=(60.0,), itl=(5.0,))
        scrape()  # a
        serve(STEP0)
        scrape()  # b
        tel.step_completed(step=0, tokens=100, duration_s=1.0)
        serve(STEP1)
        scrape()  # c
        tel.step_completed(step=1, tokens=100, duration_s=1.0)
        assert tel.flush(30) == 0
    assert not any(p.refused or p.failures for p in pollers.values())


@pytest.fixture(scope="module")
def ran(module_settings: Settings) -> Iterator[Settings]:
    settings = module_settings
    ensure_topics(settings)
    with VllmExporter(version="0.33.0") as new, VllmExporter(version="0.9.1") as old, Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        sender = Sender(settings)
        sender.start()
        engine_run(settings, sender, {"rollout-new": new, "rollout-old": old})
        assert sender.close(30) == 0 and sender.delivered == 6
        pipeline.wait_caught_up(until=until.counts(settings, {
            f"SELECT count() FROM $db.engine_samples FINAL WHERE run_id = '{RUN}'": 6,
            f"SELECT count() FROM $db.steps FINAL WHERE run_id = '{RUN}'": 4}))
        pipeline.stop()
    yield settings


def test_the_stored_rows_equal_what_the_engines_served(ran: Settings) -> None:
    with open_store(ran.clickhouse_dsn, owner="test") as store:
        rows = store.client.query(f"SELECT pod, {', '.join(COLUMNS)} FROM {store.database}.engine_samples FINAL "
                                  f"WHERE run_id = '{RUN}' ORDER BY pod, time_ns").result_rows
    by_pod: dict[str, list[tuple]] = {}
    for pod, *rest in rows:
        by_pod.setdefault(pod, []).append(tuple(rest))
    assert sorted(by_pod) == ["rollout-new", "rollout-old"]
    for pod, kv, awake in (("rollout-new", 0.5, 1), ("rollout-old", 0.25, None)):  # 0.9.1 has no sleep state
        a, b, c = by_pod[pod]
        assert a == (kv, awake, *(None,) * 10, 0)  # the first scrape: no interval, no figure
        assert b[:2] == (kv, awake) and b[-1] == 0 and c[:2] == (kv, awake) and c[-1] == 0
        assert b[2:-1] == pytest.approx(truth(STEP0[pod])), pod
        assert c[2:-1] == pytest.approx(truth(STEP1[pod])), pod
    # spelled out once, for the reader: 1536 of 2048 tokens found; five requests waited 13.8 s in all
    new_b = by_pod["rollout-new"][1]
    assert new_b[2:6] == (2048, 0.75, 5, pytest.approx(2.76))
    assert by_pod["rollout-old"][2][2:] == (0, None, 0, None, None, None, 0, None, None, None, 0)  # nothing served


def test_engine_by_step_gives_the_steps_hit_rate_queue_time_and_inter_token_latency(ran: Settings) -> None:
    run = subprocess.run([sys.executable, "-m", "rlpulse.cli", "query", "--saved", "engine-by-step", "--param",
                          f"run_id={RUN}", "--param", "attempt=1", "--format", "json"],
                         env=settings_env(ran), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    step0, step1 = json.loads(run.stdout)
    keys = ("step", "engines", "samples", "prefix_cache_hit_rate", "queue_time_mean_s", "queue_time_p90_s_max",
            "itl_mean_s", "itl_p90_s_max")
    new0, old0, new1 = STEP0["rollout-new"], STEP0["rollout-old"], STEP1["rollout-new"]
    # over both engines: tokens found over tokens looked up, seconds waited over requests, gaps over their count;
    # the query rounds to 3 decimals (4 for the inter-token latency): the truth here is not rounded
    assert {k: step0[k] for k in keys} == pytest.approx({
        "step": 0, "engines": 2, "samples": 4,
        "prefix_cache_hit_rate": (new0[1] + old0[1]) / (new0[0] + old0[0]),
        "queue_time_mean_s": (sum(new0[2]) + sum(old0[2])) / (len(new0[2]) + len(old0[2])),
        "queue_time_p90_s_max": max(histogram_quantile(0.9, s[2], LATENCY_BUCKETS) or 0 for s in (new0, old0)),
        "itl_mean_s": (sum(new0[3]) + sum(old0[3])) / (len(new0[3]) + len(old0[3])),
        "itl_p90_s_max": max(histogram_quantile(0.9, s[3], ITL_BUCKETS) or 0 for s in (new0, old0))}, abs=5.01e-4)
    # the 0.9.1 engine served nothing in step 1: the step's figures are the new engine's alone
    assert {k: step1[k] for k in keys} == pytest.approx({
        "step": 1, "engines": 2, "samples": 2, "prefix_cache_hit_rate": 0.9, "queue_time_mean_s": 0.1,
        "queue_time_p90_s_max": histogram_quantile(0.9, new1[2], LATENCY_BUCKETS),
        "itl_mean_s": 0.01, "itl_p90_s_max": histogram_quantile(0.9, new1[3], ITL_BUCKETS)}, abs=5.01e-4)
