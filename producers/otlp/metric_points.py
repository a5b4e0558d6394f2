"""OTLP data points read as checked values, the arithmetic of per-series differencing, and the
per-step records (StepStats, RewardHistogram, StepTermStats, CompletionLengthHistogram) and grader
windows built from them (complete per the .avsc files).

Three value kinds: a number (sums and gauges), an explicit-bucket histogram (:class:`Hist`) and a
base-2 exponential histogram (:class:`ExpHist`). Each reader refuses a point rlpulse cannot trust
(:class:`~rlpulse.producers.otlp.identity.OtlpRejected`, naming the metric): a value that is NaN
or infinite, a negative count, bucket counts that do not match the bounds or do not add up to the
count, a scale outside [-10, 20], more buckets than :data:`MAX_BUCKETS`.

Differencing (``*_sub``) returns None where the series must start again: a bucket count went
down, the bounds changed, or an exponential histogram's scale went *up* (the SDK only ever lowers
it; a higher scale means a new series). A scale that went down is handled: the previous value is
downscaled (bucket index >> (old_scale - new_scale)) before subtracting.

min/max of a difference (:func:`delta_min_max`): a cumulative min/max that changed since the
previous point was reached in this interval, so it is exact. One that did not change says nothing
about the interval: it is then estimated as the lowest (highest) nonempty bucket's lower (upper)
bound of the difference, clipped to the cumulative min (max), so it is never beyond a value really
seen. Delta points, and a series seen first or started again, carry their interval's exact min/max.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from rlpulse.producers.otlp.identity import SEED, OtlpRejected

MAX_BUCKETS = 512  # explicit bounds + 1, or positive + negative exponential buckets (the SDK's default: 160)
MIN_SCALE, MAX_SCALE = -10, 20  # OTel's exponential histogram scales
MAX_OFFSET = 2**31 - 1  # an Avro int
MAX_COUNT = 2**63 - 1  # an Avro long


@dataclass(frozen=True)
class Hist:
    """An explicit-bucket histogram: ``counts[i]`` holds bounds[i-1] < x <= bounds[i]."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    count: int
    sum: float
    min: float | None
    max: float | None


@dataclass(frozen=True)
class ExpHist:
    """A base-2 exponential histogram; ``pos``/``neg`` map a bucket index to its count (no zeros)."""

    scale: int
    zero_count: int
    pos: tuple[tuple[int, int], ...]
    neg: tuple[tuple[int, int], ...]
    count: int
    sum: float
    min: float | None
    max: float | None

    def dense(self) -> tuple[int, list[int]]:
        """The positive buckets as (offset, consecutive counts), as the record carries them."""
        if not self.pos:
            return 0, []
        low, high = self.pos[0][0], self.pos[-1][0]
        counts = [0] * (high - low + 1)
        for index, n in self.pos:
            counts[index - low] = n
        return low, counts


Value = float | Hist | ExpHist


def _finite(x: float, what: str) -> float:
    if not math.isfinite(x):
        raise OtlpRejected(f"{what}: the value {x} is not a finite number")
    return float(x)


def _count(n: int, what: str) -> int:
    if not 0 <= n <= MAX_COUNT:
        raise OtlpRejected(f"{what}: the count {n} is outside [0, 2^63-1]")
    return int(n)


def number(point: Any, what: str, counter: bool = False) -> float:
    """A NumberDataPoint's value (int or double); a counter's must be >= 0."""
    which = point.WhichOneof("value")
    if which is None:
        raise OtlpRejected(f"{what}: a data point has no value")
    value = float(point.as_int) if which == "as_int" else _finite(point.as_double, what)
    if counter and value < 0:
        raise OtlpRejected(f"{what}: a counter cannot be negative, got {value}")
    return value


def _min_max(point: Any, what: str) -> tuple[float | None, float | None]:
    low = _finite(point.min, what) if point.HasField("min") else None
    high = _finite(point.max, what) if point.HasField("max") else None
    return low, high


def histogram(point: Any, what: str) -> Hist:
    """A HistogramDataPoint, checked."""
    bounds = tuple(_finite(b, f"{what} bound") for b in point.explicit_bounds)
    counts = tuple(_count(n, what) for n in point.bucket_counts)
    if len(counts) != len(bounds) + 1:
        raise OtlpRejected(f"{what}: {len(counts)} bucket counts for {len(bounds)} bounds (must be bounds + 1)")
    if len(counts) > MAX_BUCKETS:
        raise OtlpRejected(f"{what}: {len(counts)} buckets, more than {MAX_BUCKETS}")
    if any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise OtlpRejected(f"{what}: the bounds are not strictly increasing")
    count = _count(point.count, what)
    if sum(counts) != count:
        raise OtlpRejected(f"{what}: the bucket counts add up to {sum(counts)}, not the count {count}")
    low, high = _min_max(point, what)
    return Hist(bounds, counts, count, _finite(point.sum, f"{what} sum") if point.HasField("sum") else 0.0, low, high)


def _buckets(b: Any, what: str, scale: int) -> tuple[tuple[int, int], ...]:
    offset = int(b.offset)
    # a bucket wholly beyond a double (lower edge >= 2^1024, upper <= 2^-1075) holds nothing an SDK records
    if abs(offset) + len(b.bucket_counts) > MAX_OFFSET or (b.bucket_counts and (
            math.ldexp(offset + len(b.bucket_counts) - 1, -scale) >= 1024 or math.ldexp(offset + 1, -scale) <= -1075)):
        raise OtlpRejected(f"{what}: bucket offset {offset} out of range")
    return tuple((offset + i, _count(n, what)) for i, n in enumerate(b.bucket_counts) if n)


def exponential(point: Any, what: str) -> ExpHist:
    """An ExponentialHistogramDataPoint, checked."""
    if not MIN_SCALE <= point.scale <= MAX_SCALE:
        raise OtlpRejected(f"{what}: scale {point.scale} outside [{MIN_SCALE}, {MAX_SCALE}]")
    n_buckets = len(point.positive.bucket_counts) + len(point.negative.bucket_counts)
    if n_buckets > MAX_BUCKETS:
        raise OtlpRejected(f"{what}: {n_buckets} buckets, more than {MAX_BUCKETS}")
    pos, neg = _buckets(point.positive, what, point.scale), _buckets(point.negative, what, point.scale)
    count, zero = _count(point.count, what), _count(point.zero_count, what)
    total = zero + sum(n for _, n in pos) + sum(n for _, n in neg)
    if total != count:
        raise OtlpRejected(f"{what}: zero and bucket counts add up to {total}, not the count {count}")
    low, high = _min_max(point, what)
    return ExpHist(int(point.scale), zero, pos, neg, count, _finite(point.sum, f"{what} sum") if point.HasField("sum") else 0.0,
                   low, high)


# -- arithmetic --------------------------------------------------------------------------------
def _merge(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...], sign: int) -> tuple[tuple[int, int], ...] | None:
    out = dict(a)
    for index, n in b:
        out[index] = out.get(index, 0) + sign * n
    if any(n < 0 for n in out.values()):
        return None
    return tuple(sorted((i, n) for i, n in out.items() if n))


def downscale(h: ExpHist, scale: int) -> ExpHist:
    """``h`` at the lower ``scale``: bucket i becomes bucket i >> (h.scale - scale)."""
    shift = h.scale - scale
    if shift <= 0:
        return h
    def down(buckets: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        merged = _merge((), tuple((i >> shift, n) for i, n in buckets), 1)
        return merged or ()
    return replace(h, scale=scale, pos=down(h.pos), neg=down(h.neg))


def _exp_bounds(h: ExpHist) -> list[tuple[float, float]]:
    """(lower, upper) of each nonempty bucket, lowest first."""
    def edge(i: int) -> float:  # 2^(i * 2^-scale); inf past a double (base ** i overflowed and raised)
        try:
            return 2.0 ** math.ldexp(i, -h.scale)
        except OverflowError:
            return math.inf
    out = [(-edge(i + 1), -edge(i)) for i, _ in reversed(h.neg)]
    if h.zero_count:
        out.append((0.0, 0.0))
    return out + [(edge(i), edge(i + 1)) for i, _ in h.pos]


def _hist_bounds(h: Hist) -> list[tuple[float, float]]:
    edges = (-math.inf, *h.bounds, math.inf)
    return [(edges[i], edges[i + 1]) for i, n in enumerate(h.counts) if n]


def delta_min_max(d: Hist | ExpHist, cur: Hist | ExpHist, prev: Hist | ExpHist) -> tuple[float | None, float | None]:
    """The min/max of the difference ``d = cur - prev`` of two cumulative points (module docstring)."""
    if d.count == 0:
        return None, None
    spans = _exp_bounds(d) if isinstance(d, ExpHist) else _hist_bounds(d)
    low, high = spans[0][0], spans[-1][1]
    if cur.min is not None and cur.min != prev.min:
        low = cur.min
    elif cur.min is not None:
        low = max(low, cur.min)
    elif not math.isfinite(low):
        low = spans[0][1]  # no min reported at all: the bucket's finite bound
    if cur.max is not None and cur.max != prev.max:
        high = cur.max
    elif cur.max is not None:
        high = min(high, cur.max)
    elif not math.isfinite(high):
        high = spans[-1][0]
    return low, high


def hist_sub(cur: Hist, prev: Hist) -> Hist | None:
    """cur - prev, or None when the series started again (bounds changed or a count went down)."""
    if cur.bounds != prev.bounds or cur.count < prev.count:
        return None
    counts = tuple(a - b for a, b in zip(cur.counts, prev.counts))
    if any(n < 0 for n in counts):
        return None
    d = Hist(cur.bounds, counts, cur.count - prev.count, cur.sum - prev.sum, None, None)
    low, high = delta_min_max(d, cur, prev)
    return replace(d, min=low, max=high)


def exp_sub(cur: ExpHist, prev: ExpHist) -> ExpHist | None:
    """cur - prev (prev downscaled to cur's scale first), or None when the series started again."""
    if cur.scale > prev.scale or cur.count < prev.count or cur.zero_count < prev.zero_count:
        return None
    prev = downscale(prev, cur.scale)
    pos, neg = _merge(cur.pos, prev.pos, -1), _merge(cur.neg, prev.neg, -1)
    if pos is None or neg is None:
        return None
    d = ExpHist(cur.scale, cur.zero_count - prev.zero_count, pos, neg, cur.count - prev.count, cur.sum - prev.sum,
                None, None)
    low, high = delta_min_max(d, cur, prev)
    return replace(d, min=low, max=high)


def _lower(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _higher(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def add(a: Value | None, b: Value) -> Value:
    """a + b: two differences of one series (held figures joined to the next step's)."""
    if a is None:
        return b
    if isinstance(a, float) and isinstance(b, float):
        return a + b
    if isinstance(a, Hist) and isinstance(b, Hist) and a.bounds == b.bounds:
        return Hist(a.bounds, tuple(x + y for x, y in zip(a.counts, b.counts)), a.count + b.count, a.sum + b.sum,
                    _lower(a.min, b.min), _higher(a.max, b.max))
    if isinstance(a, ExpHist) and isinstance(b, ExpHist):
        scale = min(a.scale, b.scale)
        a, b = downscale(a, scale), downscale(b, scale)
        h = ExpHist(scale, a.zero_count + b.zero_count, _merge(a.pos, b.pos, 1) or (), _merge(a.neg, b.neg, 1) or (),
                    a.count + b.count, a.sum + b.sum, _lower(a.min, b.min), _higher(a.max, b.max))
        # two far-apart series (or a series that started again elsewhere): the record's dense buckets
        # would span the gap, so downscale until they fit, as an SDK does
        while h.pos and h.pos[-1][0] - h.pos[0][0] >= MAX_BUCKETS and h.scale > MIN_SCALE:
            h = downscale(h, h.scale - 1)
        return h
    return b  # the kind or the bounds changed: the series started again, what was held before is superseded


def percentile(h: Hist, q: float) -> float:
    """The q-quantile of ``h`` by linear interpolation within its bucket: the rank q*count falls in
    bucket i (bounds[i-1], bounds[i]]; the value is lower + (upper - lower) * (rank - count below) /
    count in bucket, with the bucket's edges clipped to the histogram's min and max (the open first
    and last buckets take them as their edges). 0.0 for an empty histogram."""
    if h.count == 0:
        return 0.0
    rank = q * h.count
    edges = (-math.inf, *h.bounds, math.inf)
    below = 0
    for i, n in enumerate(h.counts):
        if n and below + n >= rank:
            lower, upper = edges[i], edges[i + 1]
            if h.min is not None:
                lower, upper = max(lower, h.min), max(upper, h.min)
            if h.max is not None:
                lower, upper = min(lower, h.max), min(upper, h.max)
            if not math.isfinite(lower):
                lower = upper if math.isfinite(upper) else 0.0
            if not math.isfinite(upper):
                upper = lower
            return lower + (upper - lower) * max(rank - below, 0.0) / n
        below += n
    return h.max if h.max is not None else (h.bounds[-1] if h.bounds else 0.0)


# -- the per-step records and grader windows (names: seed 001's without akka.optimize.training.) --
TOTAL = "total"  # the reward histogram's term for the whole reward
TERM_KEY, CAUSE_KEY, TOKEN_TYPE_KEY = SEED + "rl.term", SEED + "rl.grader.failure.cause", "gen_ai.token.type"
INPUT, OUTPUT = "input", "output"
MAX_LONG = 2**63 - 1

# Step gauges without a term: the figure each gives StepStats / Step.
CLIPPED_RATIO, REWARD_MEAN, REWARD_STD, REWARD_ZERO = (
    "rl.step.completion.clipped_ratio", "rl.step.reward.mean", "rl.step.reward.std", "rl.step.reward.zero_fraction")
LENGTH_MEAN, LENGTH_MIN, LENGTH_MAX = ("rl.step.completion.length.mean", "rl.step.completion.length.min",
                                       "rl.step.completion.length.max")
TOKENS, THROUGHPUT, MFU = "rl.step.tokens", "rl.step.throughput", "rl.step.mfu"
SHARE_MEAN, SHARE_STD = "rl.step.term.share.mean", "rl.step.term.share.std"
# Per-step figures that are counts: their differences are held until their step is known.
REWARD, LENGTHS, DURATION = "rl.rollout.reward", "rl.rollout.completion.length", "rl.grader.duration"
FAILURES, JUDGE_TOKENS = "rl.grader.failures", "rl.grader.tokens"
STATS_GAUGES = (CLIPPED_RATIO, REWARD_MEAN, REWARD_STD, REWARD_ZERO, LENGTH_MEAN, LENGTH_MIN, LENGTH_MAX)


@dataclass
class StepFigures:
    """What one step of one (run, attempt, writer) carries: gauges as last exported, the rest as
    the step's differences."""

    gauges: dict[str, float] = field(default_factory=dict)  # STATS_GAUGES, TOKENS, THROUGHPUT, MFU
    shares: dict[tuple[str, str], float] = field(default_factory=dict)  # (SHARE_MEAN|SHARE_STD, term)
    reward: dict[str, Hist] = field(default_factory=dict)  # term ('total' or a declared term)
    lengths: ExpHist | None = None
    duration: dict[str, Hist] = field(default_factory=dict)  # term -> grader-call durations (s)
    failures: dict[str, float] = field(default_factory=dict)  # term -> failed calls, all causes
    tokens: dict[tuple[str, str], float] = field(default_factory=dict)  # (term, input|output)

    def has_stats(self) -> bool:
        return TOTAL in self.reward or any(g in self.gauges for g in STATS_GAUGES)

    def terms(self) -> list[str]:
        named = set(self.reward) | {t for _, t in self.shares} | set(self.duration) | set(self.failures)
        return sorted((named | {t for t, _ in self.tokens}) - {TOTAL, ""})


def long_(x: float) -> int:
    return max(0, min(int(round(x)), MAX_LONG))


def zero_fraction(h: Hist) -> float:
    """Share of values <= 0: the buckets whose upper bound is <= 0 (exact with 0 among the bounds)."""
    zeros = sum(n for b, n in zip(h.bounds, h.counts) if b <= 0)
    return zeros / h.count if h.count else 0.0


def step_stats(ident: dict[str, Any], step: int, f: StepFigures, now_ns: int) -> dict[str, Any]:
    """StepStats: gauges where exported, else what the histograms give exactly (mean, zero
    fraction, min, max); figures OTel does not carry (sample groups, staleness) 0 or null."""
    total, g = f.reward.get(TOTAL), f.gauges
    rollouts = total.count if total else 0
    ratio = g.get(CLIPPED_RATIO, 0.0)
    lengths = f.lengths
    return {
        **ident, "step": step, "rollouts": rollouts, "clipped": long_(ratio * rollouts), "clipped_ratio": ratio,
        "reward_mean": g.get(REWARD_MEAN, total.sum / total.count if total and total.count else 0.0),
        "reward_std": g.get(REWARD_STD, 0.0),
        "reward_min": total.min if total and total.min is not None else 0.0,
        "reward_max": total.max if total and total.max is not None else 0.0,
        "reward_zero_fraction": g.get(REWARD_ZERO, zero_fraction(total) if total else 0.0),
        "completion_mean": g.get(LENGTH_MEAN, lengths.sum / lengths.count if lengths and lengths.count else 0.0),
        "completion_min": long_(g.get(LENGTH_MIN, lengths.min if lengths and lengths.min is not None else 0.0)),
        "completion_max": long_(g.get(LENGTH_MAX, lengths.max if lengths and lengths.max is not None else 0.0)),
        "samples": 0, "samples_same_reward": 0, "zero_std_fraction": None, "sample_reward_spread_mean": 0.0,
        "staleness_max": None, "staleness_mean": None,
        # every rollout the histogram counts was scored; OTel carries no failed rollouts
        "rollouts_attempted": rollouts, "rollouts_failed": 0,
        "complete": True, "emitted_at_ns": now_ns,
    }


def reward_histograms(ident: dict[str, Any], step: int, f: StepFigures, now_ns: int) -> list[dict[str, Any]]:
    return [{**ident, "step": step, "term": term, "bounds": list(h.bounds), "bucket_counts": list(h.counts),
             "count": h.count, "sum": h.sum, "min": h.min if h.min is not None else 0.0,
             "max": h.max if h.max is not None else 0.0, "zero_fraction": zero_fraction(h), "emitted_at_ns": now_ns}
            for term, h in sorted(f.reward.items())]


def durations(h: Hist | None) -> dict[str, float]:
    """Grader-call duration percentiles (metric_points.percentile) and max; 0.0 without calls."""
    if h is None or h.count == 0:
        return {"duration_p50_s": 0.0, "duration_p90_s": 0.0, "duration_p99_s": 0.0, "duration_max_s": 0.0}
    return {"duration_p50_s": percentile(h, 0.5), "duration_p90_s": percentile(h, 0.9),
            "duration_p99_s": percentile(h, 0.99), "duration_max_s": h.max if h.max is not None else percentile(h, 1.0)}


def term_stats(ident: dict[str, Any], step: int, f: StepFigures, now_ns: int) -> list[dict[str, Any]]:
    out = []
    for term in f.terms():
        h, calls = f.reward.get(term), f.duration.get(term)
        graded, failures = calls.count if calls else 0, long_(f.failures.get(term, 0.0))
        out.append({
            **ident, "step": step, "term": term, "rollouts": h.count if h else 0,
            "share_mean": f.shares.get((SHARE_MEAN, term), h.sum / h.count if h and h.count else 0.0),
            "share_std": f.shares.get((SHARE_STD, term), 0.0), "share_zero_fraction": zero_fraction(h) if h else 0.0,
            "graded": graded, "failures": failures, "failure_rate": failures / graded if graded else 0.0,
            "failure_cost": None,  # needs which rollouts a failure zeroed: the spans know, OTel's counts do not
            **durations(calls), "judge_input_tokens": long_(f.tokens.get((term, INPUT), 0.0)),
            "judge_output_tokens": long_(f.tokens.get((term, OUTPUT), 0.0)), "emitted_at_ns": now_ns})
    return out


def length_histogram(ident: dict[str, Any], step: int, h: ExpHist, now_ns: int) -> dict[str, Any]:
    offset, counts = h.dense()
    return {**ident, "step": step, "scale": h.scale, "zero_count": h.zero_count, "offset": offset,
            "bucket_counts": counts, "count": h.count, "sum": h.sum, "min": h.min if h.min is not None else 0.0,
            "max": h.max if h.max is not None else 0.0, "emitted_at_ns": now_ns}


def grader_window(ident: dict[str, Any], term: str, window: tuple[int, int], calls: Hist | None, failures: int,
                  now_ns: int) -> dict[str, Any]:
    graded = calls.count if calls else 0
    return {**ident, "term": term, "window_start_ns": window[0], "window_end_ns": window[1], "graded": graded,
            "failures": failures, "failure_rate": failures / graded if graded else 0.0, **durations(calls),
            "emitted_at_ns": now_ns}


def failure_window(ident: dict[str, Any], term: str, cause: str, window: tuple[int, int], failures: int, graded: int,
                   now_ns: int) -> dict[str, Any]:
    return {**ident, "term": term, "cause": cause, "window_start_ns": window[0], "window_end_ns": window[1],
            "failures": failures, "graded": graded, "emitted_at_ns": now_ns}
