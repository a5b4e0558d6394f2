"""Engine poller: vLLM's Prometheus endpoints -> ``EngineSample`` records on the hardware topic.

Seed 001, "Rollout engine": each rollout server exports vLLM's own metrics; the poller scrapes
them at an interval for one run (its project, run id and attempt, and the rollout server's pod) and
publishes one record per engine and scrape: gauges as read, counters as rates, the prefix cache's
hit rate, and the TTFT, queue-time and inter-token-latency histograms as percentiles (and means) over
the interval (``rlpulse.producers.pollers.engine_metrics``). A sleep shorter
than the interval does not show, as the seed says of a step shorter than the scrape interval.

Every scraped byte is someone else's: a response is read up to a size cap within a total time
limit, connect to last byte, over plain HTTP(S) with no redirect and no proxy
(``rlpulse.producers.pollers.engine_fetch``); the URLs are fetched at once, so one slow endpoint
holds no other; only an allowlist of sample names is kept. What is refused (an oversized, cut or
unparseable response, a non-finite value and its series, a label too long, too many engines or
series) is counted by reason in :attr:`EnginePoller.refused` and logged the 1st, 10th, 100th...
time; an endpoint that stops answering is logged when it goes and when it comes back.

One ``--pod`` names one rollout server, so it takes one ``--metrics-url`` (:func:`check_keys`).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

from rlpulse.producers.pollers.engine_metrics import (GENERATION_TOKENS, ITL, KV_USAGE, KV_USAGE_OLD, PREEMPTIONS,
                                                      MAX_SERIES, PROMPT_TOKENS, QUEUE_TIME, RUNNING, TTFT, WAITING, Reading,
                                                      carry, interval, parse)
from rlpulse.producers.pollers.engine_fetch import MAX_BYTES, TIMEOUT_S, ScrapeError, fetch
from rlpulse.producers.sdk.sender import Outgoing, Sender
from rlpulse.schemas.catalogue import engine_key
from rlpulse.base.settings import Settings
from rlpulse.base.urls import mask_url, split_url

log = logging.getLogger(__name__)

MAX_URL = 1024
MAX_NAME = 256  # project, run id, pod: as the SDK's input limits
MAX_URLS = 256  # a thread each while a scrape is out
SLACK_S = 1.0  # past its timeout, how long a scrape waits for a fetch that has not ended (it should have)


def check_url(url: str) -> str:
    """``url`` if it is an http(s) URL with a host and nothing secret; ValueError naming what is wrong.

    It is published in every record, so credentials, a query or a fragment are refused, not kept."""
    if len(url) > MAX_URL:
        raise ValueError(f"--metrics-url is {len(url)} characters; at most {MAX_URL} are allowed")
    parts = split_url(url, "--metrics-url")  # a ValueError naming the masked URL, never urllib's words
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--metrics-url {mask_url(url)} is not an http:// or https:// URL with a host")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise ValueError("--metrics-url must not carry credentials: the URL is published in every engine sample")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ValueError(f"--metrics-url {mask_url(url)}: give it without a query or fragment")
    return url


def check_keys(urls: list[str], pod: str) -> None:
    """ValueError if two URLs would publish under one key (``engine_key``: the pod, else the URL, and
    vLLM's engine label): one ``--pod`` names one rollout server, so it takes one ``--metrics-url``."""
    if len(urls) > MAX_URLS:
        raise ValueError(f"{len(urls)} --metrics-url; at most {MAX_URLS} on one poller")
    if pod and len(urls) > 1:
        raise ValueError(f"one --pod for {len(urls)} --metrics-url: their engines would share the pod's keys (the "
                         "Kafka key and the engine_saturated alert's) and overwrite each other; run a poller per "
                         "rollout server with its own --pod, or leave --pod out to key each engine by its URL")


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
        check_keys(self.urls, self.run.pod)
        self.timeout_s, self.max_bytes, self.max_engines, self.max_series = timeout_s, max_bytes, max_engines, max_series
        self._fetch, self._clock, self._monotonic = fetcher, clock, monotonic
        self._previous: dict[tuple[str, str], tuple[Reading, float]] = {}  # (url, engine) -> last reading, when
        self.refused: Counter[str] = Counter()  # reason -> samples (or responses) refused, over all URLs
        self.failures: Counter[str] = Counter()  # url -> scrapes that gave no metrics page
        self._down: dict[str, str] = {}  # url -> why it is failing, while it is
        self._out: dict[str, threading.Thread] = {}  # url -> a fetch that outlived its scrape, while it runs
        self.published = 0

    def scrape(self) -> list[dict[str, Any]]:
        """Scrape every URL once and publish a record per engine; returns them.

        The requests run at once, a thread each, and the scrape ends when they have, or at the timeout
        (and ``SLACK_S``) at the latest: ``fetch`` bounds the whole exchange, and a fetcher that does not
        end (a name lookup that hangs) costs its URL this scrape, and the next ones while it is out, not
        the other URLs. What is read is then taken in on this thread, one URL after another."""
        fetched: dict[str, tuple[str, int, float, bytes | ScrapeError]] = {}
        running: list[tuple[str, threading.Thread, list[tuple[str, int, float, bytes | ScrapeError]]]] = []
        for url in self.urls:
            if url in self._out and self._out[url].is_alive():
                fetched[url] = (url, self._clock(), self._monotonic(),
                                ScrapeError("its previous request has not ended yet"))
                continue
            self._out.pop(url, None)
            running.append((url, *self._start(url)))
        until = time.monotonic() + self.timeout_s + SLACK_S
        for url, thread, slot in running:
            thread.join(max(0.0, until - time.monotonic()))
            if slot:
                fetched[url] = slot[0]
            else:
                self._out[url] = thread
                fetched[url] = (url, self._clock(), self._monotonic(),
                                ScrapeError(f"no complete response within {self.timeout_s:g}s (the request is still out)"))
        records = [r for url in self.urls for r in self._take(*fetched[url])]
        for record in records:
            self._publish(Outgoing(self._topic, engine_key(record["pod"], record["url"], record["engine"]),
                                   "EngineSample", record))
        self.published += len(records)
        return records

    def _start(self, url: str) -> tuple[threading.Thread, list[tuple[str, int, float, bytes | ScrapeError]]]:
        """A daemon thread fetching ``url`` (one never ended does not hold the process at exit), and where it puts it."""
        slot: list[tuple[str, int, float, bytes | ScrapeError]] = []
        thread = threading.Thread(target=lambda: slot.append(self._fetch_one(url)), daemon=True, name="rlpulse-scrape")
        thread.start()
        return thread, slot

    def _fetch_one(self, url: str) -> tuple[str, int, float, bytes | ScrapeError]:
        time_ns, started = self._clock(), self._monotonic()
        try:
            return url, time_ns, started, self._fetch(url, self.timeout_s, self.max_bytes)
        except ScrapeError as exc:
            return url, time_ns, started, exc
        except Exception as exc:  # noqa: BLE001 - whatever an endpoint makes a fetcher raise, the poller goes on
            return url, time_ns, started, ScrapeError(f"{type(exc).__name__}: {str(exc)[:200]}")

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
        dt = started - prev[1] if prev is not None else None
        figures = interval(prev[0] if prev is not None else None, cur, dt)
        # a series refused at this scrape is kept at its last good value: the next interval rates it from there
        self._previous[(url, cur.engine)] = (carry(prev[0] if prev is not None else None, cur, dt), started)
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
    check_keys(list(dict.fromkeys(urls)), pod)
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
