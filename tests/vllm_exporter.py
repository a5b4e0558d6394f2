"""A real ``prometheus_client`` exporter with vLLM's metric names, types and labels, on loopback.

The metrics are declared as vLLM declares them (``PrometheusStatLogger`` in module ``vllm.v1.metrics.loggers``:
gauges, counters and histograms with the labels ``model_name`` and ``engine``, the sleep state with
``sleep_state``, each histogram with vLLM's buckets, each series created per engine at start), plus a few
of the others vLLM exports, which the poller must read past. ``version`` picks the names:

* ``"0.33.0"`` (the default; read in the vllm 0.33.0 wheel, modules ``vllm.v1.metrics.loggers`` and
  ``vllm.v1.metrics.buckets``): ``kv_cache_usage_perc``, ``engine_sleep_state``, ``prefix_cache_queries`` /
  ``prefix_cache_hits``, ``request_queue_time_seconds``, ``inter_token_latency_seconds`` (and
  ``request_time_per_output_token_seconds``, a per-request figure, read past);
* ``"0.9.1"``: the names before the renames, ``gpu_cache_usage_perc``, ``gpu_prefix_cache_queries`` /
  ``gpu_prefix_cache_hits`` and ``time_per_output_token_seconds``, and no sleep state.

``prometheus_client.start_http_server`` serves them. :meth:`VllmExporter.restart` swaps in a fresh
registry, as a restarted server would count from zero. :meth:`VllmExporter.spoil` makes one sample of the
page read ``NaN``, ``+Inf`` or any value (a broken exporter, or a bit flipped on the way).

:class:`RayExporter` is one page for several replicas under the same ``engine`` label, as Ray's metrics
agent re-exports them: every name ``ray_vllm_...`` (``_`` for ``:``), every sample with the replica's
``ReplicaId`` and ``WorkerId``; :meth:`RayExporter.restart` restarts one replica (same labels, counting
from zero again).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

# vLLM's bucket families (vllm.v1.metrics.buckets in 0.33.0; the same lists inline in 0.9.1's vllm.v1.metrics.loggers)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]
LABELS = ["model_name", "engine"]
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
VERSIONS = ("0.33.0", "0.9.1")


class _Engines:
    """One registry's metrics for the engines of one server."""

    def __init__(self, model: str, engines: tuple[str, ...], version: str):
        if version not in VERSIONS:
            raise ValueError(f"version {version!r}: one of {VERSIONS}")
        old = version == "0.9.1"
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", LABELS, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", LABELS, registry=r)
        self.sleep = None if old else Gauge(
            "vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping.", LABELS + ["sleep_state"],
            registry=r)
        self.kv = Gauge("vllm:gpu_cache_usage_perc" if old else "vllm:kv_cache_usage_perc",
                        "KV-cache usage. 1 means 100 percent usage.", LABELS, registry=r)
        prefix = "vllm:gpu_prefix_cache" if old else "vllm:prefix_cache"
        self.prefix_queries = Counter(f"{prefix}_queries", "Prefix cache queries, in terms of number of queried tokens.",
                                      LABELS, registry=r)
        self.prefix_hits = Counter(f"{prefix}_hits", "Prefix cache hits, in terms of number of cached tokens.", LABELS,
                                   registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", LABELS,
                                   registry=r)
        self.prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r)
        self.generation = Counter("vllm:generation_tokens", "Number of generation tokens processed.", LABELS, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", LABELS,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = (Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                              LABELS, buckets=ITL_BUCKETS, registry=r) if old else
                    Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", LABELS,
                              buckets=ITL_BUCKETS, registry=r))
        self.queue = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                               LABELS, buckets=LATENCY_BUCKETS, registry=r)
        # Others vLLM exports, which the poller reads past.
        success = Counter("vllm:request_success", "Count of successfully processed requests.", LABELS + ["finished_reason"],
                          registry=r)
        others = [Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LABELS,
                            buckets=LATENCY_BUCKETS, registry=r)]
        if not old:
            others.append(Histogram("vllm:request_time_per_output_token_seconds",
                                    "Histogram of time_per_output_token_seconds per request.", LABELS,
                                    buckets=ITL_BUCKETS, registry=r))
        metrics = [self.running, self.waiting, self.kv, self.prefix_queries, self.prefix_hits, self.preemptions,
                   self.prompt, self.generation, self.ttft, self.itl, self.queue, *others]
        for engine in engines:  # vLLM makes every series of every engine at start (create_metric_per_engine)
            for metric in metrics:
                metric.labels(model, engine)
            for state in SLEEP_STATES if self.sleep is not None else ():
                self.sleep.labels(model, engine, state).set(1 if state == "awake" else 0)
            success.labels(model, engine, "stop").inc(3)
            for other in others:
                other.labels(model, engine).observe(1.2)  # a histogram with observations, read past

    def set(self, model: str, engine: str, running: float | None, waiting: float | None, kv: float | None) -> None:
        for gauge, value in ((self.running, running), (self.waiting, waiting), (self.kv, kv)):
            if value is not None:
                gauge.labels(model, engine).set(value)

    def serve(self, model: str, engine: str, *, prompt: int = 0, generation: int = 0, preemptions: int = 0,
              ttft: tuple[float, ...] = (), queued: tuple[float, ...] = (), itl: tuple[float, ...] = (),
              prefix_queries: int = 0, prefix_hits: int = 0) -> None:
        self.prompt.labels(model, engine).inc(prompt)
        self.generation.labels(model, engine).inc(generation)
        self.preemptions.labels(model, engine).inc(preemptions)
        self.prefix_queries.labels(model, engine).inc(prefix_queries)
        self.prefix_hits.labels(model, engine).inc(prefix_hits)
        for histogram, values in ((self.ttft, ttft), (self.queue, queued), (self.itl, itl)):
            for seconds in values:
                histogram.labels(model, engine).observe(seconds)


Spoiled = dict[tuple[str, str, str | None], float]  # (sample name, engine, le) -> the value served instead


def _rewrite(families: Iterable[Metric], spoiled: Spoiled, rename: bool = False,
             labels: dict[str, str] | None = None) -> list[Metric]:
    """``families`` with the spoiled samples' values replaced, and (Ray) renamed and relabelled."""
    def name(n: str) -> str:
        return "ray_vllm_" + n[len("vllm:"):] if rename and n.startswith("vllm:") else n

    out = []
    for family in families:
        copy = Metric(name(family.name), family.documentation, family.type)
        for sample in family.samples:
            value = spoiled.get((sample.name, sample.labels.get("engine", ""), sample.labels.get("le")), sample.value)
            copy.add_sample(name(sample.name), {**sample.labels, **(labels or {})}, value, sample.timestamp)
        out.append(copy)
    return out


class _Current(Collector):
    def __init__(self, exporter: VllmExporter):
        self.exporter = exporter

    def collect(self) -> Any:
        return _rewrite(self.exporter.metrics.registry.collect(), self.exporter.spoiled)


class VllmExporter:
    """``with VllmExporter() as vllm: vllm.url``; the metric objects are ``vllm.metrics.<name>``."""

    def __init__(self, model: str = "Qwen/Qwen2.5-0.5B", engines: tuple[str, ...] = ("0",), version: str = "0.33.0"):
        self.model, self.engines, self.version = model, engines, version
        self.metrics = _Engines(model, engines, version)
        self.spoiled: Spoiled = {}
        outer = CollectorRegistry()
        outer.register(_Current(self))
        self._server, self._thread = start_http_server(0, addr="127.0.0.1", registry=outer)
        self.url = f"http://127.0.0.1:{self._server.server_port}/metrics"

    def set(self, engine: str = "0", *, running: float | None = None, waiting: float | None = None,
            kv: float | None = None) -> None:
        self.metrics.set(self.model, engine, running, waiting, kv)

    def serve(self, engine: str = "0", *, prompt: int = 0, generation: int = 0, preemptions: int = 0,
              ttft: tuple[float, ...] = (), queued: tuple[float, ...] = (), itl: tuple[float, ...] = (),
              prefix_queries: int = 0, prefix_hits: int = 0) -> None:
        """Counters rise and latencies are observed, as requests are served: ``queued`` the finished
        requests' times waiting, ``itl`` the gaps between tokens, ``prefix_*`` tokens looked up and found."""
        self.metrics.serve(self.model, engine, prompt=prompt, generation=generation, preemptions=preemptions, ttft=ttft,
                           queued=queued, itl=itl, prefix_queries=prefix_queries, prefix_hits=prefix_hits)

    def spoil(self, sample: str, value: float = math.nan, *, engine: str = "0", le: str | None = None) -> None:
        """Serve ``value`` for the sample ``sample`` (its wire name, e.g. ``vllm:time_to_first_token_seconds_bucket``,
        ``le`` its bound as written: ``"0.5"``, ``"+Inf"``) of ``engine`` until :meth:`unspoil`."""
        self.spoiled[(sample, engine, le)] = value

    def unspoil(self) -> None:
        self.spoiled.clear()

    def sleep(self, engine: str = "0", level: int = 1) -> None:
        """vLLM's sleep mode (the actor updates): awake 0, weights_offloaded (1) or discard_all (2) 1."""
        assert self.metrics.sleep is not None, "vLLM 0.9.1 exports no sleep state"
        for state in SLEEP_STATES:
            on = state == ("weights_offloaded" if level == 1 else "discard_all")
            self.metrics.sleep.labels(self.model, engine, state).set(1 if on else 0)

    def wake(self, engine: str = "0") -> None:
        assert self.metrics.sleep is not None, "vLLM 0.9.1 exports no sleep state"
        for state in SLEEP_STATES:
            self.metrics.sleep.labels(self.model, engine, state).set(1 if state == "awake" else 0)

    def restart(self) -> None:
        """The server restarted: every counter and histogram counts from zero again."""
        self.metrics = _Engines(self.model, self.engines, self.version)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> VllmExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Replicas(Collector):
    def __init__(self, exporter: RayExporter):
        self.exporter = exporter

    def collect(self) -> Any:
        merged: dict[str, Metric] = {}
        for replica, metrics in self.exporter.replicas.items():
            for family in _rewrite(metrics.registry.collect(), self.exporter.spoiled.get(replica, {}), rename=True,
                                   labels={"ReplicaId": replica, "WorkerId": f"worker-{replica}"}):
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        return list(merged.values())


class RayExporter:
    """Several vLLM replicas under one ``engine`` label on one page, as Ray's metrics agent serves them."""

    def __init__(self, replicas: tuple[str, ...] = ("1", "2"), model: str = "Qwen/Qwen2.5-0.5B",
                 engines: tuple[str, ...] = ("0",)):
        self.model, self.engines = model, engines
        self.replicas = {r: _Engines(model, engines, "0.33.0") for r in replicas}
        self.spoiled: dict[str, Spoiled] = {}  # replica -> its spoiled samples
        outer = CollectorRegistry()
        outer.register(_Replicas(self))
        self._server, self._thread = start_http_server(0, addr="127.0.0.1", registry=outer)
        self.url = f"http://127.0.0.1:{self._server.server_port}/metrics"

    def set(self, replica: str, engine: str = "0", *, running: float | None = None, waiting: float | None = None,
            kv: float | None = None) -> None:
        self.replicas[replica].set(self.model, engine, running, waiting, kv)

    def serve(self, replica: str, engine: str = "0", **served: Any) -> None:
        """As :meth:`VllmExporter.serve`, on one replica."""
        self.replicas[replica].serve(self.model, engine, **served)

    def spoil(self, replica: str, sample: str, value: float = math.nan, *, engine: str = "0", le: str | None = None) -> None:
        """As :meth:`VllmExporter.spoil`, on one replica (``sample`` by vLLM's name, ``vllm:...``)."""
        self.spoiled.setdefault(replica, {})[(sample, engine, le)] = value

    def unspoil(self) -> None:
        self.spoiled.clear()

    def restart(self, replica: str) -> None:
        """One replica restarted, under the same labels: its counters and histograms count from zero again."""
        self.replicas[replica] = _Engines(self.model, self.engines, "0.33.0")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> RayExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def histogram_quantile(q: float, observed: list[float], bounds: list[float]) -> float | None:
    """The truth a test expects: Prometheus's ``histogram_quantile`` over the buckets ``bounds`` (and +Inf)
    filled with the raw ``observed`` values, written here from its definition, not from the poller's code:
    the rank ``q * n`` falls in the first bucket whose cumulative count reaches it, linearly within it,
    the first bucket starting at 0; a rank past the largest bound is that bound."""
    n = len(observed)
    if n == 0:
        return None
    rank, lower, below = q * n, 0.0, 0
    for upper in bounds:
        inside = sum(1 for x in observed if lower < x <= upper) if lower > 0 else sum(1 for x in observed if x <= upper)
        if below + inside >= rank:
            return upper if inside == 0 else lower + (upper - lower) * (rank - below) / inside
        lower, below = upper, below + inside
    return bounds[-1]
