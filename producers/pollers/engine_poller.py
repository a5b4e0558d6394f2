"""Engine poller: vLLM's Prometheus endpoints -> ``EngineSample`` records on the hardware topic.

Seed 001, "Rollout engine": each rollout server exports vLLM's own metrics; the poller scrapes
them at an interval for one run (its project, run id and attempt, and the rollout server's pod) and
publishes one record per engine and scrape: gauges as read, counters as rates, the prefix cache's
hit rate, and the TTFT, queue-time and inter-token-latency histograms as percentiles (and means) over
the interval (``rlpulse.producers.pollers.engine_metrics``). A sleep shorter
than the interval does not show, as the seed says of a step shorter than the scrape interval.

Every scraped byte is someone else's: a response is read up to a size cap within a total time
limit, over plain HTTP(S) with no redirect and no proxy, and only an allowlist of sample names is
kept. What is refused (an oversized or unparseable response, a non-finite value, a label too long,
too many engines or series) is counted by reason in :attr:`EnginePoller.refused` and logged the
1st, 10th, 100th... time; an endpoint that stops answering is logged when it goes and when it
comes back.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

from rlpulse.producers.pollers.engine_metrics import (GENERATION_TOKENS, ITL, KV_USAGE, KV_USAGE_OLD, PREEMPTIONS,
                                                      MAX_SERIES, PROMPT_TOKENS, QUEUE_TIME, RUNNING, TTFT, WAITING, Reading,
                                                      interval, parse)
from rlpulse.producers.sdk.sender import Outgoing, Sender
from rlpulse.schemas.catalogue import engine_key
from rlpulse.base.settings import Settings
from rlpulse.base.errors import Error

log = logging.getLogger(__name__)

MAX_BYTES = 4 * 1024 * 1024  # vLLM's page is ~100-300 KiB with every histogram; far more is not a metrics page
TIMEOUT_S = 3.0  # the whole request, connect to last byte
MAX_URL = 1024
MAX_NAME = 256  # project, run id, pod: as the SDK's input limits
FETCH_WORKERS = 16


class ScrapeError(Error):
    """An endpoint that did not give a metrics page; the message says why (no body quoted)."""


def check_url(url: str) -> str:
    """``url`` if it is an http(s) URL with a host and nothing secret; ValueError naming what is wrong.

    It is published in every record, so credentials, a query or a fragment are refused, not kept."""
    if len(url) > MAX_URL:
        raise ValueError(f"--metrics-url is {len(url)} characters; at most {MAX_URL} are allowed")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--metrics-url {url!r} is not an http:// or https:// URL with a host")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise ValueError("--metrics-url must not carry credentials: the URL is published in every engine sample")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ValueError(f"--metrics-url {parts.scheme}://{parts.netloc}{parts.path}: give it without a query or fragment")
    return url


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> None:
        # A metrics endpoint answers where it is; following a redirect would let it send us anywhere.
        raise ScrapeError(f"redirected ({code}); give the metrics URL itself")


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def fetch(url: str, timeout_s: float = TIMEOUT_S, max_bytes: int = MAX_BYTES) -> bytes:
    """The body of ``url``, at most ``max_bytes``, within ``timeout_s`` in all; ScrapeError otherwise."""
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(url, headers={"Accept": "text/plain", "Accept-Encoding": "identity"})
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise ScrapeError(f"response of {int(length)} bytes, over the {max_bytes}-byte cap")
            chunks: list[bytes] = []
            size = 0
            while True:
                if time.monotonic() > deadline:  # a server dripping bytes keeps each read under the socket timeout
                    raise ScrapeError(f"no complete response within {timeout_s:g}s")
                chunk = response.read(65536)
                if not chunk:
                    return b"".join(chunks)
                size += len(chunk)
                if size > max_bytes:
                    raise ScrapeError(f"response over the {max_bytes}-byte cap")
                chunks.append(chunk)
    except ScrapeError:
        raise
    except urllib.error.HTTPError as exc:
        raise ScrapeError(f"HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise ScrapeError(f"{type(exc).__name__}: {str(reason)[:200]}") from None


@dataclass(frozen=True)
class EngineRun:
    """The run the engines serve, and the rollout server's pod: carried by every record."""

    run_id: str = ""
    attempt: int = 1
    project: str = ""
    pod: str = ""

    def __post_init__(self) -> None:
        for name in ("run_id", "project", "pod"):
            if len(getattr(self, name)) > MAX_NAME:
                raise ValueError(f"{name} is {len(getattr(self, name))} characters; at most {MAX_NAME} are allowed")
        if isinstance(self.attempt, bool) or not 0 <= self.attempt < 2**31:
            raise ValueError(f"attempt must be an int from 0, got {self.attempt!r}")


def _often(n: int) -> bool:
    """The 1st, 10th, 100th ... occurrence: a log line that never floods."""
    return n > 0 and 10 ** (len(str(n)) - 1) == n


class EnginePoller:
    """Scrapes each URL and publishes through ``publish`` (``Sender.offer``); one :meth:`scrape` at a time."""

    def __init__(self, urls: list[str], publish: Callable[[Outgoing], object], settings: Settings, *,
                 run: EngineRun | None = None, timeout_s: float = TIMEOUT_S, max_bytes: int = MAX_BYTES,
                 max_engines: int = 64, max_series: int = MAX_SERIES, fetcher: Callable[[str, float, int], bytes] = fetch,
                 clock: Callable[[], int] = time.time_ns, monotonic: Callable[[], float] = time.monotonic):
        if not urls:
            raise ValueError("give at least one --metrics-url")
        self.urls = list(dict.fromkeys(check_url(u) for u in urls))
        self._publish, self._topic, self.run = publish, settings.topic("hardware"), run or EngineRun()
        self.timeout_s, self.max_bytes, self.max_engines, self.max_series = timeout_s, max_bytes, max_engines, max_series
        self._fetch, self._clock, self._monotonic = fetcher, clock, monotonic
        self._previous: dict[tuple[str, str], tuple[Reading, float]] = {}  # (url, engine) -> last reading, when
        self.refused: Counter[str] = Counter()  # reason -> samples (or responses) refused, over all URLs
        self.failures: Counter[str] = Counter()  # url -> scrapes that gave no metrics page
        self._down: dict[str, str] = {}  # url -> why it is failing, while it is
        self.published = 0

    def scrape(self) -> list[dict[str, Any]]:
        """Scrape every URL once and publish a record per engine; returns them. The requests run
        several at a time; what is read is then taken in on this thread, one URL after another."""
        if len(self.urls) == 1:
            fetched = [self._fetch_one(self.urls[0])]
        else:
            with ThreadPoolExecutor(max_workers=min(FETCH_WORKERS, len(self.urls)), thread_name_prefix="rlpulse-scrape") as pool:
                fetched = list(pool.map(self._fetch_one, self.urls))
        records = [r for url, time_ns, started, body in fetched for r in self._take(url, time_ns, started, body)]
        for record in records:
            self._publish(Outgoing(self._topic, engine_key(record["pod"], record["url"], record["engine"]),
                                   "EngineSample", record))
        self.published += len(records)
        return records

    def _fetch_one(self, url: str) -> tuple[str, int, float, bytes | ScrapeError]:
        time_ns, started = self._clock(), self._monotonic()
        try:
            return url, time_ns, started, self._fetch(url, self.timeout_s, self.max_bytes)
        except ScrapeError as exc:
            return url, time_ns, started, exc

    def _take(self, url: str, time_ns: int, started: float, body: bytes | ScrapeError) -> list[dict[str, Any]]:
        try:
            if isinstance(body, ScrapeError):
                raise body
            text = body.decode("utf-8")
        except (ScrapeError, UnicodeDecodeError) as exc:
            why = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else str(exc)
            self._failed(url, why)
            return []
        parsed = parse(text, self.max_engines, self.max_series)
        for reason, n in sorted(parsed.refused.items()):
            before = self.refused[reason]
            self.refused[reason] += n
            if any(_often(k) for k in range(before + 1, before + n + 1)):
                log.warning("%s: %d samples refused (%s); %d so far on this poller", url, n, reason, self.refused[reason])
        if "unparseable" in parsed.refused:
            self._failed(url, "not a Prometheus text exposition")
            return []
        if url in self._down:
            log.info("%s answers again (it failed %d times: %s)", url, self.failures[url], self._down.pop(url))
        return [self._record(url, reading, time_ns, started) for _, reading in sorted(parsed.engines.items())]

    def _failed(self, url: str, why: str) -> None:
        self.failures[url] += 1
        if self._down.get(url) != why:
            log.warning("%s: no metrics (%s); its engines publish nothing while this lasts", url, why)
        self._down[url] = why

    def _record(self, url: str, cur: Reading, time_ns: int, started: float) -> dict[str, Any]:
        prev = self._previous.get((url, cur.engine))
        self._previous[(url, cur.engine)] = (cur, started)
        dt = started - prev[1] if prev is not None else None
        figures = interval(prev[0] if prev is not None else None, cur, dt)
        kv = cur.gauges.get(KV_USAGE, cur.gauges.get(KV_USAGE_OLD))  # the new name where both are (0.9.2-0.10.2)
        ttft, queue, itl = figures.histograms[TTFT], figures.histograms[QUEUE_TIME], figures.histograms[ITL]
        p50, p90, p99 = ttft.quantiles  # QUANTILES: 0.5, 0.9, 0.99
        run = self.run
        return {
            "project": run.project, "run_id": run.run_id, "attempt": run.attempt, "pod": run.pod, "url": url,
            "engine": cur.engine, "model_name": cur.model_name, "time_ns": time_ns,
            "interval_s": dt if dt is not None and dt > 0 else None,
            "requests_running": cur.gauges.get(RUNNING), "requests_waiting": cur.gauges.get(WAITING), "kv_cache_usage": kv,
            "preemptions_per_s": figures.rates[PREEMPTIONS], "prompt_tokens_per_s": figures.rates[PROMPT_TOKENS],
            "generation_tokens_per_s": figures.rates[GENERATION_TOKENS], "ttft_count": ttft.count,
            "ttft_p50_s": p50, "ttft_p90_s": p90, "ttft_p99_s": p99,
            "awake": None if cur.awake is None else int(cur.awake >= 0.5), "counter_resets": figures.resets,
            "prefix_cache_queries": figures.prefix_cache_queries, "prefix_cache_hit_rate": figures.prefix_cache_hit_rate,
            "queue_time_count": queue.count, "queue_time_mean_s": queue.mean,
            "queue_time_p50_s": queue.quantiles[0], "queue_time_p90_s": queue.quantiles[1],
            "itl_count": itl.count, "itl_mean_s": itl.mean, "itl_p50_s": itl.quantiles[0], "itl_p90_s": itl.quantiles[1],
        }

    def run_loop(self, stop: threading.Event, interval_s: float) -> None:
        """Scrape every ``interval_s`` until ``stop`` is set (a late scrape skips the ticks it missed)."""
        deadline = time.monotonic()
        while not stop.is_set():
            self.scrape()
            deadline += interval_s
            now = time.monotonic()
            if deadline <= now:  # a scrape slower than the interval: the next one at once, not a burst
                deadline = now
            if stop.wait(deadline - now):
                break


def main(settings: Settings, urls: list[str], *, run_id: str = "", attempt: int = 1, project: str = "", pod: str = "",
         interval_s: float = 5.0, timeout_s: float = TIMEOUT_S, max_bytes: int = MAX_BYTES,
         stop: threading.Event | None = None) -> int:
    """``rlpulse engine-poller``: scrape and publish until SIGTERM/SIGINT (or ``stop``); returns 0."""
    if interval_s <= 0 or timeout_s <= 0 or max_bytes <= 0:
        raise ValueError("--interval, --timeout and --max-bytes must be above 0")
    try:
        import prometheus_client.parser  # noqa: F401 - optional: rlpulse[engine]; say so before the first scrape
    except ImportError as exc:
        raise RuntimeError(f"prometheus_client is not installed ({exc}); pip install 'rlpulse[engine]'") from None
    run = EngineRun(run_id, attempt, project, pod)
    for url in urls:  # bad arguments fail before a sender exists
        check_url(url)
    sender = Sender(settings)
    poller = EnginePoller(urls, sender.offer, settings, run=run, timeout_s=timeout_s, max_bytes=max_bytes)
    sender.start()
    stop = stop or threading.Event()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers only work there
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    log.info("engine-poller: scraping %s every %gs for run %r", ", ".join(poller.urls), interval_s, run_id)
    try:
        poller.run_loop(stop, interval_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        undelivered = sender.close()
        refused = ", ".join(f"{n} {why}" for why, n in sorted(poller.refused.items())) or "none"
        log.info("engine-poller: %d engine samples published, %d undelivered; refused: %s",
                 poller.published, undelivered, refused)
    return 0
