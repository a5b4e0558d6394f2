"""Engine samples and capacity, end to end: a real ``prometheus_client`` exporter serving vLLM's metrics,
scraped by the engine poller (in this process and as `rlpulse engine-poller`), the capacity SDK of two
service instances, through the broker, `rlpulse streams` and `rlpulse sink` into ClickHouse.

Checks the exact engine rows (rates, percentiles, a sleep/wake cycle), one FIRING and one RESOLVED
``engine_saturated``, the saved query ``engine-by-step`` joining the engine to the run's steps, and
`rlpulse capacity`'s exact output: two instances of one pool are the max, not the sum; a stale instance
is left out; the pool whose last claim ended reads 0 and stays listed.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.producers import TrainingTelemetry
from rlpulse.producers.pollers.capacity import CapacityReporter, PoolCapacity
from rlpulse.producers.pollers.engine_poller import EnginePoller, EngineRun
from rlpulse.producers.simulators.engine_sim import simulate_capacity
from rlpulse.producers.sdk.sender import Sender
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.store.clickhouse import open_store
from tests.integration import until

pytest.importorskip("prometheus_client")
from tests.vllm_exporter import VllmExporter  # noqa: E402 - needs prometheus_client

# about 16 s on 2 cores: make test-all (make test sits at its 6-minute limit; the engine poller's unit tests stay in it)
pytestmark = [pytest.mark.integration, pytest.mark.full]

NS = 1_000_000_000
SATURATED_AFTER_S = 0.2  # of the samples' own time; scrapes here are at least 0.3 s apart
ENGINE = ("project", "run_id", "attempt", "pod", "engine", "interval_s", "requests_running", "requests_waiting",
          "kv_cache_usage", "prompt_tokens_per_s", "generation_tokens_per_s", "preemptions_per_s", "ttft_count",
          "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "awake", "counter_resets")


def engine_run(settings: Settings, vllm: VllmExporter, sender: Sender) -> list[int]:
    """A run with two steps while the poller scrapes its engine: scrapes a, b in step 0 (saturation
    begins at b), c, d, e in step 1 (it ends at d; the engine sleeps at e), f after the last step.
    The interval clock moves 5 s a scrape; the records' time is the wall clock. Returns the times."""
    mono = [0.0]
    poller = EnginePoller([vllm.url], sender.offer, settings, run=EngineRun("eng-run", 1, "eng", "rollout-0"),
                          monotonic=lambda: mono[0])
    times: list[int] = []

    def scrape() -> None:
        time.sleep(SATURATED_AFTER_S * 1.5)
        [record] = poller.scrape()
        times.append(record["time_ns"])
        mono[0] += 5.0

    with TrainingTelemetry(project="eng", run_id="eng-run", attempt=1, settings=settings) as tel:
        vllm.set(running=8, waiting=0, kv=0.40)
        scrape()  # a
        vllm.serve(prompt=1000, generation=500, preemptions=2, ttft=(0.05, 0.07, 0.3, 0.3, 0.9))
        vllm.set(waiting=3, kv=0.97)
        scrape()  # b: saturated from here
        tel.step_completed(step=0, tokens=100, duration_s=1.0)
        vllm.serve(prompt=500)
        vllm.set(waiting=5, kv=0.99)
        scrape()  # c: saturated for longer than SATURATED_AFTER_S: FIRING
        vllm.set(waiting=0)
        scrape()  # d: nothing waits: RESOLVED
        vllm.sleep(level=1)
        vllm.set(running=0, kv=0.0)
        scrape()  # e: asleep while the actor updates
        tel.step_completed(step=1, tokens=100, duration_s=1.0)
        vllm.wake()
        vllm.serve(generation=2500)
        vllm.set(running=8)
        scrape()  # f: awake again, after the last step
        assert tel.flush(30) == 0
    return times


def capacity(settings: Settings, sender: Sender, start_ns: int) -> None:
    """The simulator's two pools from two instances (the same figures), and an instance gone 10 minutes
    ago whose last report would win a max over every instance."""
    gone = CapacityReporter(settings, "trainer-svc-old", sender=sender, clock=lambda: start_ns - 600 * NS)
    gone.report([PoolCapacity("train-h100", 64, 64, granted=60, claims_granted=9, accelerator="h100")])
    simulate_capacity(settings, project="eng", sender=sender, start_ns=start_ns)


def cli_poller(settings: Settings, url: str) -> None:
    """`rlpulse engine-poller` as a user runs it, for a few scrapes, stopped with SIGTERM."""
    proc = subprocess.Popen([sys.executable, "-m", "rlpulse.cli", "engine-poller", "--metrics-url", url, "--run-id",
                             "cli-run", "--pod", "cli-pod", "--interval", "0.3s"], env=settings_env(settings),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    rows = until.counts(settings, {"SELECT count() FROM $db.engine_samples FINAL WHERE run_id = 'cli-run'": 3})
    while not rows() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "engine samples published, 0 undelivered; refused: none" in out


@pytest.fixture(scope="module")
def ran(module_settings: Settings) -> Iterator[tuple[Settings, list[int], int]]:
    settings = dataclasses.replace(module_settings, alerts=dataclasses.replace(
        module_settings.alerts, engine_saturated_after=SATURATED_AFTER_S, engine_kv_usage=0.95))
    ensure_topics(settings)
    start_ns = (time.time_ns() // NS - 120) * NS
    with VllmExporter() as vllm, Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        sender = Sender(settings)
        sender.start()
        times = engine_run(settings, vllm, sender)
        capacity(settings, sender, start_ns)
        assert sender.close(30) == 0 and sender.delivered == 6 + 1 + 18
        cli_poller(settings, vllm.url)
        pipeline.wait_caught_up(until=until.counts(settings, {
            "SELECT count() FROM $db.engine_samples FINAL WHERE run_id = 'eng-run'": 6,
            "SELECT count() FROM $db.capacity FINAL": 19,
            "SELECT count() FROM $db.steps FINAL WHERE run_id = 'eng-run'": 4,
            "SELECT count() FROM $db.alerts FINAL WHERE rule = 'engine_saturated'": 2}))
        pipeline.stop()
    yield settings, times, start_ns


def test_engine_rows_are_exact(ran: tuple[Settings, list[int], int]) -> None:
    settings, times, _ = ran
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        rows = store.client.query(f"SELECT time_ns, {', '.join(ENGINE)} FROM {store.database}.engine_samples FINAL "
                                  "WHERE run_id = 'eng-run' ORDER BY time_ns").result_rows
    ident = ("eng", "eng-run", 1, "rollout-0", "0")
    assert [r[0] for r in rows] == times
    got = [r[1:] for r in rows]
    assert got[0] == (*ident, None, 8.0, 0.0, 0.4, None, None, None, None, None, None, None, 1, 0)
    assert got[1][:13] == (*ident, 5.0, 8.0, 3.0, 0.97, 200.0, 100.0, 0.4, 5)
    assert got[1][13:16] == pytest.approx((0.3125, 0.875, 0.9875)) and got[1][16:] == (1, 0)
    assert got[2] == (*ident, 5.0, 8.0, 5.0, 0.99, 100.0, 0.0, 0.0, 0, None, None, None, 1, 0)
    assert got[3] == (*ident, 5.0, 8.0, 0.0, 0.99, 0.0, 0.0, 0.0, 0, None, None, None, 1, 0)
    assert got[4] == (*ident, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, None, None, None, 0, 0)  # asleep
    assert got[5] == (*ident, 5.0, 8.0, 0.0, 0.0, 0.0, 500.0, 0.0, 0, None, None, None, 1, 0)  # awake again


def test_engine_saturated_fires_once_and_resolves_once(ran: tuple[Settings, list[int], int]) -> None:
    settings, times, _ = ran
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        alerts = store.client.query(
            f"SELECT state, key, severity, project, run_id, attempt, first_seen_ns, value, threshold "
            f"FROM {store.database}.alerts FINAL WHERE rule = 'engine_saturated' ORDER BY state").result_rows
    # first seen: sample b, where the saturation began; resolved by d, where nothing waited any more
    assert alerts == [("FIRING", "rollout-0/0", "warning", "eng", "eng-run", 1, times[1], 0.99, 0.95),
                      ("RESOLVED", "rollout-0/0", "warning", "eng", "eng-run", 1, times[1], 0.99, 0.95)]


def test_engine_by_step_joins_the_engine_to_the_runs_steps(ran: tuple[Settings, list[int], int]) -> None:
    settings, _, _ = ran
    run = subprocess.run([sys.executable, "-m", "rlpulse.cli", "query", "--saved", "engine-by-step", "--param",
                          "run_id=eng-run", "--param", "attempt=1", "--format", "json"],
                         env=settings_env(settings), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    step0, step1 = json.loads(run.stdout)  # f, after the last step, belongs to none
    assert {k: step0[k] for k in ("step", "engines", "samples", "requests_running", "requests_waiting_max",
                                  "kv_cache_usage_max", "kv_cache_usage_mean", "prompt_tokens_per_s",
                                  "generation_tokens_per_s", "preemptions_per_s", "awake_share")} == {
        "step": 0, "engines": 1, "samples": 2, "requests_running": 8.0, "requests_waiting_max": 3.0,
        "kv_cache_usage_max": 0.97, "kv_cache_usage_mean": 0.685, "prompt_tokens_per_s": 200.0,
        "generation_tokens_per_s": 100.0, "preemptions_per_s": 0.4, "awake_share": 1.0}
    assert step0["ttft_p50_s"] == pytest.approx(0.3125, abs=1e-3) and step0["ttft_p99_s_max"] == pytest.approx(0.9875, abs=1e-3)
    assert {k: step1[k] for k in ("step", "samples", "requests_running", "requests_waiting_max", "kv_cache_usage_mean",
                                  "prompt_tokens_per_s", "ttft_p50_s", "awake_share")} == {
        "step": 1, "samples": 3, "requests_running": 5.33, "requests_waiting_max": 5.0, "kv_cache_usage_mean": 0.66,
        "prompt_tokens_per_s": 33.3, "ttft_p50_s": None, "awake_share": 0.667}  # asleep in one of three samples


def test_the_cli_poller_published_its_engine(ran: tuple[Settings, list[int], int]) -> None:
    settings, _, _ = ran
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        rows = store.client.query(f"SELECT DISTINCT pod, engine, model_name, awake FROM {store.database}.engine_samples "
                                  "WHERE run_id = 'cli-run'").result_rows
    assert rows == [("cli-pod", "0", "Qwen/Qwen2.5-0.5B", 1)]


def test_rlpulse_capacity_prints_the_max_across_instances(ran: tuple[Settings, list[int], int]) -> None:
    settings, _, start_ns = ran
    run = subprocess.run([sys.executable, "-m", "rlpulse.cli", "capacity"], env=settings_env(settings),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    last = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(start_ns // NS + 30))  # the third report
    assert run.stdout == (
        "POOL        ACCELERATOR  SERVING  DECLARED  OBSERVED  GRANTED  QUEUED  CLAIMS GRANTED  CLAIMS QUEUED  "
        "INSTANCES  REPORTED\n"
        "----------  -----------  -------  --------  --------  -------  ------  --------------  -------------  "
        "---------  -----------------------\n"
        # the serving pool's claim ended: 0, still listed
        f"serve-a100  a100         yes      16        16        0        0       0               0              "
        f"2          {last}\n"
        # 40 granted: the max of two instances reporting 40 (not 80), the stale instance's 60 left out
        f"train-h100  h100         no       64        62        40       0       5               0              "
        f"2          {last}\n"
        "\n"
        "PROJECT  POOL        GRANTED  QUEUED  QUOTA  INSTANCES  REPORTED\n"
        "-------  ----------  -------  ------  -----  ---------  -----------------------\n"
        f"eng      train-h100  40       0       48     2          {last}\n")
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        over_time = store.client.query(f"SELECT count(), max(devices_granted) FROM {store.database}.capacity FINAL "
                                       "WHERE pool = 'train-h100' AND project = ''").result_rows
    assert over_time == [(7, 60)]  # every report is kept: three per instance and the stale one
