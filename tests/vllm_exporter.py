"""A real ``prometheus_client`` exporter with vLLM's metric names, types and labels, on loopback.

The metrics are declared as vLLM declares them (``PrometheusStatLogger`` of its v1 metrics: gauges, counters
and histograms with the labels ``model_name`` and ``engine``, the sleep state with ``sleep_state``,
the TTFT histogram with vLLM's buckets, each series created per engine at start), plus a few of the
others vLLM exports, which the poller must read past. ``prometheus_client.start_http_server`` serves
them. :meth:`VllmExporter.restart` swaps in a fresh registry, as a restarted server would count
from zero.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.registry import Collector

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0]
LABELS = ["model_name", "engine"]
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


class _Engines:
    """One registry's metrics for the engines of one server."""

    def __init__(self, model: str, engines: tuple[str, ...]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", LABELS, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", LABELS, registry=r)
        self.sleep = Gauge("vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping.",
                           LABELS + ["sleep_state"], registry=r)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", LABELS, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", LABELS,
                                   registry=r)
        self.prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r)
        self.generation = Counter("vllm:generation_tokens", "Number of generation tokens processed.", LABELS, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", LABELS,
                              buckets=TTFT_BUCKETS, registry=r)
        # Others vLLM exports, which the poller reads past.
        success = Counter("vllm:request_success", "Count of successfully processed requests.", LABELS + ["finished_reason"],
                          registry=r)
        e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LABELS,
                        buckets=LATENCY_BUCKETS, registry=r)
        for engine in engines:  # vLLM makes every series of every engine at start (make_per_engine)
            for metric in (self.running, self.waiting, self.kv, self.preemptions, self.prompt, self.generation, self.ttft, e2e):
                metric.labels(model, engine)
            for state in SLEEP_STATES:
                self.sleep.labels(model, engine, state).set(1 if state == "awake" else 0)
            success.labels(model, engine, "stop").inc(3)


class _Current(Collector):
    def __init__(self, exporter: VllmExporter):
        self.exporter = exporter

    def collect(self) -> Any:
        return self.exporter.metrics.registry.collect()


class VllmExporter:
    """``with VllmExporter() as vllm: vllm.url``; the metric objects are ``vllm.metrics.<name>``."""

    def __init__(self, model: str = "Qwen/Qwen2.5-0.5B", engines: tuple[str, ...] = ("0",)):
        self.model, self.engines = model, engines
        self.metrics = _Engines(model, engines)
        outer = CollectorRegistry()
        outer.register(_Current(self))
        self._server, self._thread = start_http_server(0, addr="127.0.0.1", registry=outer)
        self.url = f"http://127.0.0.1:{self._server.server_port}/metrics"

    def set(self, engine: str = "0", *, running: float | None = None, waiting: float | None = None,
            kv: float | None = None) -> None:
        m = self.metrics
        for gauge, value in ((m.running, running), (m.waiting, waiting), (m.kv, kv)):
            if value is not None:
                gauge.labels(self.model, engine).set(value)

    def serve(self, engine: str = "0", *, prompt: int = 0, generation: int = 0, preemptions: int = 0,
              ttft: tuple[float, ...] = ()) -> None:
        """Counters rise and first tokens are observed, as requests are served."""
        m = self.metrics
        m.prompt.labels(self.model, engine).inc(prompt)
        m.generation.labels(self.model, engine).inc(generation)
        m.preemptions.labels(self.model, engine).inc(preemptions)
        for seconds in ttft:
            m.ttft.labels(self.model, engine).observe(seconds)

    def sleep(self, engine: str = "0", level: int = 1) -> None:
        """vLLM's sleep mode (the actor updates): awake 0, weights_offloaded (1) or discard_all (2) 1."""
        for state in SLEEP_STATES:
            on = state == ("weights_offloaded" if level == 1 else "discard_all")
            self.metrics.sleep.labels(self.model, engine, state).set(1 if on else 0)

    def wake(self, engine: str = "0") -> None:
        for state in SLEEP_STATES:
            self.metrics.sleep.labels(self.model, engine, state).set(1 if state == "awake" else 0)

    def restart(self) -> None:
        """The server restarted: every counter and histogram counts from zero again."""
        self.metrics = _Engines(self.model, self.engines)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> VllmExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
