"""Simulated rollout engines and capacity gauges for the demo and tests: deterministic records on
the hardware topic, through the same Sender and record types as ``rlpulse engine-poller`` and
:class:`rlpulse.producers.pollers.capacity.CapacityReporter`.

* :func:`simulate_engine`: one vLLM engine of a run, ``samples`` scrapes ``interval_s`` apart in
  event time from ``start_ns``: a saturation episode (requests waiting, KV cache at 0.97, requests
  queueing for seconds, a lower prefix-cache hit rate, slower tokens) and a sleep/wake cycle
  (awake 1 -> 0 -> 1, as while the actor updates), tokens flowing while awake.
  With the defaults the episode lasts 135 s of event time, longer than the default
  ``RLPULSE_ALERT_ENGINE_SATURATED_AFTER`` (120 s): ``engine_saturated`` fires and resolves once.
* :func:`simulate_engine_during`: the same samples spread over a run's life, so each of its steps
  has some (the demo's engine).
* :func:`simulate_capacity`: two pools (a training pool and the serving pool) reported by two
  service instances; the serving pool's last claim ends in the last report, so it reads 0 and
  stays listed.
"""

from __future__ import annotations

import time
from typing import Any
from collections.abc import Callable

from rlpulse.producers.pollers.capacity import CapacityReporter, PoolCapacity, ProjectCapacity
from rlpulse.producers.sdk.sender import Outgoing, Sender
from rlpulse.schemas.catalogue import engine_key
from rlpulse.base.settings import Settings

NS = 1_000_000_000
INSTANCES = ("trainer-svc-0", "trainer-svc-1")


def engine_records(project: str, run_id: str, attempt: int = 1, *, start_ns: int, samples: int = 40,
                   interval_s: float = 5.0, pod: str = "sim-rollout-0", engine: str = "0",
                   saturated: tuple[int, int] = (10, 38), asleep: tuple[int, int] = (3, 6)) -> list[dict[str, Any]]:
    """The EngineSample records of one simulated engine; ``saturated`` and ``asleep`` are sample
    index ranges [first, end). Asleep wins: a sleeping engine has freed its KV cache."""
    out = []
    url = f"http://{pod}:8000/metrics"
    for i in range(samples):
        sleeping = asleep[0] <= i < asleep[1]
        full = saturated[0] <= i < saturated[1] and not sleeping
        out.append({
            "project": project, "run_id": run_id, "attempt": attempt, "pod": pod, "url": url, "engine": engine,
            "model_name": "sim-model", "time_ns": start_ns + int(i * interval_s * NS),
            "interval_s": interval_s if i else None,
            "requests_running": 0.0 if sleeping else (64.0 if full else 24.0 + i % 8),
            "requests_waiting": 0.0 if sleeping else (12.0 + i % 5 if full else 0.0),
            "kv_cache_usage": 0.0 if sleeping else (0.97 if full else round(0.4 + 0.01 * (i % 10), 2)),
            "preemptions_per_s": None if not i else (0.4 if full else 0.0),
            "prompt_tokens_per_s": None if not i else (0.0 if sleeping else 2400.0 + 10 * (i % 7)),
            "generation_tokens_per_s": None if not i else (0.0 if sleeping else 1800.0 + 10 * (i % 5)),
            "ttft_count": None if not i else (0 if sleeping else 40),
            "ttft_p50_s": None if not i or sleeping else (0.9 if full else 0.12),
            "ttft_p90_s": None if not i or sleeping else (2.1 if full else 0.3),
            "ttft_p99_s": None if not i or sleeping else (4.5 if full else 0.6),
            "awake": 0 if sleeping else 1,
            "counter_resets": 0,
            # GRPO's group of completions shares one prompt: most prompt tokens are found in the prefix cache
            "prefix_cache_queries": None if not i else (0 if sleeping else 12000),
            "prefix_cache_hit_rate": None if not i or sleeping else (0.6 if full else 0.85),
            "queue_time_count": None if not i else (0 if sleeping else 8),
            "queue_time_mean_s": None if not i or sleeping else (3.2 if full else 0.05),
            "queue_time_p50_s": None if not i or sleeping else (2.4 if full else 0.04),
            "queue_time_p90_s": None if not i or sleeping else (7.0 if full else 0.12),
            "itl_count": None if not i else (0 if sleeping else 9000),
            "itl_mean_s": None if not i or sleeping else (0.045 if full else 0.022),
            "itl_p50_s": None if not i or sleeping else (0.04 if full else 0.02),
            "itl_p90_s": None if not i or sleeping else (0.09 if full else 0.035),
        })
    return out


def simulate_engine(settings: Settings, project: str, run_id: str, attempt: int = 1, *, start_ns: int | None = None,
                    samples: int = 40, interval_s: float = 5.0, pod: str = "sim-rollout-0",
                    sender: Sender | None = None) -> list[dict[str, Any]]:
    """Publish :func:`engine_records` (default start: ``samples`` intervals before now) and wait for
    delivery; returns the records. ``sender``: one to share, else one of its own, closed here."""
    start = start_ns if start_ns is not None else time.time_ns() - int(samples * interval_s * NS)
    records = engine_records(project, run_id, attempt, start_ns=start, samples=samples, interval_s=interval_s, pod=pod)
    own = sender is None
    sender = sender or Sender(settings)
    if own:
        sender.start()
    topic = settings.topic("hardware")
    for record in records:
        sender.offer(Outgoing(topic, engine_key(record["pod"], record["url"], record["engine"]), "EngineSample", record))
    if own:
        sender.close(60.0)
    else:
        sender.flush(60.0)
    return records


def simulate_engine_during(settings: Settings, project: str, run_id: str, first_ns: int, last_ns: int, attempt: int = 1,
                           *, samples: int = 40, sender: Sender | None = None) -> list[dict[str, Any]]:
    """:func:`simulate_engine` with its samples spread evenly over ``(first_ns, last_ns)``, a run's
    life from its RUN_START to its last STEP event: each step of the run then has samples (the saved
    query engine-by-step places a sample in the step whose span holds its time). The saturation
    episode lasts about two thirds of that span, in event time."""
    interval_s = (last_ns - first_ns) / (samples + 1) / NS
    return simulate_engine(settings, project, run_id, attempt, start_ns=first_ns + int(interval_s * NS), samples=samples,
                           interval_s=interval_s, sender=sender)


def capacity_reports(project: str = "sim") -> list[tuple[list[PoolCapacity], list[ProjectCapacity]]]:
    """Three reports of two pools; the serving pool's claim ends before the third (left out of it)."""
    def train(observed: int | None, granted: int, queued: int, claims: int, waiting: int) -> PoolCapacity:
        return PoolCapacity("train-h100", 64, observed, granted, queued, claims, waiting, accelerator="h100")

    serve = PoolCapacity("serve-a100", 16, 16, granted=8, claims_granted=1, serving=True, accelerator="a100")
    return [
        ([train(None, 32, 16, 4, 2), serve], [ProjectCapacity(project, "train-h100", granted=32, queued=16, quota=48)]),
        ([train(62, 48, 0, 6, 0), serve], [ProjectCapacity(project, "train-h100", granted=48, quota=48)]),
        ([train(62, 40, 0, 5, 0)], [ProjectCapacity(project, "train-h100", granted=40, quota=48)]),
    ]


def _clock(start_ns: int, step_s: float) -> Callable[[], int]:
    """Report times: start_ns, then one every step_s."""
    times = iter(range(1 << 30))
    return lambda: start_ns + int(next(times) * step_s * NS)


def simulate_capacity(settings: Settings, *, project: str = "sim", instances: tuple[str, ...] = INSTANCES,
                      sender: Sender | None = None, start_ns: int | None = None, step_s: float = 15.0) -> int:
    """Each instance publishes :func:`capacity_reports` (the same figures, as every instance of the
    service does), ``step_s`` apart in event time from ``start_ns`` (default: so the last report is
    now); returns the records published."""
    reports = capacity_reports(project)
    start = start_ns if start_ns is not None else time.time_ns() - int((len(reports) - 1) * step_s * NS)
    own = sender is None
    sender = sender or Sender(settings)
    if own:
        sender.start()
    published = 0
    for instance in instances:
        reporter = CapacityReporter(settings, instance, sender=sender, clock=_clock(start, step_s))
        for pools, projects in reports:
            published += reporter.report(pools, projects)
    if own:
        sender.close(60.0)
    else:
        sender.flush(60.0)
    return published
