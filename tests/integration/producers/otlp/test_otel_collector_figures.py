"""A job instrumented exactly as seed 001 describes (the real opentelemetry-sdk and its OTLP/HTTP
exporters, no rlpulse SDK: tests/otel_clients/seed001_job.py) -> the real OpenTelemetry Collector
(built from deploy/otelcol/builder.yaml, run on deploy/otelcol/otelcol.yaml) -> Kafka ->
``rlpulse otlp-ingest`` -> ``rlpulse streams`` and ``rlpulse sink`` -> ClickHouse; in both encodings
(``otlp_proto``, ``otlp_json``) and both temporalities (cumulative, delta).

What a user checks: every figure the job measured is in ClickHouse as it measured it. Steps
(with tokens, throughput, MFU), step stats, the reward histogram per term with its fixed buckets,
the completion-length exponential histogram, grader failures by term and cause, graded counts,
judge tokens, term shares, the GPU's figures, the placement, the pools, and every span. Sums of a
cumulative series are differences of two doubles (equal to the job's to 1e-12); the min and max of
a cumulative histogram are the step's only where they changed (docs/otel.md), so they are compared
exactly under delta temporality and bounded under cumulative.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlpulse.base.settings import Settings
from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.producers.otlp.ingest import ingest_group
from rlpulse.schemas.topics import ensure_topics
from tests import otelcol
from tests.conftest import unavailable
from tests.integration import until
from tests.otel_clients import otel_venv

pytestmark = [pytest.mark.integration, pytest.mark.full]

STEPS, ROLLOUTS = 3, 8
PROJECT = "seed001"
JOBS = [("otlp_proto", "cumulative"), ("otlp_proto", "delta"), ("otlp_json", "cumulative"), ("otlp_json", "delta")]


def run_id(encoding: str, temporality: str) -> str:
    return f"{encoding}-{temporality}"


def _job(collector: Path, otel_python: Path, settings: Settings, encoding: str, temporalities: list[str],
         logs: Path) -> list[dict[str, Any]]:
    """Run the jobs of one encoding through one Collector; their truths."""
    http_port, grpc_port = otelcol.free_port(), otelcol.free_port()
    log = logs / f"otelcol-{encoding}.log"
    process = otelcol.start(otelcol.CONFIG, {
        "OTLP_HTTP_ENDPOINT": f"127.0.0.1:{http_port}", "OTLP_GRPC_ENDPOINT": f"127.0.0.1:{grpc_port}",
        "RLPULSE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap, "RLPULSE_TOPIC_PREFIX": settings.topic_prefix,
        "OTLP_KAFKA_ENCODING": encoding}, binary=collector, log_path=log)
    truths = []
    try:
        otelcol.wait_ready(http_port, process, log_path=log)
        for temporality in temporalities:
            job = subprocess.run([str(otel_python), str(otel_venv.SEED001_JOB), "--endpoint", f"http://127.0.0.1:{http_port}",
                                  "--run-id", run_id(encoding, temporality), "--project", PROJECT, "--steps", str(STEPS),
                                  "--rollouts", str(ROLLOUTS), "--temporality", temporality, "--seed", "11"],
                                 capture_output=True, text=True, timeout=180)
            assert job.returncode == 0, f"the job failed:\n{job.stderr[-3000:]}"
            truths.append(json.loads(job.stdout.strip().splitlines()[-1]))
    finally:
        code = otelcol.stop(process)
    assert code == 0, f"the Collector exited {code}:\n{log.read_text()[-3000:]}"
    return truths


@pytest.fixture(scope="module")
def ran(module_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, dict[str, Any]]]:
    if not otelcol.binary_path().exists() and shutil.which("go") is None:
        unavailable("`go` is not on PATH: building the OpenTelemetry Collector needs Go 1.26 (go.dev/dl)")
    collector = otelcol.ensure(log=lambda line: print(line, file=sys.stderr))
    otel_python = otel_venv.ensure(log=lambda line: print(line, file=sys.stderr))
    settings = module_settings
    ensure_topics(settings)
    logs = tmp_path_factory.mktemp("otelcol")
    pipeline = Pipeline(settings)
    try:
        pipeline.start(("otlp-ingest", "streams", "sink"))
        wait_groups_ready(settings, (settings.app_id, settings.sink_group, ingest_group(settings)), pipeline)
        truths: dict[str, Any] = {}
        for encoding in ("otlp_proto", "otlp_json"):
            temporalities = [t for e, t in JOBS if e == encoding]
            for truth in _job(collector, otel_python, settings, encoding, temporalities, logs):
                truths[truth["run_id"]] = truth
        n = len(JOBS)
        pipeline.wait_caught_up(until=until.counts(settings, {
            f"SELECT count() FROM $db.spans FINAL WHERE project = '{PROJECT}'": n * STEPS * (ROLLOUTS + 1),
            f"SELECT count() FROM $db.step_stats FINAL WHERE project = '{PROJECT}'": n * STEPS,
            f"SELECT count() FROM $db.reward_histograms FINAL WHERE project = '{PROJECT}'": n * STEPS * 3,
            f"SELECT count() FROM $db.steps FINAL WHERE project = '{PROJECT}' AND type = 'RUN_END'": n}), timeout=240)
        pipeline.check_alive()
        yield settings, truths
    finally:
        pipeline.stop()


def q(settings: Settings, sql: str) -> list[tuple]:
    rows = until.query(settings, sql)
    assert rows is not None, sql
    return rows


def close(a: float, b: float, exact: bool) -> bool:
    return a == b if exact else a == pytest.approx(b, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize(("encoding", "temporality"), JOBS)
def test_steps_and_step_figures_equal_the_jobs(ran, encoding: str, temporality: str) -> None:
    settings, truths = ran
    run = run_id(encoding, temporality)
    truth = truths[run]
    assert truth["exported"]["failed"] == 0
    steps = q(settings, f"SELECT step, step_count, tokens, throughput, mfu, trainer FROM $db.steps FINAL "
                        f"WHERE run_id = '{run}' AND type = 'STEP' ORDER BY step")
    assert steps == [(s["step"], s["step"], s["gauges"]["tokens"], s["gauges"]["throughput"], s["gauges"]["mfu"], "rl")
                     for s in truth["steps"]]
    types = q(settings, f"SELECT type, count() FROM $db.steps FINAL WHERE run_id = '{run}' GROUP BY type ORDER BY type")
    # cumulative repeats the counter in the last export (a heartbeat); delta leaves it out
    expected = {"RUN_START": 1, "STEP": STEPS, "RUN_END": 1, **({"HEARTBEAT": 1} if temporality == "cumulative" else {})}
    assert dict(types) == expected
    stats = q(settings, f"SELECT step, rollouts, clipped, clipped_ratio, reward_mean, reward_std, reward_zero_fraction, "
                        f"completion_mean, completion_min, completion_max FROM $db.step_stats FINAL WHERE run_id = '{run}' "
                        f"ORDER BY step")
    assert stats == [(s["step"], s["rollouts"], s["clipped"], s["gauges"]["clipped_ratio"], s["gauges"]["reward_mean"],
                      s["gauges"]["reward_std"], s["gauges"]["reward_zero_fraction"], s["gauges"]["completion_mean"],
                      s["gauges"]["completion_min"], s["gauges"]["completion_max"]) for s in truth["steps"]]


@pytest.mark.parametrize(("encoding", "temporality"), JOBS)
def test_reward_and_length_histograms_equal_the_jobs(ran, encoding: str, temporality: str) -> None:
    settings, truths = ran
    run = run_id(encoding, temporality)
    truth, exact = truths[run], temporality == "delta"
    rows = q(settings, f"SELECT step, term, bounds, bucket_counts, count, sum, min, max FROM $db.reward_histograms FINAL "
                       f"WHERE run_id = '{run}' ORDER BY step, term")
    got = {(r[0], r[1]): r[2:] for r in rows}
    assert set(got) == {(s["step"], t) for s in truth["steps"] for t in ("total", "judge", "format")}
    for s in truth["steps"]:
        for term, want in s["reward"].items():
            bounds, buckets, count, total, low, high = got[(s["step"], term)]
            assert list(bounds) == truth["reward_bounds"]
            assert (list(buckets), count) == (want["bucket_counts"], want["count"]), (s["step"], term)
            assert close(total, want["sum"], exact), (s["step"], term)
            if exact:
                assert (low, high) == (want["min"], want["max"])
            else:  # never beyond a value the job recorded that step's bucket range allows
                assert want["min"] - 1e-9 <= low <= high <= want["max"] + 1e-9 or (low, high) == (want["min"], want["max"])
    rows = q(settings, f"SELECT step, count, sum, zero_count, min, max, arraySum(bucket_counts) FROM "
                       f"$db.completion_length_histograms FINAL WHERE run_id = '{run}' ORDER BY step")
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        (s["step"], s["length"]["count"], s["length"]["sum"], s["length"]["zero_count"]) for s in truth["steps"]]
    assert all(r[6] + r[3] == r[1] for r in rows)  # every completion in a bucket or the zero bucket
    if exact:
        assert [(r[4], r[5]) for r in rows] == [(s["length"]["min"], s["length"]["max"]) for s in truth["steps"]]


@pytest.mark.parametrize(("encoding", "temporality"), JOBS)
def test_grader_and_term_figures_equal_the_jobs(ran, encoding: str, temporality: str) -> None:
    settings, truths = ran
    run = run_id(encoding, temporality)
    truth, exact = truths[run], temporality == "delta"
    failures = q(settings, f"SELECT term, cause, sum(failures) FROM $db.grader_failures FINAL WHERE run_id = '{run}' "
                           f"GROUP BY term, cause HAVING sum(failures) > 0 ORDER BY term, cause")
    want: dict[tuple[str, str], int] = {}
    for s in truth["steps"]:
        for term, g in s["graders"].items():
            for cause, n in g["failures"].items():
                want[(term, cause)] = want.get((term, cause), 0) + n
    assert failures == sorted((t, c, n) for (t, c), n in want.items())
    graded = q(settings, f"SELECT term, sum(graded) FROM $db.grader_windows FINAL WHERE run_id = '{run}' "
                         f"GROUP BY term ORDER BY term")
    assert graded == [(t, STEPS * ROLLOUTS) for t in ("format", "judge")]
    terms = q(settings, f"SELECT step, term, share_mean, share_std, graded, failures, judge_input_tokens, "
                        f"judge_output_tokens, duration_max_s FROM $db.step_term_stats FINAL WHERE run_id = '{run}' "
                        f"ORDER BY step, term")
    expected = []
    for s in truth["steps"]:
        for term in sorted(s["graders"]):
            g = s["graders"][term]
            expected.append((s["step"], term, s["term_shares"][term]["mean"], s["term_shares"][term]["std"], g["graded"],
                             sum(g["failures"].values()), g["input_tokens"], g["output_tokens"]))
    assert [r[:8] for r in terms] == expected
    if exact:
        assert [r[8] for r in terms] == [s["graders"][t]["duration"]["max"] for s in truth["steps"] for t in sorted(s["graders"])]


def test_gpu_placement_and_pools_equal_the_jobs(ran) -> None:
    settings, truths = ran
    truth = truths[run_id("otlp_proto", "delta")]
    last = truth["steps"][-1]["gpu"]
    rows = q(settings, f"SELECT power_w, temperature_c, gpu_utilization, memory_used_bytes, memory_total_bytes, "
                       f"memory_activity, sm_clock_mhz, throttle_reasons FROM $db.gpu_samples FINAL "
                       f"WHERE hw_id = '{truth['hw_id']}' AND run_id = '{truth['run_id']}' ORDER BY time_ns DESC LIMIT 1")
    assert rows == [(last["hw.power"], last["hw.temperature"], last["hw.gpu.utilization"], last["hw.gpu.memory.usage"],
                     last["hw.gpu.memory.limit"], last["gpu.memory.activity"], last["gpu.clock.sm"],
                     last["gpu.clock.throttle_reasons"])]
    placements = q(settings, f"SELECT DISTINCT role, rank, pod, node, hw_id FROM $db.placements FINAL "
                             f"WHERE run_id = '{truth['run_id']}'")
    assert placements == [("trainer", 0, "seed001-pod-0", "node-a", truth["hw_id"])]
    pools = q(settings, "SELECT devices_declared, devices_observed, devices_granted, devices_queued, claims_granted, "
                        "claims_queued FROM $db.capacity FINAL WHERE pool = 'a100-pool' AND project = '' "
                        "ORDER BY time_ns DESC LIMIT 1")
    p = truth["steps"][-1]["pools"]
    assert pools == [(p["declared"], p["observed"], p["devices_claimed"]["GRANTED"], p["devices_claimed"]["QUEUED"],
                      p["claims"]["GRANTED"], p["claims"]["QUEUED"])]


@pytest.mark.parametrize(("encoding", "temporality"), JOBS)
def test_every_span_lands_with_its_ids_and_rollout(ran, encoding: str, temporality: str) -> None:
    settings, truths = ran
    run = run_id(encoding, temporality)
    truth = truths[run]
    rows = q(settings, f"SELECT span_id, trace_id, kind, rollout_id, step FROM $db.spans FINAL "  # ids are stored as hex text
                       f"WHERE run_id = '{run}'")
    got = {r[0]: r[1:] for r in rows}
    assert len(got) == STEPS * (ROLLOUTS + 1)
    for s in truth["steps"]:
        assert got[s["spans"]["span_id"]][:2] == (s["spans"]["trace_id"], "CUSTOM")
        for r in s["spans"]["rollouts"]:
            assert got[r["span_id"]][:4] == (s["spans"]["trace_id"], "LLM", r["rollout_id"], s["step"])


def test_prometheus_serves_what_the_job_sent_under_seed_001s_names(ran) -> None:
    """OTel in, Prometheus out: the seed's series, its prefix swapped, for a job with no rlpulse SDK."""
    from tests.integration.sinks.prometheus.test_prometheus import Command, scrape, series

    settings, truths = ran
    cmd = Command(settings)
    try:
        samples = scrape(cmd)
    finally:
        cmd.close()
    for run, truth in truths.items():
        steps = series(samples, "rlpulse_rl_step_count_total", rlpulse_run_id=run)
        assert list(steps.values()) == [STEPS], (run, steps)
        failures = series(samples, "rlpulse_rl_grader_failures_total", rlpulse_run_id=run)
        want: dict[tuple[str, str], int] = {}
        for s in truth["steps"]:
            for term, g in s["graders"].items():
                for cause, n in g["failures"].items():
                    want[(term, cause)] = want.get((term, cause), 0) + n
        got = {(dict(labels)["rlpulse_rl_term"], dict(labels)["rlpulse_rl_grader_failure_cause"]): v
               for labels, v in failures.items() if v}
        assert got == want, run
        count = series(samples, "rlpulse_rl_rollout_reward_count", rlpulse_run_id=run, rlpulse_rl_term="total")
        assert list(count.values()) == [STEPS * ROLLOUTS], run
    hw_id = next(iter(truths.values()))["hw_id"]
    power = series(samples, "hw_power", hw_id=hw_id)
    assert len(power) == 1  # one GPU, whichever job sampled it last
