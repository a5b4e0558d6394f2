"""Prometheus names of rlpulse's figures: seed 001's names with ``rlpulse`` in place of ``akka_optimize_training``.

Seed 001 names its OpenTelemetry metrics ``akka.optimize.training.*`` and its resource attributes
likewise; a Collector's Prometheus translation turns dots into underscores and adds ``_total`` to
counters. rlpulse serves the same names with the prefix ``rlpulse``, so the seed's PromQL works once
the prefix is swapped. Names the OpenTelemetry hardware conventions define (``hw.*``) keep no prefix,
as in the seed; vLLM's own metrics (``ray_vllm_*`` in the seed's cluster) are ``rlpulse_vllm_*``.
"""

from __future__ import annotations

import re

PREFIX = "rlpulse"
SEED_PREFIX = "akka.optimize.training"

# Label names (seed 001's attributes, translated).
PROJECT = f"{PREFIX}_project"
RUN_ID = f"{PREFIX}_run_id"
RUN_ATTEMPT = f"{PREFIX}_run_attempt"
JOB_ROLE = f"{PREFIX}_job_role"
JOB_RANK = f"{PREFIX}_job_rank"
RL_TERM = f"{PREFIX}_rl_term"
FAILURE_CAUSE = f"{PREFIX}_rl_grader_failure_cause"
CLAIM_STATE = f"{PREFIX}_claim_state"
INSTANCE = f"{PREFIX}_instance"
POOL = f"{PREFIX}_pool"
POOL_SERVING = f"{PREFIX}_pool_serving"
POOL_ACCELERATOR = f"{PREFIX}_pool_accelerator"
HW_ID = "hw_id"
RUN_LABELS = (PROJECT, RUN_ID, RUN_ATTEMPT)

_INVALID = re.compile(r"[^a-zA-Z0-9_:]")


def prometheus_name(otel_name: str) -> str:
    """The Prometheus name of a seed-001 metric or attribute: ``akka.optimize.training.rl.step.count`` ->
    ``rlpulse_rl_step_count``; ``hw.power`` -> ``hw_power``. Counters get ``_total`` from prometheus_client."""
    name = otel_name.strip()
    if not name:
        raise ValueError("a metric or attribute name is empty")
    if name == SEED_PREFIX or name.startswith(SEED_PREFIX + "."):
        name = PREFIX + name[len(SEED_PREFIX):]
    name = _INVALID.sub("_", name.replace(".", "_"))
    return "_" + name if name[0].isdigit() else name


# Metric names, each from its seed-001 name (the docs' names table lists them).
RL_STEP_COUNT = prometheus_name("akka.optimize.training.rl.step.count")  # counter: rlpulse_rl_step_count_total
SFT_STEP_COUNT = prometheus_name("akka.optimize.training.sft.step.count")
GRADER_FAILURES = prometheus_name("akka.optimize.training.rl.grader.failures")  # counter
ROLLOUT_REWARD = prometheus_name("akka.optimize.training.rl.rollout.reward")  # histogram
COMPLETION_LENGTH = prometheus_name("akka.optimize.training.rl.rollout.completion.length")  # histogram
CLIPPED_RATIO = prometheus_name("akka.optimize.training.rl.step.completion.clipped_ratio")
STEP_TOKENS = prometheus_name("akka.optimize.training.rl.step.tokens")
STEP_THROUGHPUT = prometheus_name("akka.optimize.training.rl.step.throughput")
STEP_MFU = prometheus_name("akka.optimize.training.rl.step.mfu")
JOB_PLACEMENT = prometheus_name("akka.optimize.training.job.placement")
HW_POWER = prometheus_name("hw.power")
HW_TEMPERATURE = prometheus_name("hw.temperature")
HW_GPU_UTILIZATION = prometheus_name("hw.gpu.utilization")
HW_GPU_MEMORY_USAGE = prometheus_name("hw.gpu.memory.usage")
HW_GPU_MEMORY_UTILIZATION = prometheus_name("hw.gpu.memory.utilization")
GPU_MEMORY_ACTIVITY = prometheus_name("akka.optimize.training.gpu.memory.activity")
GPU_THROTTLE_REASONS = prometheus_name("akka.optimize.training.gpu.clock.throttle_reasons")
GPU_XID_ERRORS = prometheus_name("akka.optimize.training.gpu.xid.errors")  # counter
GPU_XID_LAST = prometheus_name("akka.optimize.training.gpu.xid.last")
POOL_DEVICES_DECLARED = prometheus_name("akka.optimize.training.pool.devices.declared")
POOL_DEVICES_OBSERVED = prometheus_name("akka.optimize.training.pool.devices.observed")
POOL_DEVICES_CLAIMED = prometheus_name("akka.optimize.training.pool.devices.claimed")
POOL_CLAIMS = prometheus_name("akka.optimize.training.pool.claims")
PROJECT_DEVICES_CLAIMED = prometheus_name("akka.optimize.training.project.devices.claimed")
PROJECT_DEVICES_QUOTA = prometheus_name("akka.optimize.training.project.devices.quota")


def vllm_name(vllm_metric: str) -> str:
    """vLLM's ``vllm:kv_cache_usage_perc`` as rlpulse serves it: ``rlpulse_vllm_kv_cache_usage_perc``
    (the seed's cluster names it ``ray_vllm_kv_cache_usage_perc``)."""
    if not vllm_metric.startswith("vllm:"):
        raise ValueError(f"not a vLLM metric name: {vllm_metric!r}")
    return f"{PREFIX}_{prometheus_name(vllm_metric.replace(':', '_', 1))}"


VLLM_KV_CACHE_USAGE = vllm_name("vllm:kv_cache_usage_perc")
VLLM_REQUESTS_RUNNING = vllm_name("vllm:num_requests_running")
VLLM_REQUESTS_WAITING = vllm_name("vllm:num_requests_waiting")
VLLM_SLEEP_STATE = vllm_name("vllm:engine_sleep_state")

# rlpulse's own figures (no seed name).
ALERT_FIRING = f"{PREFIX}_alert_firing"
SERIES_DROPPED = f"{PREFIX}_prometheus_series_dropped"
SCRAPE_SECONDS = f"{PREFIX}_prometheus_scrape_duration_seconds"
