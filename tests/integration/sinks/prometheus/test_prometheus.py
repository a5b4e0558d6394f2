"""``rlpulse prometheus`` scraped over HTTP equals ClickHouse's figures, and seed 001's three PromQL examples
work on two scrapes with the prefix swapped.

A small workload goes through the SDK, the broker, the real streams and sink into chDB: two live runs
(steps, rollouts with rewards and lengths, graders failing by cause), a run that ended now and one
that ended 20 minutes ago (past the 15-minute grace), a GPU sample with its placement and one
placement without hw_id, an engine sample, a capacity report, and an alert. The real command runs as
a subprocess; each scrape is parsed with prometheus_client's parser and compared with SQL run here.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from prometheus_client.parser import text_string_to_metric_families

from rlpulse.base import env as envvars
from rlpulse.base.settings import Settings
from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.producers import TrainingTelemetry
from rlpulse.schemas.catalogue import engine_key, run_key
from rlpulse.schemas.codec import Codec
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.prometheus.buckets import upper_bound
from tests.integration import until

pytestmark = [pytest.mark.integration, pytest.mark.full]

REPO = Path(__file__).resolve().parents[4]
PROJECT = "prom"
A, B, ENDED_NOW, ENDED_LONG_AGO = "prom-a", "prom-b", "prom-done", "prom-old"
GPU, OTHER_GPU = "GPU-6f1e-prom-a0", "GPU-0000-other"
CAUSES = ("timeout", "unavailable", "unreadable")
TOKEN = "prom-test-token-" + "5d2c" * 8
KV = 0.4375


def _step(tel: TrainingTelemetry, step: int, failing: int) -> None:
    """Four rollouts (rewards 0, 0.25, 1, 1.5; lengths 0, 7, 40, 300 of 300), graders of judge: ``failing`` fail."""
    for i, (reward, tokens) in enumerate(((0.0, 0), (0.25, 7), (1.0, 40), (1.5, 300))):
        rid = f"s{step}-r{i}"
        outcome = CAUSES[(step + i) % len(CAUSES)] if i < failing else "ok"
        tel.grader(step=step, rollout_id=rid, term="judge", outcome=outcome, duration_s=0.1)
        tel.rollout(step=step, rollout_id=rid, reward=reward, term_shares={"judge": reward}, completion_tokens=tokens,
                    max_tokens=300)
    tel.step_completed(step, tokens=1000 + step, duration_s=2.0, mfu=0.25)


async def _produce_alert(settings: Settings) -> None:
    now = time.time_ns()
    record = dict(rule="test_rule", state="FIRING", key=f"{PROJECT}/{A}/1", severity="warning", summary="a test alert",
                  value=1.0, threshold=0.5, project=PROJECT, run_id=A, attempt=1, time_ns=now, first_seen_ns=now,
                  last_seen_ns=now)
    producer = AIOKafkaProducer(**settings.kafka_client_kwargs())
    await producer.start()
    try:
        await producer.send_and_wait(settings.topic("alerts"), key=run_key(PROJECT, A).encode(),
                                     value=Codec().encode("Alert", [record]))
    finally:
        await producer.stop()


def _hardware(tel: TrainingTelemetry) -> None:
    now = time.time_ns()
    tel.publish_hardware("GpuSample", GPU, dict(
        project=PROJECT, run_id=A, attempt=1, time_ns=now, hw_id=GPU, index=0, host="h0", node="node-0", pod="pod-a0",
        rank=0, role="actor", power_w=312.5, temperature_c=61.0, gpu_utilization=0.875, memory_used_bytes=60 << 30,
        memory_total_bytes=80 << 30, memory_utilization=0.75, memory_activity=0.375, sm_clock_mhz=1410.0,
        throttle_reasons=0x9, throttle_reason_names=["gpu_idle", "hw_slowdown"], xid_errors=2, xid_last=79))
    base = dict(project=PROJECT, run_id=A, attempt=1, stage="", time_ns=now, host="h0")
    tel.publish_hardware("Placement", GPU, dict(base, role="actor", rank=0, pod="pod-a0", node="node-0", index=0,
                                                hw_id=GPU))
    # a worker whose GPU could not be read: no hw_id (left out of the served placements)
    tel.publish_hardware("Placement", "h0/1", dict(base, role="actor", rank=1, pod="pod-a1", node="node-0", index=None,
                                                   hw_id=None))
    tel.publish_hardware("EngineSample", engine_key("rollout-0", "http://rollout-0:8000/metrics", "0"), dict(
        project=PROJECT, run_id=A, attempt=1, pod="rollout-0", url="http://rollout-0:8000/metrics", engine="0",
        model_name="qwen", time_ns=now, interval_s=5.0, requests_running=3.0, requests_waiting=1.0, kv_cache_usage=KV,
        awake=1))
    tel.publish_hardware("CapacitySample", "h100", dict(
        pool="h100", serving=False, accelerator="h100", project="", instance="svc-0", time_ns=now, devices_declared=8,
        devices_observed=8, devices_granted=4, devices_queued=2, claims_granted=1, claims_queued=1))
    tel.publish_hardware("CapacitySample", "h100", dict(
        pool="h100", serving=False, accelerator="h100", project=PROJECT, instance="svc-0", time_ns=now,
        devices_granted=4, devices_queued=0, quota=6))


@pytest.fixture(scope="module")
def pipeline(module_settings: Settings) -> Iterator[tuple[Settings, Pipeline, dict[str, TrainingTelemetry]]]:
    settings = module_settings
    ensure_topics(settings)
    with Pipeline(settings) as pipe:
        pipe.start(("streams", "sink"))
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipe)
        tels = {run: TrainingTelemetry(project=PROJECT, run_id=run, attempt=1, trainer="rl", settings=settings)
                for run in (A, B, ENDED_NOW)}
        long_ago = time.time_ns() - 20 * 60 * 10**9
        old = TrainingTelemetry(project=PROJECT, run_id=ENDED_LONG_AGO, attempt=1, trainer="rl", settings=settings,
                                clock=lambda: long_ago)
        for tel in (*tels.values(), old):
            tel.start()
        for step in range(3):
            _step(tels[A], step, failing=2)
        for step in range(2):
            _step(tels[B], step, failing=1)
        _step(tels[ENDED_NOW], 0, failing=0)
        _step(old, 0, failing=0)
        _hardware(tels[A])
        assert tels[ENDED_NOW].close(30) == 0 and old.close(30) == 0
        for tel in tels.values():
            if tel is not tels[ENDED_NOW]:
                assert tel.flush(30) == 0
        asyncio.run(_produce_alert(settings))
        pipe.wait_caught_up(until=until.counts(settings, {
            f"SELECT count() FROM $db.step_stats FINAL WHERE project = '{PROJECT}'": 7,
            f"SELECT count() FROM $db.reward_histograms FINAL WHERE project = '{PROJECT}' AND term = 'total'": 7,
            f"SELECT count() FROM $db.completion_length_histograms FINAL WHERE project = '{PROJECT}'": 7,
            f"SELECT count() FROM $db.grader_failures FINAL WHERE project = '{PROJECT}' AND run_id = '{B}'": 1,
            "SELECT count() FROM $db.placements FINAL": 2, "SELECT count() FROM $db.gpu_samples FINAL": 1,
            "SELECT count() FROM $db.engine_samples FINAL": 1, "SELECT count() FROM $db.capacity FINAL": 2,
            "SELECT count() FROM $db.alerts FINAL WHERE rule = 'test_rule'": 1}))
        _wait_failures_settled(settings)
        yield settings, pipe, tels
        for run in (A, B):
            tels[run].close(30)


def _wait_failures_settled(settings: Settings) -> None:
    """Until every published grader failure of A and B is in a closed window (6 for A, 2 for B)."""
    sql = (f"SELECT run_id, sum(failures) FROM $db.grader_failures FINAL WHERE project = '{PROJECT}' "
           f"AND run_id IN ('{A}', '{B}') GROUP BY run_id ORDER BY run_id")
    deadline = time.monotonic() + 120
    while until.query(settings, sql) != [(A, 6), (B, 2)]:
        assert time.monotonic() < deadline, until.query(settings, sql)
        time.sleep(0.5)


class Command:
    """``rlpulse prometheus`` as a subprocess on a free port (``--port 0``: it prints the URL)."""

    def __init__(self, settings: Settings, *args: str, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "rlpulse.cli", "prometheus", "--port", "0", *args],
                                     env={**settings_env(settings), **(env or {})}, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        found = re.search(r"serving http://([^:]+):(\d+)/metrics", line)
        assert found, line + self.proc.stdout.read()
        self.url = f"http://127.0.0.1:{found.group(2)}/metrics"

    def get(self, path: str = "/metrics", token: str | None = None, method: str = "GET") -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(self.url.replace("/metrics", path), headers=headers, method=method,
                                         data=b"x" if method == "POST" else None)
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def command(pipeline) -> Iterator[Command]:
    cmd = Command(pipeline[0])
    yield cmd
    cmd.close()


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(cmd: Command, token: str | None = None) -> Samples:
    status, text = cmd.get(token=token)
    assert status == 200, text
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, key  # no duplicate series
            out[key] = s.value
    return out


def series(samples: Samples, name: str, **match: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name and all(dict(labels).get(k) == x
                                                                                 for k, x in match.items())}


def run_labels(run: str, **more: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"rlpulse_project": PROJECT, "rlpulse_run_id": run, "rlpulse_run_attempt": "1", **more}.items()))


def q(settings: Settings, sql: str) -> list[tuple]:
    rows = until.query(settings, sql)
    assert rows is not None
    return rows


def test_a_scrape_equals_clickhouses_figures(pipeline, command: Command) -> None:
    settings = pipeline[0]
    got = scrape(command)
    # step counters: the attempt's highest step_count; a run ended past the grace is absent
    counts = dict(q(settings, f"SELECT run_id, max(step_count) FROM $db.steps FINAL WHERE project = '{PROJECT}' "
                              f"AND run_id != '{ENDED_LONG_AGO}' GROUP BY run_id"))
    assert counts == {A: 3, B: 2, ENDED_NOW: 1}
    assert series(got, "rlpulse_rl_step_count_total") == {run_labels(r): float(c) for r, c in counts.items()}
    assert series(got, "rlpulse_sft_step_count_total") == {}
    # grader failures by term and cause
    failures = q(settings, f"SELECT run_id, term, cause, sum(failures) FROM $db.grader_failures FINAL "
                           f"WHERE project = '{PROJECT}' AND run_id != '{ENDED_LONG_AGO}' GROUP BY run_id, term, cause")
    assert series(got, "rlpulse_rl_grader_failures_total") == {
        run_labels(r, rlpulse_rl_term=t, rlpulse_rl_grader_failure_cause=c): float(n) for r, t, c, n in failures}
    assert sum(v for v in series(got, "rlpulse_rl_grader_failures_total", rlpulse_run_id=A).values()) == 6
    # reward histogram: every step's buckets summed, cumulative
    for run, term, bounds, counts_, n, total in q(settings, f"""
            SELECT run_id, term, any(bounds), sumForEach(bucket_counts), sum(count), sum(sum)
            FROM $db.reward_histograms FINAL WHERE project = '{PROJECT}' AND run_id != '{ENDED_LONG_AGO}'
            GROUP BY run_id, term"""):
        labels = {"rlpulse_rl_term": term}
        buckets = series(got, "rlpulse_rl_rollout_reward_bucket", rlpulse_run_id=run, rlpulse_rl_term=term)
        expected = {run_labels(run, le=str(float(b)), **labels): float(sum(counts_[:i + 1])) for i, b in enumerate(bounds)}
        expected[run_labels(run, le="+Inf", **labels)] = float(n)
        assert buckets == expected
        assert got[("rlpulse_rl_rollout_reward_count", run_labels(run, **labels))] == n
        assert got[("rlpulse_rl_rollout_reward_sum", run_labels(run, **labels))] == pytest.approx(total)
    steps_a = 3
    assert got[("rlpulse_rl_rollout_reward_bucket", run_labels(A, le="0.0", rlpulse_rl_term="total"))] == steps_a
    assert got[("rlpulse_rl_rollout_reward_bucket", run_labels(A, le="1.0", rlpulse_rl_term="total"))] == 3 * steps_a
    # completion lengths: each le counts the stored buckets (any step, any scale) whose upper bound is at most le
    for run in (A, B, ENDED_NOW):
        rows = q(settings, f"SELECT scale, zero_count, offset, bucket_counts, count, sum FROM "
                           f"$db.completion_length_histograms FINAL WHERE project = '{PROJECT}' AND run_id = '{run}'")
        buckets = series(got, "rlpulse_rl_rollout_completion_length_bucket", rlpulse_run_id=run)
        for labels, value in buckets.items():
            le = float(dict(labels)["le"])
            want = sum(z for _, z, *_ in rows) + sum(
                c for s, _, o, cs, *_ in rows for i, c in enumerate(cs) if upper_bound(o + i, s) <= le * (1 + 1e-12))
            assert value == want, (run, le)
        assert buckets[run_labels(run, le="+Inf")] == sum(r[4] for r in rows) == 4 * len(rows)
        assert got[("rlpulse_rl_rollout_completion_length_sum", run_labels(run))] == sum(r[5] for r in rows)
        # the published lengths 0, 7, 40, 300 per step: 300 is at or below the last finite bucket
        finite = sorted((float(dict(lb)["le"]), v) for lb, v in buckets.items() if dict(lb)["le"] != "+Inf")
        assert next(v for le, v in finite if le >= 40) >= 3 * len(rows) and finite[-1][1] == 4 * len(rows)
    # the latest step's figures
    assert series(got, "rlpulse_rl_step_tokens", rlpulse_run_id=A) == {run_labels(A): 1002.0}
    assert series(got, "rlpulse_rl_step_throughput", rlpulse_run_id=A) == {run_labels(A): 501.0}
    assert series(got, "rlpulse_rl_step_mfu", rlpulse_run_id=A) == {run_labels(A): 0.25}
    [(ratio,)] = q(settings, f"SELECT argMax(clipped_ratio, step) FROM $db.step_stats FINAL WHERE run_id = '{A}'")
    assert series(got, "rlpulse_rl_step_completion_clipped_ratio", rlpulse_run_id=A) == {run_labels(A): ratio} and ratio == 0.25
    # GPU figures, placement (only the one with hw_id), engine, capacity, alert
    gpu = {"hw_id": GPU, "rlpulse_project": PROJECT, "rlpulse_run_id": A, "rlpulse_run_attempt": "1"}
    [(power, temp, util, used, mem_util, activity, throttle, xids, xid_last)] = q(settings, f"""
        SELECT power_w, temperature_c, gpu_utilization, memory_used_bytes, memory_utilization, memory_activity,
               throttle_reasons, xid_errors, xid_last FROM $db.gpu_samples FINAL WHERE hw_id = '{GPU}'""")
    for name, value in (("hw_power", power), ("hw_temperature", temp), ("hw_gpu_utilization", util),
                        ("hw_gpu_memory_usage", used), ("hw_gpu_memory_utilization", mem_util),
                        ("rlpulse_gpu_memory_activity", activity), ("rlpulse_gpu_clock_throttle_reasons", throttle),
                        ("rlpulse_gpu_xid_errors_total", xids), ("rlpulse_gpu_xid_last", xid_last)):
        assert series(got, name) == {tuple(sorted(gpu.items())): float(value)}, name
    assert series(got, "rlpulse_job_placement") == {
        run_labels(A, rlpulse_job_role="actor", rlpulse_job_rank="0", hw_id=GPU, pod="pod-a0", node="node-0"): 1.0}
    engine = {"pod": "rollout-0", "engine": "0", "model_name": "qwen"}
    assert series(got, "rlpulse_vllm_num_requests_running") == {run_labels(A, **engine): 3.0}
    assert series(got, "rlpulse_vllm_num_requests_waiting") == {run_labels(A, **engine): 1.0}
    assert series(got, "rlpulse_vllm_engine_sleep_state") == {run_labels(A, sleep_state="awake", **engine): 1.0}
    pool = {"rlpulse_pool": "h100", "rlpulse_pool_serving": "false", "rlpulse_pool_accelerator": "h100",
            "rlpulse_instance": "svc-0"}
    lab = lambda **kw: tuple(sorted(kw.items()))  # noqa: E731
    assert series(got, "rlpulse_pool_devices_declared") == {lab(**pool): 8.0}
    assert series(got, "rlpulse_pool_devices_observed") == {lab(**pool): 8.0}
    assert series(got, "rlpulse_pool_devices_claimed") == {lab(**pool, rlpulse_claim_state="GRANTED"): 4.0,
                                                           lab(**pool, rlpulse_claim_state="QUEUED"): 2.0}
    assert series(got, "rlpulse_pool_claims") == {lab(**pool, rlpulse_claim_state="GRANTED"): 1.0,
                                                  lab(**pool, rlpulse_claim_state="QUEUED"): 1.0}
    proj = {"rlpulse_project": PROJECT, "rlpulse_pool": "h100", "rlpulse_instance": "svc-0"}
    assert series(got, "rlpulse_project_devices_claimed") == {lab(**proj, rlpulse_claim_state="GRANTED"): 4.0,
                                                              lab(**proj, rlpulse_claim_state="QUEUED"): 0.0}
    assert series(got, "rlpulse_project_devices_quota") == {lab(**proj): 6.0}
    firing = q(settings, """SELECT rule, key, argMax(severity, (time_ns, state = 'RESOLVED')) FROM $db.alerts
                            GROUP BY rule, key HAVING argMax(state, (time_ns, state = 'RESOLVED')) = 'FIRING'""")
    served = {(dict(lb)["rule"], dict(lb)["key"], dict(lb)["severity"]) for lb in series(got, "rlpulse_alert_firing")}
    assert served == set(firing)
    assert ("test_rule", f"{PROJECT}/{A}/1", "warning") in set(firing)
    assert series(got, "rlpulse_prometheus_series_dropped", what="runs") == {(("what", "runs"),): 0.0}
    # the run that ended 20 minutes ago (grace 15m) is in ClickHouse, and in no series
    assert q(settings, f"SELECT count() FROM $db.steps FINAL WHERE run_id = '{ENDED_LONG_AGO}' AND type = 'RUN_END'") == [(1,)]
    assert not [k for k in got if dict(k[1]).get("rlpulse_run_id") == ENDED_LONG_AGO]


def increase(points: list[tuple[float, float]], at: float, window: float) -> float | None:
    """PromQL's increase(x[window]) at ``at`` from (time, value) points: counter resets added back, then
    extrapolated as Prometheus's extrapolatedRate does; None with fewer than two points in the window."""
    inside = [(t, v) for t, v in points if at - window < t <= at]
    if len(inside) < 2:
        return None
    delta = inside[-1][1] - inside[0][1] + sum(prev for (_, prev), (_, cur) in zip(inside, inside[1:]) if cur < prev)
    sampled = inside[-1][0] - inside[0][0]
    average = sampled / (len(inside) - 1)
    to_start, to_end = inside[0][0] - (at - window), at - inside[-1][0]
    if delta > 0 and inside[0][1] >= 0:  # a counter cannot have been below 0
        to_start = min(to_start, sampled * (inside[0][1] / delta))
    threshold = average * 1.1
    extended = sampled + (to_start if to_start < threshold else average / 2) + (to_end if to_end < threshold else average / 2)
    return delta * extended / sampled


def gpu_join(left: dict[tuple, float], right: dict[tuple, float]) -> dict[tuple, float]:
    """``left * on(GpuUuid) group_left(rlpulse_job_role, rlpulse_job_rank) label_replace(right, "GpuUuid", "$1",
    "hw_id", "(.+)")``: two right series with one GpuUuid (missing counts as "") fail the whole query, as in PromQL."""
    ones: dict[str, dict[str, str]] = {}
    values: dict[str, float] = {}
    for labels, value in right.items():
        d = dict(labels)
        if re.fullmatch("(.+)", d.get("hw_id", "")):
            d["GpuUuid"] = d["hw_id"]
        uuid = d.get("GpuUuid", "")
        if uuid in ones:
            raise ValueError(f"found duplicate series for the match group {{GpuUuid={uuid!r}}} on the right hand-side")
        ones[uuid], values[uuid] = d, value
    out = {}
    for labels, value in left.items():
        d = dict(labels)
        uuid = d.get("GpuUuid", "")
        if uuid in ones:
            d.pop("__name__", None)
            d.update({k: ones[uuid][k] for k in ("rlpulse_job_role", "rlpulse_job_rank")})
            out[tuple(sorted(d.items()))] = value * values[uuid]
    return out


def test_seed_001s_three_queries_over_two_scrapes(pipeline, command: Command) -> None:
    settings, pipe, tels = pipeline
    t1, first = time.time(), scrape(command)
    for step in (3, 4):  # only A steps on; B stopped
        _step(tels[A], step, failing=0)
    assert tels[A].flush(30) == 0
    pipe.wait_caught_up(until=until.counts(settings, {
        f"SELECT count() FROM $db.steps FINAL WHERE run_id = '{A}' AND type = 'STEP'": 5}))
    time.sleep(1.1)  # past the scrape cache
    t2, second = time.time(), scrape(command)
    # (1) increase(rlpulse_rl_step_count_total[15m]) == 0: B matches, A does not
    stalled = set()
    for labels in series(second, "rlpulse_rl_step_count_total"):
        points = [(t, s[("rlpulse_rl_step_count_total", labels)]) for t, s in ((t1, first), (t2, second))
                  if ("rlpulse_rl_step_count_total", labels) in s]
        inc = increase(points, t2, 15 * 60)
        if inc is not None and inc == 0:
            stalled.add(dict(labels)["rlpulse_run_id"])
    assert stalled == {B, ENDED_NOW}  # ENDED_NOW: a run that stopped, then ended, matches until it drops out
    assert second[("rlpulse_rl_step_count_total", run_labels(A))] == 5.0
    assert increase([(t1, 3.0), (t2, 5.0)], t2, 900) > 0
    # (2) the GPU join by UUID, the placement filtered to the run
    cluster = {(("GpuUuid", GPU), ("__name__", "ray_node_gpus_utilization")): 0.77,
               (("GpuUuid", OTHER_GPU), ("__name__", "ray_node_gpus_utilization")): 0.5}
    placement = series(second, "rlpulse_job_placement", rlpulse_run_id=A)
    joined = gpu_join(cluster, placement)
    assert joined == {(("GpuUuid", GPU), ("rlpulse_job_rank", "0"), ("rlpulse_job_role", "actor")): 0.77}
    # the pitfall it avoids: two placements without hw_id would fail the whole join
    no_uuid = {run_labels(A, rlpulse_job_rank=str(r)): 1.0 for r in (1, 2)}
    with pytest.raises(ValueError, match="duplicate series"):
        gpu_join(cluster, {**placement, **no_uuid})
    # (3) rlpulse_vllm_kv_cache_usage_perc{rlpulse_run_id="$run"} is the engine sample
    [(kv,)] = q(settings, f"SELECT kv_cache_usage FROM $db.engine_samples FINAL WHERE run_id = '{A}'")
    assert list(series(second, "rlpulse_vllm_kv_cache_usage_perc", rlpulse_run_id=A).values()) == [kv] == [KV]
    assert series(second, "rlpulse_vllm_kv_cache_usage_perc", rlpulse_run_id=B) == {}


def test_off_loopback_a_bearer_token_is_required_and_only_get_metrics_is_served(pipeline) -> None:
    settings = pipeline[0]
    refused = subprocess.run([sys.executable, "-m", "rlpulse.cli", "prometheus", "--host", "0.0.0.0", "--port", "0"],
                             env={k: v for k, v in settings_env(settings).items() if k != envvars.PROMETHEUS_TOKEN},
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and envvars.PROMETHEUS_TOKEN in refused.stderr, refused.stderr
    cmd = Command(settings, "--host", "0.0.0.0", "--max-runs", "1", env={envvars.PROMETHEUS_TOKEN: TOKEN})
    try:
        for token in (None, "wrong-" + TOKEN, TOKEN[:-1]):
            assert cmd.get(token=token)[0] == 401
            assert cmd.get("/nope", token=token)[0] == 401  # the token first, before the path
            assert cmd.get(token=token, method="POST")[0] == 401
        assert cmd.get("/nope", token=TOKEN)[0] == 404
        assert cmd.get("/metrics/", token=TOKEN)[0] == 404
        assert cmd.get(token=TOKEN, method="POST")[0] == 405
        got = scrape(cmd, token=TOKEN)
        # --max-runs 1: the newest run only, the other live ones counted
        assert len(series(got, "rlpulse_rl_step_count_total")) == 1
        assert series(got, "rlpulse_prometheus_series_dropped", what="runs") == {(("what", "runs"),): 2.0}
    finally:
        cmd.close()
    assert TOKEN not in (cmd.proc.stdout.read() if cmd.proc.stdout else "")
