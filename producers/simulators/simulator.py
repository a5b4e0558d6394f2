"""Simulated training runs through the real SDK, with their ground truth.

Deterministic for a seed: the same :class:`SimConfig` gives the same rollouts, rewards, grader
outcomes, clipping and GPU events, and :func:`simulate` returns what it sent (event times
aside), so tests, the demo and benchmarks can compare ClickHouse with it.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

from rlpulse.producers.sdk.records import span_id, trace_id
from rlpulse.producers.sdk.telemetry import TrainingTelemetry
from rlpulse.schemas import gpu_health
from rlpulse.schemas.enums import FAILURE_CAUSES
from rlpulse.base.settings import Settings

MAX_TOKENS = 1024


@dataclass(frozen=True)
class SimConfig:
    project: str = "sim"
    runs: int = 3
    steps: int = 4
    rollouts_per_step: int = 8
    rollouts_per_sample: int = 4  # GRPO-style groups: rollouts answering the same prompt
    terms: tuple[str, ...] = ("judge", "format")
    failure_rate: float = 0.2  # share of grader calls that fail, spread over the causes below
    cause_weights: tuple[float, ...] = (8, 5, 4, 3, 2)  # timeout, unavailable, unreadable, ungradable, error
    clip_rate: float = 0.15  # share of completions truncated at MAX_TOKENS
    seed: int = 7
    stall_s: float = 0.0  # the last run stops progressing after step 0 for this long (heartbeats go on)
    silent_run: bool = False  # one more run that completes a step and then dies without a word
    gpu: bool = False  # a simulated GPU per run; the first run's GPU has an XID and a slowdown
    child_spans: bool = True  # LLM, TOOL, LLM spans under each rollout (the trajectory view of the report)
    checkpoint_every: int = 0  # a checkpoint save every this many steps (0: none), as a trainer saves its weights
    step_s: float = 0.0  # each step takes at least this long in wall time, so samples dated within a run's
    # steps (an engine's, see engine_sim) fall between its step events


@dataclass
class GroundTruth:
    spans: int = 0
    step_events: int = 0  # RUN_START, STEP and RUN_END (heartbeats are not counted)
    rollouts: Counter = field(default_factory=Counter)  # run -> rollouts
    clipped: Counter = field(default_factory=Counter)  # (run, step) -> clipped rollouts
    graded: Counter = field(default_factory=Counter)  # (run, term) -> scores
    failures: Counter = field(default_factory=Counter)  # (run, term, cause) -> failures
    gpu_samples: int = 0
    expected_alerts: set = field(default_factory=set)  # (rule, key, state)
    undelivered: int = 0
    metrics: dict = field(default_factory=dict)  # (run, step) -> the trainer scalars its STEP event carried
    checkpoints: Counter = field(default_factory=Counter)  # run -> checkpoint saves
    # run -> (ns just after its RUN_START, ns just before its last STEP event): wall times, not in as_dict
    times: dict = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "spans": self.spans, "step_events": self.step_events, "gpu_samples": self.gpu_samples,
            "undelivered": self.undelivered,
            "rollouts": dict(sorted(self.rollouts.items())),
            "clipped": {f"{r}/{s}": n for (r, s), n in sorted(self.clipped.items())},
            "graded": {f"{r}/{t}": n for (r, t), n in sorted(self.graded.items())},
            "failures": {f"{r}/{t}/{c}": n for (r, t, c), n in sorted(self.failures.items())},
            "expected_alerts": sorted("/".join(a) for a in self.expected_alerts),
            "metrics": {f"{r}/{s}": m for (r, s), m in sorted(self.metrics.items())},
            "checkpoints": dict(sorted(self.checkpoints.items())),
        }


LEARNING_RATES = (1e-5, 2e-5, 5e-6)  # one per simulated run, so the compare page has settings that differ


def run_settings(config: SimConfig, r: int) -> dict[str, object]:
    """The settings simulated run ``r`` reports (TrainingTelemetry's config): shared ones, a learning rate and a seed
    of its own."""
    return {"algorithm": "grpo", "optim": {"name": "adamw", "lr": LEARNING_RATES[r % len(LEARNING_RATES)]},
            "rollouts_per_step": config.rollouts_per_step, "rollouts_per_sample": config.rollouts_per_sample,
            "terms": list(config.terms), "seed": config.seed + r}


def simulate(settings: Settings, config: SimConfig, progress: Callable[[str], None] = lambda line: None) -> GroundTruth:
    """Publish the configured runs through the SDK; every failure cause occurs in every run."""
    rng = random.Random(config.seed)
    truth = GroundTruth()
    for r in range(config.runs):
        run_id = f"{config.project}-run{r + 1}"
        stall = config.stall_s if r == config.runs - 1 else 0.0
        with TrainingTelemetry(project=config.project, run_id=run_id, attempt=1, trainer="rl", settings=settings,
                               config=run_settings(config, r)) as tel:
            truth.step_events += 2  # RUN_START and RUN_END
            first_ns = last_ns = time.time_ns()
            for step in range(config.steps):
                began = time.monotonic()
                for i in range(config.rollouts_per_step):
                    _one_rollout(tel, rng, truth, config, run_id, step, i)
                if config.gpu:
                    _gpu_sample(tel, truth, run_id, step, first_run=(r == 0))
                if config.checkpoint_every and step % config.checkpoint_every == config.checkpoint_every - 1:
                    _checkpoint(tel, truth, config, run_id, step)
                if config.step_s:
                    time.sleep(max(0.0, began + config.step_s - time.monotonic()))
                metrics = _trainer_metrics(config, run_id, step)
                truth.metrics[(run_id, step)] = metrics
                last_ns = time.time_ns()
                tel.step_completed(step=step, tokens=rng.randint(50_000, 150_000), duration_s=rng.uniform(2, 6),
                                   mfu=round(rng.uniform(0.3, 0.5), 3), metrics=metrics)
                truth.step_events += 1
                if stall and step == 0:
                    progress(f"run {run_id}: stalling for {stall:.0f}s after step 0 (heartbeats go on)")
                    tel.flush(60.0)
                    time.sleep(stall)
                    truth.expected_alerts |= {
                        ("stalled_run", f"{config.project}/{run_id}/1", "FIRING"),
                        ("stalled_run", f"{config.project}/{run_id}/1", "RESOLVED"),
                    }
            truth.undelivered += tel.flush(60.0)
            truth.times[run_id] = (first_ns, last_ns)
        progress(f"run {run_id}: {config.steps} steps x {config.rollouts_per_step} rollouts published")
    if config.silent_run:
        _silent_run(settings, config, rng, truth)
        progress(f"run {config.project}-silent: one step, then silence (no RUN_END)")
    return truth


def _trainer_metrics(config: SimConfig, run_id: str, step: int) -> dict[str, float]:
    """The trainer's own scalars of a step under the names the views and integrations use (loss, kl,
    entropy): loss falls, KL to the reference policy grows, entropy falls. Their own generator, so the
    run's rewards and outcomes are the same with or without them."""
    rng = random.Random(f"{config.seed}/{run_id}/{step}/metrics")
    return {"loss": round(1.2 * 0.8 ** step + rng.uniform(-0.05, 0.05), 4),
            "kl": round(0.002 + 0.004 * step + rng.uniform(0.0, 0.002), 5),
            "entropy": round(1.9 - 0.1 * step + rng.uniform(-0.03, 0.03), 4)}


def _checkpoint(tel: TrainingTelemetry, truth: GroundTruth, config: SimConfig, run_id: str, step: int) -> None:
    """A successful save of the step's weights (a CHECKPOINT span; the saved query ``checkpoints`` lists it)."""
    rng = random.Random(f"{config.seed}/{run_id}/{step}/checkpoint")
    tel.checkpoint(step=step, op="save", duration_s=round(rng.uniform(0.05, 0.3), 3),
                   size_bytes=rng.randint(2, 4) * (1 << 30))
    truth.spans += 1
    truth.checkpoints[run_id] += 1


def _outcome(rng: random.Random, config: SimConfig, forced: int) -> str:
    # The first calls of a run walk through every cause, so each appears at least once.
    if forced < len(FAILURE_CAUSES):
        return FAILURE_CAUSES[forced]
    if rng.random() < config.failure_rate:
        return rng.choices(FAILURE_CAUSES, weights=config.cause_weights)[0]
    return "ok"


def _one_rollout(
    tel: TrainingTelemetry, rng: random.Random, truth: GroundTruth, config: SimConfig, run_id: str, step: int, i: int
) -> None:
    shares = {}
    weight = 1.0 / len(config.terms)
    for t, term in enumerate(config.terms):
        outcome = _outcome(rng, config, (step * config.rollouts_per_step + i) * len(config.terms) + t)
        score = round(rng.random(), 3) if outcome == "ok" else None
        shares[term] = round((score or 0.0) * weight, 6)  # a failed score counts as zero for its term (seed 001)
        # a judge reports its tokens in its reply: none when it did not answer
        judge = term == "judge" and outcome == "ok"
        tel.grader(
            step=step,
            rollout_id=f"s{step}-r{i}",
            term=term,
            outcome=outcome,
            duration_s=round(rng.uniform(0.1, 3.0), 3),
            score=score,
            input_tokens=rng.randint(300, 900) if judge else None,
            output_tokens=rng.randint(5, 60) if judge else None,
        )
        truth.spans += 1
        truth.graded[(run_id, term)] += 1
        if outcome != "ok":
            truth.failures[(run_id, term, outcome)] += 1
    clipped = rng.random() < config.clip_rate
    tokens = MAX_TOKENS if clipped else rng.randint(50, MAX_TOKENS - 1)
    took_s = _children(tel, truth, config, run_id, step, f"s{step}-r{i}", tokens) if config.child_spans else 0.0
    tel.rollout(
        step=step,
        rollout_id=f"s{step}-r{i}",
        reward=round(sum(shares.values()), 6),
        term_shares=shares,
        completion_tokens=tokens,
        max_tokens=MAX_TOKENS,
        sample_id=f"p{step}-{i // config.rollouts_per_sample}",
        duration_s=took_s,
    )
    truth.spans += 1
    truth.rollouts[run_id] += 1
    truth.clipped[(run_id, step)] += int(clipped)


def _children(
    tel: TrainingTelemetry, truth: GroundTruth, config: SimConfig, run_id: str, step: int, rollout_id: str, tokens: int
) -> float:
    """Seed 000's tree under a rollout: LLM turn, TOOL call, LLM turn; returns the rollout's duration.

    Their own generator (seeded by the rollout), so the rewards, outcomes and clipping drawn
    from the run's generator are the same with or without them. They end 3 s before now, where
    the graders (at most 3 s long, ending now) begin.
    """
    rng = random.Random(f"{config.seed}/{run_id}/{step}/{rollout_id}")
    ids = f"{run_id}/{tel.attempt}/{rollout_id}"
    parent, trace = span_id(f"{ids}/rollout"), trace_id(ids)
    now = time.time_ns()
    first = tokens // 3
    calls = [
        (
            "turn 1",
            "LLM",
            rng.uniform(0.2, 1.5),
            {
                "gen_ai.request.model": "sim-policy",
                "gen_ai.usage.input_tokens": rng.randint(200, 800),
                "gen_ai.usage.output_tokens": first,
            },
        ),
        ("search", "TOOL", rng.uniform(0.05, 0.8), {"tool.name": "search", "tool.provider": "mcp"}),
        (
            "turn 2",
            "LLM",
            rng.uniform(0.2, 1.5),
            {
                "gen_ai.request.model": "sim-policy",
                "gen_ai.usage.input_tokens": rng.randint(800, 1600),
                "gen_ai.usage.output_tokens": tokens - first,
            },
        ),
    ]
    failed = rng.random() < 0.1  # now and then the tool errs and the second turn answers without it
    start = now - 3_000_000_000 - int(sum(c[2] for c in calls) * 1e9)
    took = now - start
    for k, (name, kind, seconds, attrs) in enumerate(calls):
        end = start + int(seconds * 1e9)
        error = failed and kind == "TOOL"
        tel.publish_span(
            {
                "time_ns": end,
                "trace_id": trace,
                "span_id": span_id(f"{ids}/child{k}"),
                "parent_span_id": parent,
                "name": name,
                "kind": kind,
                "start_time_ns": start,
                "end_time_ns": end,
                "status": "ERROR" if error else "OK",
                "status_message": "search backend timed out" if error else "",
                "rollout_id": rollout_id,
                "step": step,
                "attributes": attrs,
            }
        )
        truth.spans += 1
        start = end
    return took / 1e9 + 0.001  # the rollout call comes a moment after now


def _gpu_sample(tel: TrainingTelemetry, truth: GroundTruth, run_id: str, step: int, first_run: bool) -> None:
    """One export of a simulated GPU, as the poller publishes it (an XID and a slowdown on the first run)."""
    hw_id = f"GPU-sim-{run_id}"
    xid = first_run and step >= 1
    slowdown = first_run and step == 2
    sample = {
        "project": tel.project,
        "run_id": run_id,
        "attempt": 1,
        "time_ns": time.time_ns(),
        "hw_id": hw_id,
        "index": 0,
        "host": "sim-host",
        "node": "sim-node",
        "pod": "",
        "rank": 0,
        "role": "trainer",
        "power_w": 300.0 + 10 * step,
        "temperature_c": 60.0 + step,
        "gpu_utilization": 0.9,
        "memory_used_bytes": 60 << 30,
        "memory_total_bytes": 80 << 30,
        "memory_utilization": 0.75,
        "memory_activity": 0.4,
        "sm_clock_mhz": 1410.0,
        "throttle_reasons": 0x8 | 0x1 if slowdown else 0x0,
        "throttle_reason_names": gpu_health.throttle_reason_names(0x8 | 0x1 if slowdown else 0x0),
        "xid_errors": 1 if xid else 0,
        "xid_last": 79 if xid else None,
        "xid_class": gpu_health.xid_class(79) if xid else None,
        # what the poller reads where NVML has it (an H100's): energy as a counter, so per-step energy is exact
        "memory_reserved_bytes": 1 << 30,
        "energy_mj": 1_000_000 + step * 1_500_000,
        "tensor_activity": 0.35,
        "dram_activity": 0.5,
    }
    placement = {
        key: sample[key]
        for key in ("project", "run_id", "attempt", "time_ns", "role", "rank", "pod", "node", "host", "index", "hw_id")
    }
    for schema, record in (("GpuSample", sample), ("Placement", dict(placement, stage=""))):
        tel.publish_hardware(schema, hw_id, record)
    truth.gpu_samples += 1
    if first_run and step == 2:
        truth.expected_alerts |= {("xid", hw_id, "FIRING"), ("hw_slowdown", hw_id, "FIRING"), ("hw_slowdown", hw_id, "RESOLVED")}


def _silent_run(settings: Settings, config: SimConfig, rng: random.Random, truth: GroundTruth) -> None:
    run_id = f"{config.project}-silent"
    tel = TrainingTelemetry(
        project=config.project,
        run_id=run_id,
        attempt=1,
        trainer="rl",
        settings=dataclasses.replace(settings, heartbeat_interval=3600.0),
    )
    tel.start()
    truth.step_events += 1
    for i in range(config.rollouts_per_step):
        _one_rollout(tel, rng, truth, config, run_id, 0, i)
    tel.step_completed(step=0)
    truth.step_events += 1
    truth.undelivered += tel.abandon()
    truth.expected_alerts.add(("silent_run", f"{config.project}/{run_id}/1", "FIRING"))
