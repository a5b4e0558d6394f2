"""The engine poller against a real ``prometheus_client`` exporter serving vLLM's metrics (tests/vllm_exporter.py),
and against hostile endpoints on loopback: every refusal counted, nothing published from them."""

from __future__ import annotations

import http.server
import logging
import threading
import time
from collections.abc import Iterator

import pytest

from rlpulse.producers.pollers.engine_poller import EnginePoller, EngineRun, check_url
from rlpulse.producers.sdk.sender import Outgoing
from rlpulse.schemas.codec import Codec
from rlpulse.base.settings import Settings

pytest.importorskip("prometheus_client")
from tests.vllm_exporter import ITL_BUCKETS, LATENCY_BUCKETS, VllmExporter, histogram_quantile  # noqa: E402

SETTINGS = Settings(topic_prefix="t")
RUN = EngineRun(run_id="r1", attempt=2, project="p", pod="rollout-0")


class Clock:
    """The poller's two clocks: the records' time and the interval between scrapes."""

    def __init__(self) -> None:
        self.s = 0.0

    def ns(self) -> int:
        return 1_700_000_000_000_000_000 + int(self.s * 1e9)

    def mono(self) -> float:
        return self.s


def poller(urls: list[str], **kwargs) -> tuple[EnginePoller, list[Outgoing], Clock]:
    out: list[Outgoing] = []
    clock = Clock()
    kwargs.setdefault("run", RUN)
    return EnginePoller(urls, out.append, SETTINGS, clock=clock.ns, monotonic=clock.mono, **kwargs), out, clock


def by_engine(records: list[dict]) -> dict[str, dict]:
    return {r["engine"]: r for r in records}


def test_a_real_exporter_through_a_sleep_wake_cycle_with_counters_rising() -> None:
    with VllmExporter(engines=("0", "1")) as vllm:
        p, out, clock = poller([vllm.url])
        vllm.set("0", running=12, waiting=0, kv=0.4)
        vllm.set("1", running=3, waiting=0, kv=0.1)
        first = by_engine(p.scrape())
        assert sorted(first) == ["0", "1"]
        e0 = first["0"]
        assert (e0["requests_running"], e0["requests_waiting"], e0["kv_cache_usage"], e0["awake"]) == (12.0, 0.0, 0.4, 1)
        assert e0["interval_s"] is None and e0["prompt_tokens_per_s"] is None and e0["ttft_p50_s"] is None
        assert (e0["project"], e0["run_id"], e0["attempt"], e0["pod"], e0["url"]) == ("p", "r1", 2, "rollout-0", vllm.url)
        assert e0["model_name"] == "Qwen/Qwen2.5-0.5B" and e0["time_ns"] == clock.ns()

        clock.s = 5.0
        vllm.serve("0", prompt=1000, generation=500, preemptions=2, ttft=(0.05, 0.07, 0.3, 0.3, 0.9))
        vllm.set("0", waiting=4, kv=0.97)
        e0 = by_engine(p.scrape())["0"]
        assert e0["interval_s"] == 5.0
        assert (e0["prompt_tokens_per_s"], e0["generation_tokens_per_s"], e0["preemptions_per_s"]) == (200.0, 100.0, 0.4)
        assert e0["ttft_count"] == 5
        # Prometheus's histogram_quantile over vLLM's buckets: rank 2.5 in (0.25, 0.5], 4.5 and 4.95 in (0.75, 1.0]
        assert (e0["ttft_p50_s"], e0["ttft_p90_s"], e0["ttft_p99_s"]) == pytest.approx((0.3125, 0.875, 0.9875))
        assert (e0["requests_waiting"], e0["kv_cache_usage"], e0["awake"]) == (4.0, 0.97, 1)

        clock.s = 10.0
        vllm.sleep("0", level=1)  # the actor updates: the engine sleeps
        vllm.set("0", running=0, waiting=0, kv=0.0)
        asleep = by_engine(p.scrape())
        assert asleep["0"]["awake"] == 0 and asleep["1"]["awake"] == 1
        assert asleep["0"]["prompt_tokens_per_s"] == 0.0 and asleep["0"]["ttft_count"] == 0
        assert asleep["0"]["ttft_p50_s"] is None  # no first token in the interval: no percentile

        clock.s = 15.0
        vllm.wake("0")
        vllm.serve("0", prompt=3000, generation=1500)
        awake = by_engine(p.scrape())["0"]
        assert awake["awake"] == 1 and awake["prompt_tokens_per_s"] == 600.0 and awake["counter_resets"] == 0
    assert [o.record["awake"] for o in out if o.record["engine"] == "0"] == [1, 1, 0, 1]
    assert {o.key for o in out} == {"rollout-0/0", "rollout-0/1"} and {o.topic for o in out} == {"t.hardware"}
    assert {o.schema for o in out} == {"EngineSample"}
    Codec().encode("EngineSample", [o.record for o in out])  # every record fits the schema
    assert p.published == 8 and not p.refused and not p.failures


def test_a_restarted_server_counts_from_zero_and_the_rates_stay_true() -> None:
    with VllmExporter() as vllm:
        p, _, clock = poller([vllm.url])
        vllm.serve(prompt=5000, generation=4000, preemptions=3, ttft=(0.2,) * 10)
        p.scrape()
        vllm.restart()
        vllm.serve(prompt=300, generation=200, preemptions=1, ttft=(0.05, 0.09))
        clock.s = 2.0
        [after] = p.scrape()
    assert (after["prompt_tokens_per_s"], after["generation_tokens_per_s"], after["preemptions_per_s"]) == (150.0, 100.0, 0.5)
    assert after["counter_resets"] == 4 and after["ttft_count"] == 2


QUEUED = (0.2, 0.4, 1.2, 3.0, 9.0)  # five requests finished: the seconds each waited before it ran
GAPS = (0.02,) * 30 + (0.06,) * 9 + (0.3,)  # forty gaps between tokens


@pytest.mark.parametrize("version", ["0.33.0", "0.9.1"])
def test_prefix_cache_queue_time_and_inter_token_latency_of_a_real_exporter(version: str) -> None:
    """vLLM 0.33's names, and 0.9.1's (gpu_cache_usage_perc, gpu_prefix_cache_*, time_per_output_token_seconds):
    the same figures, equal to what the observations give."""
    with VllmExporter(version=version) as vllm:
        p, _, clock = poller([vllm.url])
        vllm.set(kv=0.6)
        vllm.serve(prefix_queries=5000, prefix_hits=1000, queued=(50.0,), itl=(1.0,))  # before the first scrape
        [first] = p.scrape()
        assert first["kv_cache_usage"] == 0.6 and first["prefix_cache_hit_rate"] is None and first["itl_count"] is None
        clock.s = 5.0
        vllm.serve(prefix_queries=2048, prefix_hits=1536, queued=QUEUED, itl=GAPS)
        [got] = p.scrape()
        clock.s = 10.0
        [idle] = p.scrape()
    assert (got["prefix_cache_queries"], got["prefix_cache_hit_rate"]) == (2048, 1536 / 2048)
    assert (got["queue_time_count"], got["itl_count"]) == (len(QUEUED), len(GAPS))
    assert got["queue_time_mean_s"] == pytest.approx(sum(QUEUED) / len(QUEUED))
    assert got["itl_mean_s"] == pytest.approx(sum(GAPS) / len(GAPS))
    assert (got["queue_time_p50_s"], got["queue_time_p90_s"]) == pytest.approx(
        tuple(histogram_quantile(q, list(QUEUED), LATENCY_BUCKETS) for q in (0.5, 0.9)))
    assert (got["itl_p50_s"], got["itl_p90_s"]) == pytest.approx(
        tuple(histogram_quantile(q, list(GAPS), ITL_BUCKETS) for q in (0.5, 0.9)))
    assert got["kv_cache_usage"] == 0.6 and got["awake"] == (1 if version == "0.33.0" else None)
    # nothing served since: counts 0, and no rate or mean of nothing
    assert (idle["prefix_cache_queries"], idle["prefix_cache_hit_rate"], idle["queue_time_count"], idle["queue_time_mean_s"],
            idle["itl_count"], idle["itl_mean_s"], idle["itl_p50_s"]) == (0, None, 0, None, 0, None, None)
    Codec().encode("EngineSample", [first, got, idle])
    assert not p.refused


class Hostile(http.server.BaseHTTPRequestHandler):
    """Each path misbehaves its own way."""

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, body: bytes, status: int = 200, length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path
        if path == "/old-kv-name":
            self._send(b'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.75\n'
                       b'vllm:num_requests_waiting{engine="0",model_name="m"} 2\n')
        elif path == "/big":
            self._send(b"#" * 5000, length=5000)
        elif path == "/big-unannounced":
            self.send_response(200)
            self.end_headers()
            for _ in range(10):
                self.wfile.write(b"# padding " * 100 + b"\n")
        elif path == "/slow":
            self.send_response(200)
            self.end_headers()
            for _ in range(20):  # 1 s of bytes, each within the socket timeout
                self.wfile.write(b"#\n")
                self.wfile.flush()
                time.sleep(0.05)
        elif path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:1/elsewhere")
            self.end_headers()
        elif path == "/latin1":
            self._send(b"# caf\xe9\n")
        elif path == "/garbage":
            self._send(b'vllm:num_requests_running{engine="0" 1\n')
        elif path == "/nan":
            self._send(b'vllm:num_requests_running{engine="0"} NaN\nvllm:num_requests_waiting{engine="0"} 1\n')
        else:
            self._send(b"not found", status=404)


@pytest.fixture
def hostile() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    server.daemon_threads = True  # the slow handler may still be writing when the test ends
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_an_older_vllm_kv_name_is_read(hostile: str) -> None:
    p, _, _ = poller([f"{hostile}/old-kv-name"])
    [record] = p.scrape()
    assert record["kv_cache_usage"] == 0.75 and record["requests_waiting"] == 2.0 and record["awake"] is None
    assert record["requests_running"] is None  # not exported: null, never 0


def test_hostile_endpoints_publish_nothing_and_each_refusal_is_counted(hostile: str, caplog) -> None:
    paths = ["/big", "/big-unannounced", "/slow", "/redirect", "/latin1", "/garbage", "/missing"]
    p, out, _ = poller([hostile + path for path in paths], timeout_s=0.5, max_bytes=4096, run=EngineRun())  # no pod:
    # one --pod names one rollout server, so it takes one URL
    with caplog.at_level(logging.WARNING):
        assert p.scrape() == [] and p.scrape() == []
    assert out == []
    assert p.failures == {hostile + path: 2 for path in paths}
    assert p.refused == {"unparseable": 2}
    warned = "\n".join(r.getMessage() for r in caplog.records)
    for why in ("over the 4096-byte cap", "no complete response within 0.5s", "redirected (302)", "not UTF-8 text",
                "not a Prometheus text exposition", "HTTP 404"):
        assert why in warned, why
    assert warned.count("/redirect: no metrics") == 1  # logged when it starts failing, not every scrape


def test_a_non_finite_value_is_refused_and_the_rest_published(hostile: str, caplog) -> None:
    p, out, _ = poller([f"{hostile}/nan"])
    with caplog.at_level(logging.WARNING):
        [record] = p.scrape()
    assert record["requests_running"] is None and record["requests_waiting"] == 1.0
    assert p.refused == {"not a finite value >= 0": 1} and len(out) == 1
    assert "1 samples refused (not a finite value >= 0)" in caplog.text


def test_urls_that_would_leak_or_wander_are_refused() -> None:
    assert check_url("http://rollout-0:8000/metrics") == "http://rollout-0:8000/metrics"
    for url, why in [("http://user:pw@host/metrics", "credentials"), ("http://host/metrics?token=x", "query or fragment"),
                     ("file:///etc/passwd", "not an http"), ("http:///metrics", "not an http"),
                     ("http://h/" + "m" * 2000, "at most 1024")]:
        with pytest.raises(ValueError, match=why):
            check_url(url)
    for url in ["http://alice:s3cr/et@host/metrics", "http://alice:[s3cr]@host/metrics", "http://host:s3cr/metrics"]:
        with pytest.raises(ValueError) as refused:  # the message names the URL masked, never urllib's words
            check_url(url)
        assert "s3cr" not in str(refused.value) and "***" in str(refused.value), refused.value
    with pytest.raises(ValueError, match="at least one"):
        EnginePoller([], print, SETTINGS)
    with pytest.raises(ValueError, match="run_id is 300 characters"):
        EngineRun(run_id="r" * 300)


def test_the_loop_scrapes_on_its_interval_until_stopped() -> None:
    with VllmExporter() as vllm:
        out: list[Outgoing] = []
        p = EnginePoller([vllm.url], out.append, SETTINGS, run=RUN)
        stop = threading.Event()
        thread = threading.Thread(target=p.run_loop, args=(stop, 0.05))
        thread.start()
        deadline = time.monotonic() + 10
        while len(out) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        thread.join(5)
    assert not thread.is_alive() and len(out) >= 3
    times = [o.record["time_ns"] for o in out]
    assert times == sorted(times) and out[1].record["interval_s"] is not None
