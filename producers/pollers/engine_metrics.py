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
from dataclasses import dataclass, field, replace

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

SeriesKey = tuple[tuple[str, str], ...]  # a series' labels but ``le``, sorted: one replica's counter or histogram
LEFT_OUT = "histogram series left out (a sample refused)"


@dataclass
class Histogram:
    """One histogram series at one scrape: bucket bound (le) -> cumulative count, and its _sum and _count."""

    buckets: dict[float, float] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)


@dataclass
class Reading:
    """One engine's allowed figures at one scrape, series by series (``counter_series``, ``histogram_series``:
    the rates and deltas are taken per series, then added up) and as the engine's totals (``gauges`` summed,
    the largest for KV usage and for awake; ``counters``, ``buckets`` and ``totals`` summed; a name with a
    refused series has no total). ``series_refused``: the series with a sample refused at this scrape;
    ``age``: seconds by which a series carried from an earlier scrape (:func:`carry`) is older than this one."""

    engine: str
    model_name: str = ""
    gauges: dict[str, float] = field(default_factory=dict)
    awake: float | None = None
    counters: dict[str, float] = field(default_factory=dict)  # COUNTERS and PREFIX_COUNTERS
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # histogram -> bucket bound (le) -> cumulative count
    totals: dict[str, dict[str, float]] = field(default_factory=dict)  # histogram -> {"sum": ..., "count": ...}
    counter_series: dict[str, dict[SeriesKey, float]] = field(default_factory=dict)
    histogram_series: dict[str, dict[SeriesKey, Histogram]] = field(default_factory=dict)
    gauge_series: dict[str, dict[SeriesKey, float]] = field(default_factory=dict)  # SLEEP_STATE: its awake series
    series_refused: set[tuple[str, SeriesKey]] = field(default_factory=set)  # (name or histogram, series)
    age: dict[tuple[str, SeriesKey], float] = field(default_factory=dict)

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
    text the parser rejects is one refusal (``unparseable``) and nothing else is kept from it.

    A sample refused for its value (not finite, below 0) or its bucket bound refuses its whole series at
    this scrape: a histogram series without one of its buckets is no histogram (the rest of it is counted
    as ``LEFT_OUT``), and an engine's gauge with one series refused has no sum."""
    from prometheus_client.parser import text_string_to_metric_families

    out = Parsed()
    engines: dict[str, Reading] = {}
    refused: dict[str, set[tuple[str, SeriesKey]]] = {}  # engine -> series refused, also of engines not made
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
                _take(engines, refused, out, name, sample.labels, sample.value, max_engines)
    except Exception:  # noqa: BLE001 - the parser's errors are ValueError, IndexError, ...: the text is bad
        out.refused["unparseable"] += 1
        return out
    for engine, reading in engines.items():
        _total(reading, refused.get(engine, set()), out)
    out.engines = engines
    return out


def _take(engines: dict[str, Reading], refused: dict[str, set[tuple[str, SeriesKey]]], out: Parsed, name: str,
          labels: dict[str, str], value: float, max_engines: int) -> None:
    engine, model = labels.get("engine", ""), labels.get("model_name", "")
    if len(engine) > MAX_LABEL or len(model) > MAX_LABEL:
        out.refused["label too long"] += 1
        return
    histogram, part = _HISTOGRAM_PARTS.get(name, ("", ""))
    key: SeriesKey = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
    ident = (histogram or name, key)
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        out.refused["not a finite value >= 0"] += 1
        if name != SLEEP_STATE or labels.get("sleep_state") == "awake":
            refused.setdefault(engine, set()).add(ident)
        return
    le = math.nan
    if part == "bucket":
        try:
            le = float(labels.get("le", ""))  # "+Inf" reads as inf
        except ValueError:
            le = math.nan
        if math.isnan(le):
            out.refused["bucket without a bound"] += 1
            refused.setdefault(engine, set()).add(ident)
            return
    reading = engines.get(engine)
    if reading is None:
        if len(engines) >= max_engines:
            out.refused["too many engines"] += 1
            return
        reading = engines[engine] = Reading(engine, model)
    if name == SLEEP_STATE:
        if labels.get("sleep_state") == "awake":
            reading.gauge_series.setdefault(name, {})[key] = value
    elif part:
        h = reading.histogram_series.setdefault(histogram, {}).setdefault(key, Histogram())
        if part == "bucket":
            h.buckets[le] = h.buckets.get(le, 0.0) + value
        else:
            h.totals[part] = h.totals.get(part, 0.0) + value
    elif name in COUNTERS or name in PREFIX_COUNTERS:
        series = reading.counter_series.setdefault(name, {})
        series[key] = series.get(key, 0.0) + value
    else:
        series = reading.gauge_series.setdefault(name, {})
        series[key] = series.get(key, 0.0) + value


def _total(reading: Reading, refused: set[tuple[str, SeriesKey]], out: Parsed) -> None:
    """Drop the refused series from ``reading`` and add up each name's series: the engine's totals."""
    reading.series_refused = refused
    for name, key in refused:
        if reading.histogram_series.get(name, {}).pop(key, None) is not None:
            out.refused[LEFT_OUT] += 1
        reading.counter_series.get(name, {}).pop(key, None)
    bad = {name for name, _ in refused}
    for name, series in reading.gauge_series.items():
        if name in bad or not series:
            continue  # a sum or a largest without one of its series is no figure
        value = max(series.values()) if name in (SLEEP_STATE, KV_USAGE, KV_USAGE_OLD) else sum(series.values())
        if name == SLEEP_STATE:
            reading.awake = value
        else:
            reading.gauges[name] = value
    reading.counters = {name: sum(c.values()) for name, c in reading.counter_series.items() if name not in bad and c}
    for name, histograms in reading.histogram_series.items():
        for h in histograms.values() if name not in bad else ():
            for total, parts in ((reading.buckets, h.buckets), (reading.totals, h.totals)):
                into: dict = total.setdefault(name, {}) if parts else {}
                for part, value in parts.items():
                    into[part] = into.get(part, 0.0) + value


def carry(prev: Reading | None, cur: Reading, dt_s: float | None) -> Reading:
    """``cur`` as the previous reading of the next interval: each series it refused taken from ``prev``
    (its last good value, ``dt_s`` older), so that a sample refused once is neither a reset nor a gap."""
    if prev is None or dt_s is None or not cur.series_refused:
        return cur
    kept = replace(cur, counter_series={n: dict(s) for n, s in cur.counter_series.items()},
                   histogram_series={n: dict(s) for n, s in cur.histogram_series.items()}, age=dict(cur.age))
    for name, key in cur.series_refused:
        counter, histogram = prev.counter_series.get(name, {}).get(key), prev.histogram_series.get(name, {}).get(key)
        if counter is not None:
            kept.counter_series.setdefault(name, {})[key] = counter
        if histogram is not None:
            kept.histogram_series.setdefault(name, {})[key] = histogram
        if counter is not None or histogram is not None:
            kept.age[(name, key)] = prev.age.get((name, key), 0.0) + dt_s
    return kept


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
    resets: int  # counter and histogram series that went down: an engine (or one replica of it) restarted
    prefix_cache_queries: int | None = None  # tokens looked up in the prefix cache in the interval
    prefix_cache_hit_rate: float | None = None  # hits / queries in the interval; None when nothing was looked up

    @property
    def ttft_count(self) -> int | None:
        return self.histograms[TTFT].count

    @property
    def ttft(self) -> tuple[float | None, ...]:
        return self.histograms[TTFT].quantiles



def _counters(r: Reading, name: str) -> dict[SeriesKey, float]:
    """A counter's series; a reading built with only its totals is one series."""
    if name in r.counter_series:
        return r.counter_series[name]
    return {(): r.counters[name]} if name in r.counters else {}


def _histograms(r: Reading, name: str) -> dict[SeriesKey, Histogram]:
    if name in r.histogram_series:
        return r.histogram_series[name]
    if name in r.buckets or name in r.totals:
        return {(): Histogram(r.buckets.get(name, {}), r.totals.get(name, {}))}
    return {}


def _increases(prev: Reading, cur: Reading, name: str) -> dict[SeriesKey, tuple[float, bool]]:
    """Each series' increase between two readings (the series in both) and whether it was reset (went
    down): then, as Prometheus's ``rate`` takes it, the increase is the new value, counted from zero."""
    before = _counters(prev, name)
    return {key: (now, True) if now < before[key] else (now - before[key], False)
            for key, now in _counters(cur, name).items() if key in before}


def interval(prev: Reading | None, cur: Reading, dt_s: float | None) -> Interval:
    """Counters as rates, the prefix cache's hits over its queries, and each histogram as percentiles
    (and a mean, where its ``_sum`` and ``_count`` are read) over ``dt_s`` seconds since ``prev``.

    As Prometheus's ``sum(rate(...))``: each series (one replica, say) is rated on its own, over the time
    since its previous value, and a series below its previous value was reset (its increase is the new
    value); then the series are added up. A histogram series was reset when a bucket, its sum or its
    count went down or its bounds changed; the series' deltas are then merged by bound. A series in one
    reading only is not in the interval; a name with a series refused in ``cur`` has no figure (a sum
    without a part), its resets still counted. An older name (``ITL_OLD``, the ``gpu_`` prefix-cache
    counters) is read only where the current one is absent from this scrape."""
    none = {name: NO_DISTRIBUTION for name in (TTFT, QUEUE_TIME, ITL)}
    if prev is None or dt_s is None or dt_s <= 0:
        return Interval(dict.fromkeys(COUNTERS), none, 0)
    partial = {name for name, _ in cur.series_refused}
    resets = 0
    rates: dict[str, float | None] = {}
    for name in COUNTERS:
        increases = _increases(prev, cur, name)
        resets += sum(reset for _, reset in increases.values())
        rates[name] = (sum(inc / (dt_s + prev.age.get((name, key), 0.0)) for key, (inc, _) in increases.items())
                       if increases and name not in partial else None)
    queries_name, hits_name = ((PREFIX_QUERIES, PREFIX_HITS) if _counters(cur, PREFIX_QUERIES) or PREFIX_QUERIES in partial
                               else (PREFIX_QUERIES_OLD, PREFIX_HITS_OLD))
    q, h = _increases(prev, cur, queries_name), _increases(prev, cur, hits_name)
    resets += sum(reset for _, reset in (*q.values(), *h.values()))
    for key in q.keys() & h.keys():
        if q[key][1] != h[key][1]:  # one went down: that series' engine restarted, both count from zero
            q[key], h[key] = (_counters(cur, queries_name)[key], True), (_counters(cur, hits_name)[key], True)
    queries = sum(inc for inc, _ in q.values()) if q else None
    hits = sum(inc for inc, _ in h.values()) if h else None
    # a scrape is another process's text: a rate outside [0, 1] or a count beyond an Avro long is no figure
    hit_rate = hits / queries if queries and hits is not None and 0 <= hits <= queries else None
    if queries is not None and not 0 <= queries <= MAX_COUNT or {queries_name, hits_name} & partial:
        queries, hit_rate = None, None
    histograms = dict(none)
    itl = ITL if _histograms(cur, ITL) or ITL in partial else ITL_OLD
    for name, source in ((TTFT, TTFT), (QUEUE_TIME, QUEUE_TIME), (ITL, itl)):
        distribution, reset = _distribution(prev, cur, source)
        histograms[name] = NO_DISTRIBUTION if source in partial else distribution
        resets += reset
    return Interval(rates, histograms, resets, None if queries is None else int(round(queries)), hit_rate)


MAX_COUNT = 2**63 - 1  # an Avro long


def _delta(before: Histogram, now: Histogram) -> tuple[dict[float, float] | None, dict[str, float], bool] | None:
    """One histogram series over the interval: bucket increases (None without buckets in both), the increases
    of _sum and _count (those in both), and whether it was reset; None if it gives nothing."""
    bounds = sorted(now.buckets)
    deltas: dict[float, float] | None = {b: now.buckets[b] - before.buckets.get(b, math.nan) for b in bounds}
    totals: dict[str, float] = {part: now.totals[part] - before.totals[part] for part in ("sum", "count")
                                if part in now.totals and part in before.totals}
    bucketed = bool(now.buckets and before.buckets)
    if not bucketed and len(totals) < 2:
        return None  # not exported, or not in both scrapes
    reset = bucketed and (set(bounds) != set(before.buckets) or any(not d >= 0 for d in (deltas or {}).values()))
    reset = reset or any(d < 0 for d in totals.values())
    if reset:
        deltas, totals = dict(now.buckets), {part: now.totals[part] for part in totals}
    return (deltas if bucketed else None), totals, reset


def _distribution(prev: Reading, cur: Reading, name: str) -> tuple[Distribution, int]:
    """Histogram ``name`` over the interval, its series merged, and how many of them were reset."""
    before = _histograms(prev, name)
    parts = [d for key, h in _histograms(cur, name).items() if key in before
             for d in [_delta(before[key], h)] if d is not None]
    if not parts:
        return NO_DISTRIBUTION, 0
    resets = sum(reset for _, _, reset in parts)
    count: int | None = None
    quantiles: tuple[float | None, ...] = (None,) * len(QUANTILES)
    if all(deltas is not None for deltas, _, _ in parts):
        # bounds every series has: a cumulative count there is exact (vLLM's replicas share their buckets)
        bounds = sorted(set.intersection(*(set(deltas or {}) for deltas, _, _ in parts)))
        cumulative, running = [], 0.0
        for bound in bounds:
            running = max(running, sum((deltas or {})[bound] for deltas, _, _ in parts))  # a scrape is not atomic:
            cumulative.append((bound, running))  # keep the counts monotonic, as Prometheus does
        if bounds:
            count = int(round(cumulative[-1][1])) if math.isinf(bounds[-1]) else None
            quantiles = tuple(quantile(q, cumulative) for q in QUANTILES)
    mean: float | None = None
    if all(len(totals) == 2 for _, totals, _ in parts):
        observed, seconds = sum(t["count"] for _, t, _ in parts), sum(t["sum"] for _, t, _ in parts)
        if count is None:
            count = int(round(observed))
        if observed > 0:
            mean = seconds / observed
    if count is not None and not 0 <= count <= MAX_COUNT:  # not a count an engine observed: no figure
        count, quantiles, mean = None, (None,) * len(QUANTILES), None
    return Distribution(count, quantiles, mean), resets
