"""vLLM's Prometheus metrics into engine figures: what the engine poller reads of a scrape, and the
figures of the interval between two scrapes (counters as rates, histograms as percentiles and means).

The text is parsed with ``prometheus_client``'s own parser. Only the sample names of ``ALLOWED``
are kept (vLLM exports dozens of others, read and ignored); every value or label refused here is
counted by reason (:class:`Parsed.refused`), so the poller can say what it did not publish.

Names as vLLM declares them (its v1 metrics ``loggers`` module, ``PrometheusStatLogger``, read in
vLLM 0.9.1, 0.9.2, 0.10.1.1, 0.10.2, 0.11.0, 0.11.1, 0.12.0, 0.13.0 and 0.33.0): the gauges
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` and
``vllm:engine_sleep_state{sleep_state="awake"}``; the counters ``vllm:num_preemptions``,
``vllm:prompt_tokens``, ``vllm:generation_tokens``, ``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits`` (``_total`` on the wire; both in tokens); the histograms
``vllm:time_to_first_token_seconds``, ``vllm:request_queue_time_seconds`` (observed as a request
finishes) and ``vllm:inter_token_latency_seconds``. Older names, read where the new one is absent:

* ``vllm:gpu_cache_usage_perc``: alone in 0.8.5-0.9.1, beside ``kv_cache_usage_perc`` in
  0.9.2-0.10.2, gone by default from 0.11 (only ``kv_cache_usage_perc`` from 0.12);
* ``vllm:gpu_prefix_cache_queries`` / ``_hits``: alone in 0.9.1, beside the new names in
  0.9.2-0.10.2, hidden by default from 0.11;
* ``vllm:time_per_output_token_seconds``: alone up to 0.10.1.1, beside ``inter_token_latency_seconds``
  (the same observations) in 0.10.2-0.11.x, hidden by default in 0.12 and 0.13, gone by 0.33.

``vllm:engine_sleep_state`` first appears in 0.11.1. Ray's cluster metrics spell every name
``ray_vllm_...`` with ``_`` for ``:`` (seed 001); those are read as the same names.
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
PREFIX_QUERIES, PREFIX_HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
PREFIX_QUERIES_OLD, PREFIX_HITS_OLD = "vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total"
# Histograms by base name; a sample is <base>_bucket, <base>_sum or <base>_count.
TTFT, QUEUE_TIME = "vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds"
ITL, ITL_OLD = "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"
TTFT_BUCKET = TTFT + "_bucket"
GAUGES = (RUNNING, WAITING, KV_USAGE, KV_USAGE_OLD)
COUNTERS = (PREEMPTIONS, PROMPT_TOKENS, GENERATION_TOKENS)  # published as rates
PREFIX_COUNTERS = (PREFIX_QUERIES, PREFIX_HITS, PREFIX_QUERIES_OLD, PREFIX_HITS_OLD)  # published as a hit rate
MEAN_HISTOGRAMS = (QUEUE_TIME, ITL, ITL_OLD)  # their _sum and _count are read too, for the mean
_HISTOGRAM_PARTS = {TTFT_BUCKET: (TTFT, "bucket")} | {
    f"{base}_{part}": (base, part) for base in MEAN_HISTOGRAMS for part in ("bucket", "sum", "count")}
ALLOWED = frozenset((*GAUGES, SLEEP_STATE, *COUNTERS, *PREFIX_COUNTERS, *_HISTOGRAM_PARTS))
RAY_PREFIX = "ray_vllm_"
MAX_LABEL = 256  # characters of a label value we keep (engine, model_name, le)
# Allowed series a scrape: about 105 per engine where a version exports old and new names (0.10.2), for 64 engines
MAX_SERIES = 8192
QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class Reading:
    """One engine's allowed figures at one scrape: series of the engine that differ in other labels
    are added up (the largest for KV usage and for awake)."""

    engine: str
    model_name: str = ""
    gauges: dict[str, float] = field(default_factory=dict)
    awake: float | None = None
    counters: dict[str, float] = field(default_factory=dict)  # COUNTERS and PREFIX_COUNTERS
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # histogram -> bucket bound (le) -> cumulative count
    totals: dict[str, dict[str, float]] = field(default_factory=dict)  # histogram -> {"sum": ..., "count": ...}

    @property
    def ttft(self) -> dict[float, float]:
        return self.buckets.get(TTFT, {})


@dataclass
class Parsed:
    engines: dict[str, Reading] = field(default_factory=dict)  # by vLLM's engine label
    refused: Counter[str] = field(default_factory=Counter)  # why a sample (or the text) was not read -> how many
    ignored: int = 0  # samples of names outside ALLOWED: read past, as expected


def vllm_name(name: str) -> str:
    """``ray_vllm_num_requests_running`` -> ``vllm:num_requests_running``; vLLM's own names as they are."""
    return "vllm:" + name[len(RAY_PREFIX):] if name.startswith(RAY_PREFIX) else name


def parse(text: str, max_engines: int = 64, max_series: int = MAX_SERIES) -> Parsed:
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
    histogram, part = _HISTOGRAM_PARTS.get(name, ("", ""))
    le = math.nan
    if part == "bucket":
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
    elif part == "bucket":
        buckets = reading.buckets.setdefault(histogram, {})
        buckets[le] = buckets.get(le, 0.0) + value
    elif part:
        totals = reading.totals.setdefault(histogram, {})
        totals[part] = totals.get(part, 0.0) + value
    elif name in COUNTERS or name in PREFIX_COUNTERS:
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
class Distribution:
    """One histogram over an interval: what was observed between the two scrapes."""

    count: int | None  # observations in the interval; None without a previous scrape or a +Inf bucket
    quantiles: tuple[float | None, ...]  # QUANTILES, as histogram_quantile over the bucket increases
    mean: float | None = None  # increase of _sum / increase of _count; None without observations


NO_DISTRIBUTION = Distribution(None, (None,) * len(QUANTILES))


@dataclass(frozen=True)
class Interval:
    """What happened between two scrapes of one engine."""

    rates: dict[str, float | None]  # counter name -> per second; None without a previous scrape
    histograms: dict[str, Distribution]  # TTFT, QUEUE_TIME and ITL (ITL_OLD's figures where ITL is absent)
    resets: int  # counters or histograms that went down: the engine restarted between the scrapes
    prefix_cache_queries: int | None = None  # tokens looked up in the prefix cache in the interval
    prefix_cache_hit_rate: float | None = None  # hits / queries in the interval; None when nothing was looked up

    @property
    def ttft_count(self) -> int | None:
        return self.histograms[TTFT].count

    @property
    def ttft(self) -> tuple[float | None, ...]:
        return self.histograms[TTFT].quantiles


def _increase(prev: Reading, cur: Reading, name: str) -> tuple[float | None, bool]:
    """A counter's increase between two readings and whether it was reset (went down): then, as
    Prometheus's ``rate`` takes it, the increase is the new value, counted from zero."""
    now, before = cur.counters.get(name), prev.counters.get(name)
    if now is None or before is None:
        return None, False
    return (now, True) if now < before else (now - before, False)


def interval(prev: Reading | None, cur: Reading, dt_s: float | None) -> Interval:
    """Counters as rates, the prefix cache's hits over its queries, and each histogram as percentiles
    (and a mean, where its ``_sum`` and ``_count`` are read) over ``dt_s`` seconds since ``prev``.

    A counter below its previous value was reset (the engine restarted): its increase is the new
    value. The same for a histogram when a bucket, its sum or its count went down or its bounds
    changed. An older name (``ITL_OLD``, the ``gpu_`` prefix-cache counters) is read only where the
    current one is absent from this scrape."""
    none = {name: NO_DISTRIBUTION for name in (TTFT, QUEUE_TIME, ITL)}
    if prev is None or dt_s is None or dt_s <= 0:
        return Interval(dict.fromkeys(COUNTERS), none, 0)
    resets = 0
    rates: dict[str, float | None] = {}
    for name in COUNTERS:
        increase, reset = _increase(prev, cur, name)
        resets += reset
        rates[name] = None if increase is None else increase / dt_s
    queries_name, hits_name = ((PREFIX_QUERIES, PREFIX_HITS) if PREFIX_QUERIES in cur.counters
                               else (PREFIX_QUERIES_OLD, PREFIX_HITS_OLD))
    (queries, reset_q), (hits, reset_h) = _increase(prev, cur, queries_name), _increase(prev, cur, hits_name)
    resets += reset_q + reset_h
    if reset_q != reset_h and queries is not None and hits is not None:  # one went down: the engine restarted
        queries, hits = cur.counters[queries_name], cur.counters[hits_name]
    # a scrape is another process's text: a rate outside [0, 1] or a count beyond an Avro long is no figure
    hit_rate = hits / queries if queries and hits is not None and 0 <= hits <= queries else None
    if queries is not None and not 0 <= queries <= MAX_COUNT:
        queries, hit_rate = None, None
    histograms = dict(none)
    for name, source in ((TTFT, TTFT), (QUEUE_TIME, QUEUE_TIME),
                         (ITL, ITL if ITL in cur.buckets or ITL in cur.totals else ITL_OLD)):
        histograms[name], reset = _distribution(prev, cur, source)
        resets += reset
    return Interval(rates, histograms, resets, None if queries is None else int(round(queries)), hit_rate)


MAX_COUNT = 2**63 - 1  # an Avro long


def _distribution(prev: Reading, cur: Reading, name: str) -> tuple[Distribution, bool]:
    """Histogram ``name`` over the interval, and whether it was reset."""
    now, before = cur.buckets.get(name, {}), prev.buckets.get(name, {})
    now_totals, before_totals = cur.totals.get(name, {}), prev.totals.get(name, {})
    bounds = sorted(now)
    deltas = [now[b] - before.get(b, math.nan) for b in bounds]
    total_deltas = {part: now_totals[part] - before_totals[part] for part in ("sum", "count")
                    if part in now_totals and part in before_totals}
    if not (now and before) and len(total_deltas) < 2:
        return NO_DISTRIBUTION, False  # not exported, or not in both scrapes
    reset = bool(now and before) and (set(bounds) != set(before) or any(not d >= 0 for d in deltas))
    reset = reset or any(d < 0 for d in total_deltas.values())
    if reset:
        deltas = [now[b] for b in bounds]
        total_deltas = {part: now_totals[part] for part in total_deltas}
    count: int | None = None
    quantiles: tuple[float | None, ...] = (None,) * len(QUANTILES)
    if now and before:
        cumulative, running = [], 0.0
        for bound, delta in zip(bounds, deltas):
            running = max(running, delta)  # a scrape is not atomic: keep the counts monotonic, as Prometheus does
            cumulative.append((bound, running))
        count = int(round(cumulative[-1][1])) if math.isinf(bounds[-1]) else None
        quantiles = tuple(quantile(q, cumulative) for q in QUANTILES)
    mean: float | None = None
    if len(total_deltas) == 2:
        if count is None:
            count = int(round(total_deltas["count"]))
        if total_deltas["count"] > 0:
            mean = total_deltas["sum"] / total_deltas["count"]
    if count is not None and not 0 <= count <= MAX_COUNT:  # not a count an engine observed: no figure
        count, quantiles, mean = None, (None,) * len(QUANTILES), None
    return Distribution(count, quantiles, mean), reset
