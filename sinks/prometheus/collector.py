"""Metric families from one scrape's rows, and the scrape cache: a flood of scrapes costs one query set.

``families`` turns :class:`rlpulse.sinks.prometheus.figures.Rows` into prometheus_client metric
families (names from ``names``); ``Scraper`` runs the queries at most once per ``cache_s`` (one
scrape at a time: the others wait for it and get its answer) and renders them with
``generate_latest``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from rlpulse.sinks.prometheus import names as n
from rlpulse.sinks.prometheus.buckets import MAX_BUCKETS, ExpHistogram, exponential_to_classic, fixed_to_classic, merge
from rlpulse.sinks.prometheus.figures import Rows, Scope, read
from rlpulse.sinks.store.clickhouse import Store

log = logging.getLogger(__name__)

CACHE_S = 1.0
RUN = list(n.RUN_LABELS)
TRAINER_COUNTERS = {"rl": n.RL_STEP_COUNT, "sft": n.SFT_STEP_COUNT}  # seed 001 has no counter for other trainers


class _Family:
    """A family that keeps the first sample of each label set (two would be a duplicate series)."""

    def __init__(self, metric: Metric):
        self.metric: Any = metric  # a *MetricFamily: each has its own add_metric
        self.seen: set[tuple[str, ...]] = set()

    def add(self, labels: Sequence[Any], *args: Any, **kwargs: Any) -> None:
        values = tuple("" if v is None else str(v) for v in labels)
        if values not in self.seen:
            self.seen.add(values)
            self.metric.add_metric(list(values), *args, **kwargs)


def _gauge(name: str, doc: str, labels: list[str]) -> _Family:
    return _Family(GaugeMetricFamily(name, doc, labels=labels))


def _finite(x: Any) -> bool:
    return x is not None and math.isfinite(float(x))


def _buckets(pairs: list[tuple[float, int]]) -> list[tuple[str, float]]:
    return [(floatToGoString(le), float(c)) for le, c in pairs]


def families(rows: Rows, scrape_s: float = 0.0) -> list[Metric]:
    """The metric families of one scrape (docs/prometheus.md lists each name and label)."""
    t = rows.tables
    out: list[_Family] = []

    def add(f: _Family) -> _Family:
        out.append(f)
        return f

    steps = {k: add(_Family(CounterMetricFamily(name, f"completed {k.upper()} steps of the attempt (seed 001 "
                                                f"akka_optimize_training_{k}_step_count_total)", labels=RUN)))
             for k, name in TRAINER_COUNTERS.items()}
    for project, run_id, attempt, trainer, step_count, _ in t["runs"]:
        if trainer in steps and step_count >= 1:  # seed 001: no series before the first completed step
            steps[trainer].add((project, run_id, attempt), float(step_count))

    tokens = add(_gauge(n.STEP_TOKENS, "tokens the latest step processed", RUN))
    throughput = add(_gauge(n.STEP_THROUGHPUT, "tokens per second of the latest step", RUN))
    mfu = add(_gauge(n.STEP_MFU, "model FLOPs utilization of the latest step's policy update, 0 to 1", RUN))
    for project, run_id, attempt, (tok, tps, m) in t["latest_step"]:
        key = (project, run_id, attempt)
        tokens.add(key, float(tok))
        if _finite(tps) and tps >= 0:
            throughput.add(key, float(tps))
        if _finite(m) and 0 <= m <= 1:  # as step-throughput.sql: an MFU outside [0, 1] is not one
            mfu.add(key, float(m))

    clipped = add(_gauge(n.CLIPPED_RATIO, "share of the latest step's completions truncated at the maximum length", RUN))
    for project, run_id, attempt, ratio in t["clipped"]:
        clipped.add((project, run_id, attempt), float(ratio))

    failures = add(_Family(CounterMetricFamily(n.GRADER_FAILURES, "grader scores that failed, by term and cause",
                                               labels=[*RUN, n.RL_TERM, n.FAILURE_CAUSE])))
    for project, run_id, attempt, term, cause, count in t["failures"]:
        failures.add((project, run_id, attempt, term, cause), float(count))

    reward = add(_Family(HistogramMetricFamily(n.ROLLOUT_REWARD, "reward of each rollout (term total) and each term's "
                                               "weighted share, over the attempt's steps", labels=[*RUN, n.RL_TERM])))
    for project, run_id, attempt, term, bounds, counts, count, total in t["rewards"]:
        reward.add((project, run_id, attempt, term), buckets=_buckets(fixed_to_classic(bounds, counts, count)),
                   sum_value=float(total))

    length = add(_Family(HistogramMetricFamily(n.COMPLETION_LENGTH, "completion length in tokens over the attempt's "
                                               "steps (exponential buckets as classic le buckets)", labels=RUN)))
    for project, run_id, attempt, scale, zeros, count, total, pairs in t["lengths"]:
        h = _exp(scale, zeros, count, total, pairs)
        length.add((project, run_id, attempt), buckets=_buckets(exponential_to_classic(h)), sum_value=float(total))

    placement = add(_gauge(n.JOB_PLACEMENT, "1 for each GPU (hw_id) a run's worker holds",
                           [*RUN, n.JOB_ROLE, n.JOB_RANK, n.HW_ID, "pod", "node"]))
    for project, run_id, attempt, role, rank, hw_id, (pod, node) in t["placements"]:
        placement.add((project, run_id, attempt, role, rank, hw_id, pod, node), 1.0)

    _gpus(t["gpus"], add)
    _engines(t["engines"], add)
    _capacity(t["capacity"], add)

    firing = add(_gauge(n.ALERT_FIRING, "1 for each alert whose latest state is FIRING",
                        ["rule", "key", "severity", *RUN]))
    for rule, key, severity, project, run_id, attempt, _ in t["alerts"]:
        firing.add((rule, key, severity, project, run_id, attempt if run_id else ""), 1.0)

    dropped = add(_gauge(n.SERIES_DROPPED, "keys left out of this scrape by a cap (runs: --max-runs, newest first), "
                         "with every series of each", ["what"]))
    for what, count in sorted(rows.dropped.items()):
        dropped.add((what,), float(count))
    seconds = add(_gauge(n.SCRAPE_SECONDS, "seconds the queries of the last scrape took", []))
    seconds.add((), scrape_s)
    return [f.metric for f in out]


def _exp(scale: int, zeros: int, count: int, total: float, pairs: list[tuple[int, int]]) -> ExpHistogram:
    """The merged histogram the lengths query gives (buckets at ``scale``), downscaled to MAX_BUCKETS buckets."""
    h = ExpHistogram(int(scale), int(zeros), count=int(count), sum=float(total))
    if pairs:
        # downscale the sparse pairs first: steps far apart (offsets -2^31 and 2^31) would make the
        # dense list 2^32 long before merge() could narrow it
        lo, hi, k = int(pairs[0][0]), int(pairs[-1][0]), 0
        while (hi >> k) - (lo >> k) >= MAX_BUCKETS:
            k += 1
        h.scale, h.offset = h.scale - k, lo >> k
        h.counts = [0] * ((hi >> k) - h.offset + 1)
        for idx, c in pairs:
            h.counts[(int(idx) >> k) - h.offset] += int(c)
    merged = merge([h])
    assert merged is not None
    return merged


def _gpus(rows: list[tuple], add: Callable[[_Family], _Family]) -> None:
    labels = [n.HW_ID, *RUN]
    specs = [(n.HW_POWER, "power draw, W (mean since the previous export)", 3),
             (n.HW_TEMPERATURE, "temperature, °C", 4),
             (n.HW_GPU_UTILIZATION, "GPU utilization, 0 to 1", 5),
             (n.HW_GPU_MEMORY_USAGE, "memory in use, bytes", 6),
             (n.HW_GPU_MEMORY_UTILIZATION, "fraction of the memory in use", 7),
             (n.GPU_MEMORY_ACTIVITY, "fraction of time the memory was read or written", 8),
             (n.GPU_THROTTLE_REASONS, "bitmask of NVML's clock event reasons (0x8: hardware slowdown)", 9),
             (n.GPU_XID_LAST, "code of the latest XID", 11)]
    gauges = [(add(_gauge(name, doc, labels)), i) for name, doc, i in specs]
    xids = add(_Family(CounterMetricFamily(n.GPU_XID_ERRORS, "XIDs seen on the GPU", labels=labels)))
    for hw_id, last, _ in rows:
        project, run_id, attempt = last[0], last[1], last[2]
        key = (hw_id, project, run_id, attempt if run_id else "")
        for family, i in gauges:
            if _finite(last[i]):
                family.add(key, float(last[i]))
        xids.add(key, float(last[10]))


def _engines(rows: list[tuple], add: Callable[[_Family], _Family]) -> None:
    labels = [*RUN, "pod", "engine", "model_name"]
    kv = add(_gauge(n.VLLM_KV_CACHE_USAGE, "vLLM's KV-cache usage, 0 to 1 (the latest sample)", labels))
    running = add(_gauge(n.VLLM_REQUESTS_RUNNING, "requests running on the engine", labels))
    waiting = add(_gauge(n.VLLM_REQUESTS_WAITING, "requests waiting on the engine", labels))
    sleep = add(_gauge(n.VLLM_SLEEP_STATE, "1 while the engine is in sleep_state (awake)", [*labels, "sleep_state"]))
    for project, run_id, attempt, pod, url, engine, (model, run_n, wait_n, kv_usage, awake), _ in rows:
        key = (project, run_id, attempt if run_id else "", pod or url, engine, model)
        for family, value in ((kv, kv_usage), (running, run_n), (waiting, wait_n)):
            if _finite(value):
                family.add(key, float(value))
        if awake is not None:
            sleep.add((*key, "awake"), float(awake))


def _capacity(rows: list[tuple], add: Callable[[_Family], _Family]) -> None:
    pool = [n.POOL, n.POOL_SERVING, n.POOL_ACCELERATOR, n.INSTANCE]
    declared = add(_gauge(n.POOL_DEVICES_DECLARED, "devices the pool declares", pool))
    observed = add(_gauge(n.POOL_DEVICES_OBSERVED, "devices the service observed in the cluster", pool))
    claimed = add(_gauge(n.POOL_DEVICES_CLAIMED, "devices on the pool that claims hold (GRANTED) or wait for (QUEUED)",
                         [*pool, n.CLAIM_STATE]))
    claims = add(_gauge(n.POOL_CLAIMS, "claims on the pool, by claim state", [*pool, n.CLAIM_STATE]))
    project_claimed = add(_gauge(n.PROJECT_DEVICES_CLAIMED, "devices the project's claims hold or wait for",
                                 [n.PROJECT, n.POOL, n.CLAIM_STATE, n.INSTANCE]))
    quota = add(_gauge(n.PROJECT_DEVICES_QUOTA, "the project's quota", [n.PROJECT, n.POOL, n.INSTANCE]))
    for pool_name, project, instance, last, _ in rows:
        serving, accelerator, dec, obs, granted, queued, c_granted, c_queued, q = last
        if not project:
            key = (pool_name, str(bool(serving)).lower(), accelerator, instance)
            for family, value in ((declared, dec), (observed, obs)):
                if value is not None:
                    family.add(key, float(value))
            for state, dev, cl in (("GRANTED", granted, c_granted), ("QUEUED", queued, c_queued)):
                if dev is not None:
                    claimed.add((*key, state), float(dev))
                if cl is not None:
                    claims.add((*key, state), float(cl))
        else:
            for state, dev in (("GRANTED", granted), ("QUEUED", queued)):
                if dev is not None:
                    project_claimed.add((project, pool_name, state, instance), float(dev))
            if q is not None:
                quota.add((project, pool_name, instance), float(q))


class _Served:
    """The collector handed to the registry: the families built for one scrape."""

    def __init__(self, metrics: list[Metric]):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self.metrics)


def render(rows: Rows, scrape_s: float = 0.0) -> bytes:
    """The Prometheus text exposition of ``rows``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Served(families(rows, scrape_s)))  # type: ignore[arg-type]
    return generate_latest(registry)


class Scraper:
    """Answers scrapes: the queries run at most once per ``cache_s``, one scrape at a time."""

    def __init__(self, opener: Callable[[], Store], scope: Scope, cache_s: float = CACHE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.opener, self.scope, self.cache_s, self.clock = opener, scope, cache_s, clock
        self._lock = threading.Lock()
        self._cached: tuple[float, bytes] | None = None
        self.query_sets = 0  # how many times the queries ran (tests, logs)

    def scrape(self) -> bytes:
        """The exposition, from the cache when younger than ``cache_s``. Waits at most the query time limit
        for another scrape's queries; raises what opening or querying the store raised."""
        if not self._lock.acquire(timeout=self.scope.timeout_s + 5):
            raise TimeoutError("another scrape has been reading the store for longer than the query time limit")
        try:
            now = self.clock()
            if self._cached is not None and now - self._cached[0] < self.cache_s:
                return self._cached[1]
            started = time.monotonic()
            with self.opener() as store:
                rows = read(store.client, store.database, self.scope)
            took = time.monotonic() - started
            self.query_sets += 1
            body = render(rows, took)
            self._cached = (self.clock(), body)
            return body
        finally:
            self._lock.release()
