"""vLLM's Prometheus metrics into engine figures: what the engine poller reads of a scrape, and the
figures of the interval between two scrapes (counters as rates, a histogram as percentiles).

The text is parsed with ``prometheus_client``'s own parser. Only the sample names of ``ALLOWED``
are kept (vLLM exports dozens of others, read and ignored); every value or label refused here is
counted by reason (:class:`Parsed.refused`), so the poller can say what it did not publish.

Names as vLLM declares them (its v1 metrics ``loggers`` module, ``PrometheusStatLogger``): the gauges
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (named
``vllm:gpu_cache_usage_perc`` before vLLM 0.9, read when the new name is absent) and
``vllm:engine_sleep_state{sleep_state="awake"}``; the counters ``vllm:num_preemptions``,
``vllm:prompt_tokens`` and ``vllm:generation_tokens`` (``_total`` on the wire); the histogram
``vllm:time_to_first_token_seconds``. Ray's cluster metrics spell them ``ray_vllm_...`` with ``_``
for ``:`` (seed 001); those are read as the same names.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
KV_USAGE, KV_USAGE_OLD = "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"
SLEEP_STATE = "vllm:engine_sleep_state"
PREEMPTIONS, PROMPT_TOKENS, GENERATION_TOKENS = ("vllm:num_preemptions_total", "vllm:prompt_tokens_total",
                                                 "vllm:generation_tokens_total")
TTFT_BUCKET = "vllm:time_to_first_token_seconds_bucket"
GAUGES = (RUNNING, WAITING, KV_USAGE, KV_USAGE_OLD)
COUNTERS = (PREEMPTIONS, PROMPT_TOKENS, GENERATION_TOKENS)
ALLOWED = frozenset((*GAUGES, SLEEP_STATE, *COUNTERS, TTFT_BUCKET))
RAY_PREFIX = "ray_vllm_"
MAX_LABEL = 256  # characters of a label value we keep (engine, model_name, le)
QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class Reading:
    """One engine's allowed figures at one scrape: series of the engine that differ in other labels
    are added up (the largest for KV usage and for awake)."""

    engine: str
    model_name: str = ""
    gauges: dict[str, float] = field(default_factory=dict)
    awake: float | None = None
    counters: dict[str, float] = field(default_factory=dict)
    ttft: dict[float, float] = field(default_factory=dict)  # bucket upper bound (le) -> cumulative count


@dataclass
class Parsed:
    engines: dict[str, Reading] = field(default_factory=dict)  # by vLLM's engine label
    refused: Counter[str] = field(default_factory=Counter)  # why a sample (or the text) was not read -> how many
    ignored: int = 0  # samples of names outside ALLOWED: read past, as expected


def vllm_name(name: str) -> str:
    """``ray_vllm_num_requests_running`` -> ``vllm:num_requests_running``; vLLM's own names as they are."""
    return "vllm:" + name[len(RAY_PREFIX):] if name.startswith(RAY_PREFIX) else name


def parse(text: str, max_engines: int = 64, max_series: int = 4096) -> Parsed:
    """The allowed samples of a Prometheus text exposition, per engine. Never raises on its input:
    text the parser rejects is one refusal (``unparseable``) and nothing else is kept from it."""
    from prometheus_client.parser import text_string_to_metric_families

    out = Parsed()
    engines: dict[str, Reading] = {}
    series = 0
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = vllm_name(sample.name)
                if name not in ALLOWED:
                    out.ignored += 1
                    continue
                series += 1
                if series > max_series:
                    out.refused["too many series"] += 1
                    continue
                _take(engines, out, name, sample.labels, sample.value, max_engines)
    except Exception:  # noqa: BLE001 - the parser's errors are ValueError, IndexError, ...: the text is bad
        out.refused["unparseable"] += 1
        return out
    out.engines = engines
    return out


def _take(engines: dict[str, Reading], out: Parsed, name: str, labels: dict[str, str], value: float,
          max_engines: int) -> None:
    engine, model = labels.get("engine", ""), labels.get("model_name", "")
    if len(engine) > MAX_LABEL or len(model) > MAX_LABEL:
        out.refused["label too long"] += 1
        return
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        out.refused["not a finite value >= 0"] += 1
        return
    le = math.nan
    if name == TTFT_BUCKET:
        try:
            le = float(labels.get("le", ""))  # "+Inf" reads as inf
        except ValueError:
            le = math.nan
        if math.isnan(le):
            out.refused["bucket without a bound"] += 1
            return
    reading = engines.get(engine)
    if reading is None:
        if len(engines) >= max_engines:
            out.refused["too many engines"] += 1
            return
        reading = engines[engine] = Reading(engine, model)
    if name == SLEEP_STATE:
        if labels.get("sleep_state") == "awake":
            reading.awake = value if reading.awake is None else max(reading.awake, value)
    elif name == TTFT_BUCKET:
        reading.ttft[le] = reading.ttft.get(le, 0.0) + value
    elif name in COUNTERS:
        reading.counters[name] = reading.counters.get(name, 0.0) + value
    elif name in (KV_USAGE, KV_USAGE_OLD):
        reading.gauges[name] = max(reading.gauges.get(name, value), value)
    else:
        reading.gauges[name] = reading.gauges.get(name, 0.0) + value


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's ``histogram_quantile`` over cumulative buckets (upper bound, count), sorted by bound.

    Linear within the bucket holding the rank, the first bucket starting at 0; a rank in the +Inf
    bucket is the largest finite bound. None without observations or without the +Inf bucket."""
    if not buckets or not math.isinf(buckets[-1][0]):
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for i, (upper, count) in enumerate(buckets):
        if count >= rank:
            if math.isinf(upper):
                return buckets[i - 1][0] if i > 0 else None
            inside = count - below
            if upper <= 0 or inside <= 0:
                return upper
            return lower + (upper - lower) * (rank - below) / inside
        lower, below = upper, count
    return None  # not reached: the +Inf bucket holds every observation


@dataclass(frozen=True)
class Interval:
    """What happened between two scrapes of one engine."""

    rates: dict[str, float | None]  # counter name -> per second; None without a previous scrape
    ttft_count: int | None
    ttft: tuple[float | None, ...]  # QUANTILES, seconds
    resets: int  # counters or the histogram that went down: the engine restarted between the scrapes


def interval(prev: Reading | None, cur: Reading, dt_s: float | None) -> Interval:
    """Counters as rates and the TTFT histogram as percentiles over ``dt_s`` seconds since ``prev``.

    A counter below its previous value was reset (the engine restarted), as Prometheus's ``rate``
    takes it: the increase is the new value, counted from zero. The same for the histogram when a
    bucket went down or its bounds changed."""
    resets = 0
    rates: dict[str, float | None] = {}
    have_prev = prev is not None and dt_s is not None and dt_s > 0
    for name in COUNTERS:
        now = cur.counters.get(name)
        before = prev.counters.get(name) if prev is not None else None
        if now is None or before is None or not have_prev:
            rates[name] = None
            continue
        increase = now - before
        if increase < 0:
            resets += 1
            increase = now
        rates[name] = increase / dt_s  # type: ignore[operator]  # have_prev: dt_s > 0
    if not have_prev or prev is None or not cur.ttft or not prev.ttft:
        return Interval(rates, None, (None,) * len(QUANTILES), resets)
    bounds = sorted(cur.ttft)
    deltas = [cur.ttft[b] - prev.ttft.get(b, math.nan) for b in bounds]
    if set(bounds) != set(prev.ttft) or any(not d >= 0 for d in deltas):
        resets += 1
        deltas = [cur.ttft[b] for b in bounds]
    cumulative, running = [], 0.0
    for bound, delta in zip(bounds, deltas):
        running = max(running, delta)  # a scrape is not atomic: keep the counts monotonic, as Prometheus does
        cumulative.append((bound, running))
    count = int(round(cumulative[-1][1])) if math.isinf(bounds[-1]) else None
    return Interval(rates, count, tuple(quantile(q, cumulative) for q in QUANTILES), resets)
