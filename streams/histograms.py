"""Reward and completion-length histograms (seed 001; buckets as in docs/figures-and-alerts.md, "The figures").

Their state lives in Faust tables, whose values travel through a changelog topic, so each
histogram round-trips through plain JSON types with ``to_dict`` / ``from_dict``. Standard
library only: the unit tests and the SDK side must not need Faust or Kafka.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Sequence

from rlpulse.streams import compiled

REWARD_BOUNDS: tuple[float, ...] = (0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1, 2, 5)
REWARD_BUCKETS = len(REWARD_BOUNDS) + 1

MAX_SCALE = 20  # OpenTelemetry's default and largest useful scale
MAX_SIZE = 160  # OpenTelemetry's default number of buckets


def _finite(x: float) -> float:
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"histogram value must be finite, got {x!r}")
    return x


def _either(pick: Callable[[float, float], float], a: float | None, b: float | None) -> float | None:
    """``pick(a, b)`` where both are set, else whichever is set (min/max of possibly empty sides)."""
    if a is None:
        return b
    return a if b is None else pick(a, b)


def reward_bucket(x: float) -> int:
    """Index (0..14) of the reward bucket holding ``x``.

    Bucket i holds ``REWARD_BOUNDS[i-1] < x <= REWARD_BOUNDS[i]``; bucket 0 holds every
    ``x <= 0`` (negative rewards too) and bucket 14 every ``x > 5``. Comparisons are exact, as
    in OpenTelemetry's explicit-bucket histogram, so a value lands in the same bucket here as in
    the job's own OpenTelemetry metrics: 0.1 + 0.2 (0.30000000000000004) falls in (0.3, 0.4].
    Raises ValueError for NaN and infinities.
    """
    # bisect_left finds the first bound b with x <= b.
    return bisect_left(REWARD_BOUNDS, _finite(x))


@dataclass
class RewardHistogram:
    """Fixed-bucket reward histogram for one (run, attempt, step, term).

    ``zeros`` counts rewards in bucket 0 (``x <= 0``). ``min`` and ``max`` are None when empty.
    ``sumsq`` (the sum of squares) gives the spread: seed 001's per-step spread of each term's share.
    """

    counts: list[int] = field(default_factory=lambda: [0] * REWARD_BUCKETS)
    count: int = 0
    sum: float = 0.0
    min: float | None = None
    max: float | None = None
    zeros: int = 0
    sumsq: float = 0.0

    def add(self, x: float) -> None:
        x = float(x)
        if not -math.inf < x < math.inf:  # NaN and the infinities: reward_bucket says which
            reward_bucket(x)
        i = bisect_left(REWARD_BOUNDS, x)  # the hot path of the streams: reward_bucket inlined
        self.counts[i] += 1
        self.count += 1
        self.sum += x
        self.sumsq += x * x
        if self.min is None or x < self.min:
            self.min = x
        if self.max is None or x > self.max:
            self.max = x
        if i == 0:
            self.zeros += 1

    def add_many(self, xs: list[float]) -> None:
        """``add`` of each of ``xs`` in order (the same sums, bit for bit), in one loop: a message's
        rewards of one step go in together. Finite values only: the caller checked them (a
        non-finite one raises, as ``add`` does, before anything is changed)."""
        if compiled.LOOPS is not None:  # this method line for line, in C (streams/_loops.pyx)
            compiled.LOOPS.reward_add_many(self, xs, REWARD_BOUNDS, reward_bucket)
            return
        if not -math.inf < sum(xs) < math.inf:  # NaN or an infinity anywhere makes the sum so
            for x in xs:
                reward_bucket(x)  # raises naming it
        counts, bounds = self.counts, REWARD_BOUNDS
        total, sq, lo, hi, zeros = self.sum, self.sumsq, self.min, self.max, self.zeros
        for x in xs:
            i = bisect_left(bounds, x)
            counts[i] += 1
            total += x
            sq += x * x
            if lo is None or x < lo:
                lo = x
            if hi is None or x > hi:
                hi = x
            if i == 0:
                zeros += 1
        self.count += len(xs)
        self.sum, self.sumsq, self.min, self.max, self.zeros = total, sq, lo, hi, zeros

    def merge(self, other: RewardHistogram) -> RewardHistogram:
        """A new histogram holding both sides' rewards; neither side changes."""
        return RewardHistogram(counts=[a + b for a, b in zip(self.counts, other.counts)],
                               count=self.count + other.count, sum=self.sum + other.sum,
                               min=_either(min, self.min, other.min), max=_either(max, self.max, other.max),
                               zeros=self.zeros + other.zeros, sumsq=self.sumsq + other.sumsq)

    @property
    def zero_fraction(self) -> float:
        """Share of rewards at or below 0; 0.0 when empty."""
        return self.zeros / self.count if self.count else 0.0

    @property
    def mean(self) -> float:
        """Mean reward; 0.0 when empty, like ``zero_fraction``."""
        return self.sum / self.count if self.count else 0.0

    @property
    def std(self) -> float:
        """Population standard deviation; 0.0 when empty."""
        if not self.count:
            return 0.0
        mean = self.sum / self.count
        return math.sqrt(max(self.sumsq / self.count - mean * mean, 0.0))

    def to_dict(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "count": self.count, "sum": self.sum,
                "min": self.min, "max": self.max, "zeros": self.zeros, "sumsq": self.sumsq}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RewardHistogram:
        counts = [int(c) for c in d["counts"]]
        if len(counts) != REWARD_BUCKETS:
            raise ValueError(f"reward histogram needs {REWARD_BUCKETS} counts, got {len(counts)}")
        return cls(counts=counts, count=int(d["count"]), sum=float(d["sum"]), min=d["min"],
                   max=d["max"], zeros=int(d["zeros"]),
                   sumsq=float(d.get("sumsq", 0.0)))  # absent from state written before it existed

    def encode(self) -> list[Any]:
        """The state as a run's changelog carries it: ``to_dict``'s values in a list (no key names)."""
        return [self.counts, self.count, self.sum, self.min, self.max, self.zeros, self.sumsq]

    @classmethod
    def decode(cls, v: list[Any] | dict[str, Any]) -> RewardHistogram:
        """``encode``'s list back (or ``to_dict``'s dict, as state written before the list was)."""
        if isinstance(v, dict):
            return cls.from_dict(v)
        counts, count, total, lo, hi, zeros, sumsq = v
        return cls.from_dict({"counts": counts, "count": count, "sum": total, "min": lo, "max": hi, "zeros": zeros,
                              "sumsq": sumsq})


def exp_index(value: float, scale: int) -> int:
    """Index of the OpenTelemetry base-2 exponential bucket holding ``value`` > 0.

    At scale s, base = 2**(2**-s) and bucket i holds (base**i, base**(i+1)]. Exact powers
    of two are handled exactly (2**e sits at the top of bucket (e << s) - 1 for s >= 0);
    scales <= 0 use the exponent mapping, scales > 0 the logarithm mapping.
    """
    mantissa, exp = math.frexp(value)  # value = mantissa * 2**exp with 0.5 <= mantissa < 1
    ieee_exp = exp - 1  # value lies in [2**ieee_exp, 2**(ieee_exp + 1))
    if mantissa == 0.5:
        return (ieee_exp << scale) - 1 if scale >= 0 else (ieee_exp - 1) >> -scale
    if scale <= 0:
        return ieee_exp >> -scale
    index = math.ceil(math.log(value) * (2**scale / math.log(2))) - 1
    # log() can be off by an ulp next to a power of two; the bucket must still lie inside
    # the power-of-two interval, which keeps downscaling consistent with the scale-0 index.
    return min(max(index, ieee_exp << scale), ((ieee_exp + 1) << scale) - 1)


_INDEX_CACHE: dict[tuple[float, int], int] = {}


def _cached_index(value: float, scale: int) -> int:
    """``exp_index``, remembered: completion lengths and durations repeat, and the log is the cost."""
    key = (value, scale)
    index = _INDEX_CACHE.get(key)
    if index is None:
        if len(_INDEX_CACHE) >= 65536:
            _INDEX_CACHE.clear()
        index = _INDEX_CACHE[key] = exp_index(value, scale)
    return index


def _downscale_needed(lo: int, hi: int, max_size: int) -> int:
    """Smallest k >= 0 such that indices lo..hi fit in max_size buckets after ``>> k``."""
    k = 0
    while (hi >> k) - (lo >> k) + 1 > max_size:
        k += 1
    return k


@dataclass
class ExpHistogram:
    """OpenTelemetry base-2 exponential histogram for non-negative values (completion lengths).

    Positive values go to buckets ``offset .. offset + len(counts) - 1`` at ``scale``; zeros go
    to ``zero_count``. ``count`` includes zeros. ``counts`` is trimmed: its first and last
    entries are non-zero unless it is empty. The scale starts at ``MAX_SCALE`` (pass
    ``scale=`` to start lower) and drops only as far as needed to keep the populated span
    within ``max_size`` buckets, so the final scale does not depend on insertion order.
    """

    scale: int = MAX_SCALE
    zero_count: int = 0
    offset: int = 0
    counts: list[int] = field(default_factory=list)
    count: int = 0
    sum: float = 0.0
    min: float | None = None
    max: float | None = None
    max_size: int = MAX_SIZE

    def __post_init__(self) -> None:
        # Two buckets always suffice at a low enough scale; fewer never can.
        if self.max_size < 2:
            raise ValueError(f"max_size must be at least 2, got {self.max_size}")

    def add(self, value: float) -> None:
        v = float(value)
        if not 0.0 <= v < math.inf:  # NaN fails every comparison
            v = _finite(value)
            raise ValueError(f"exponential histogram takes non-negative values, got {v!r}")
        self.count += 1
        self.sum += v
        if self.min is None or v < self.min:
            self.min = v
        if self.max is None or v > self.max:
            self.max = v
        if v == 0:
            self.zero_count += 1
            return
        index = _cached_index(v, self.scale)
        rel = index - self.offset
        if self.counts and 0 <= rel < len(self.counts):  # the common case: inside the populated span
            self.counts[rel] += 1
            return
        if not self.counts:
            self.offset, self.counts = index, [1]
            return
        last = self.offset + len(self.counts) - 1
        k = _downscale_needed(min(self.offset, index), max(last, index), self.max_size)
        if k:
            self._rebucket(self.scale - k)
            index, last = index >> k, last >> k
        if index < self.offset:
            self.counts[:0] = [0] * (self.offset - index)
            self.offset = index
        elif index > last:
            self.counts.extend([0] * (index - last))
        self.counts[index - self.offset] += 1

    def add_many(self, values: Sequence[float]) -> None:
        """``add`` of each of ``values`` in order: the same sum (added in order), the same buckets.

        The scale is lowered once, to the one the whole batch needs (``add`` one at a time would
        lower it step by step as the span grows): the final scale depends only on the populated
        span, and an index computed at a lower scale is the higher scale's index shifted
        (``exp_index`` multiplies the log by a power of two, which is exact), so every value lands
        in the bucket it would have. A value ``add`` refuses (negative, not finite) sends the
        batch through ``add`` one by one, so it raises at that value, as ``add`` would."""
        if compiled.LOOPS is not None:  # this method line for line, in C (streams/_loops.pyx)
            compiled.LOOPS.exp_add_many(self, values, _cached_index, _downscale_needed)
            return
        vs = [float(v) for v in values]
        if not vs:
            return
        if not (sum(vs) < math.inf and min(vs) >= 0.0):  # a NaN or an infinity makes the sum one
            for v in values:
                self.add(v)
            return
        positive = [v for v in vs if v != 0.0]
        lo_v, hi_v = (min(positive), max(positive)) if positive else (0.0, 0.0)
        total, lo, hi = self.sum, self.min, self.max
        for v in vs:
            total += v
            if lo is None or v < lo:
                lo = v
            if hi is None or v > hi:
                hi = v
        self.sum, self.min, self.max = total, lo, hi
        self.count += len(vs)
        self.zero_count += len(vs) - len(positive)
        if not positive:
            return
        scale = self.scale
        first, last = _cached_index(lo_v, scale), _cached_index(hi_v, scale)
        if self.counts:
            first, last = min(first, self.offset), max(last, self.offset + len(self.counts) - 1)
        k = _downscale_needed(first, last, self.max_size)
        if k:
            if self.counts:
                self._rebucket(scale - k)
            else:
                self.scale = scale - k
            scale, first, last = scale - k, first >> k, last >> k
        if not self.counts:
            self.offset, self.counts = first, [0] * (last - first + 1)
        elif first < self.offset or last > self.offset + len(self.counts) - 1:
            end = self.offset + len(self.counts) - 1
            self.counts = [0] * (self.offset - first) + self.counts + [0] * (last - end)
            self.offset = first
        counts, offset = self.counts, self.offset
        cache = _INDEX_CACHE
        for v in positive:
            index = cache.get((v, scale))
            if index is None:
                index = _cached_index(v, scale)
            counts[index - offset] += 1

    def _rebucket(self, scale: int) -> None:
        """Move the buckets down to ``scale``: bucket i becomes i >> (old scale - scale)."""
        k = self.scale - scale
        offset = self.offset >> k
        counts = [0] * (((self.offset + len(self.counts) - 1) >> k) - offset + 1)
        for i, c in enumerate(self.counts):
            counts[((self.offset + i) >> k) - offset] += c
        self.scale, self.offset, self.counts = scale, offset, counts

    def merge(self, other: ExpHistogram) -> ExpHistogram:
        """A new histogram holding both sides' values, at the larger scale that fits both.

        Both sides are brought to the smaller of the two scales, then lower if the combined
        span exceeds max_size (the smaller of the two). Commutative; neither side changes.
        """
        sides = [h for h in (self, other) if h.counts]
        out = ExpHistogram(scale=min(self.scale, other.scale), max_size=min(self.max_size, other.max_size),
                           zero_count=self.zero_count + other.zero_count, count=self.count + other.count,
                           sum=self.sum + other.sum, min=_either(min, self.min, other.min),
                           max=_either(max, self.max, other.max))
        if not sides:
            return out
        lo = min(h.offset >> (h.scale - out.scale) for h in sides)
        hi = max((h.offset + len(h.counts) - 1) >> (h.scale - out.scale) for h in sides)
        k = _downscale_needed(lo, hi, out.max_size)
        out.scale, out.offset, last = out.scale - k, lo >> k, hi >> k
        out.counts = [0] * (last - out.offset + 1)
        for h in sides:
            for i, c in enumerate(h.counts):
                out.counts[((h.offset + i) >> (h.scale - out.scale)) - out.offset] += c
        return out

    def quantile(self, q: float) -> float:
        """Estimate the q-quantile (0 <= q <= 1) from the buckets, by nearest rank.

        The value of rank max(1, ceil(q * count)) is located in the zero bucket (estimate 0.0)
        or in bucket i, whose estimate is its geometric midpoint base**(i + 0.5), clamped to
        [min, max]: within a factor sqrt(base) of the true value (about 3e-7 relative at
        scale 20, 19 % at scale 1). The first and last ranks return min and max exactly.
        Raises ValueError when empty or when q is outside [0, 1].
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be within [0, 1], got {q!r}")
        if self.count == 0 or self.min is None or self.max is None:
            raise ValueError("quantile of an empty histogram")
        rank = max(1, math.ceil(q * self.count))
        if rank == 1:
            return self.min
        if rank == self.count:
            return self.max
        seen = self.zero_count
        if rank <= seen:
            return 0.0
        for i, c in enumerate(self.counts):
            seen += c
            if rank <= seen:
                # Cap the exponent so the top float buckets do not overflow before clamping.
                mid = 2.0 ** min((self.offset + i + 0.5) / 2.0**self.scale, 1023.0)
                return min(max(mid, self.min), self.max)
        return self.max  # unreachable while count matches the buckets

    def quantiles(self, qs: tuple[float, ...]) -> list[float]:
        """``[quantile(q) for q in qs]`` in one pass over the buckets (``qs`` in ascending order):
        the same values, for a window's three duration percentiles at a third of the cost."""
        if compiled.LOOPS is not None:  # this method line for line, in C (streams/_loops.pyx)
            return compiled.LOOPS.exp_quantiles(self, qs)  # type: ignore[no-any-return]
        if not all(0.0 <= q <= 1.0 for q in qs):
            raise ValueError(f"quantiles must be within [0, 1], got {qs!r}")
        if self.count == 0 or self.min is None or self.max is None:
            raise ValueError("quantile of an empty histogram")
        lo, hi, count = self.min, self.max, self.count
        out: list[float] = []
        seen, counts, i, n = self.zero_count, self.counts, 0, len(self.counts)
        for q in qs:
            rank = max(1, math.ceil(q * count))
            if rank == 1:
                out.append(lo)
            elif rank == count:
                out.append(hi)
            elif rank <= self.zero_count:
                out.append(0.0)
            else:
                while i < n and rank > seen + counts[i]:  # the bucket holding this rank; ranks only grow
                    seen += counts[i]
                    i += 1
                if i == n:
                    out.append(hi)  # unreachable while count matches the buckets
                else:
                    mid = 2.0 ** min((self.offset + i + 0.5) / 2.0**self.scale, 1023.0)
                    out.append(min(max(mid, lo), hi))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "zero_count": self.zero_count, "offset": self.offset,
                "counts": list(self.counts), "count": self.count, "sum": self.sum,
                "min": self.min, "max": self.max, "max_size": self.max_size}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExpHistogram:
        return cls(scale=int(d["scale"]), zero_count=int(d["zero_count"]), offset=int(d["offset"]),
                   counts=[int(c) for c in d["counts"]], count=int(d["count"]), sum=float(d["sum"]),
                   min=d["min"], max=d["max"], max_size=int(d.get("max_size", MAX_SIZE)))

    def encode(self) -> list[Any]:
        """The state as a run's changelog carries it: ``to_dict``'s values in a list, a run of zero
        counts written as minus its length (a length histogram is mostly empty buckets)."""
        if compiled.LOOPS is not None:  # this method line for line, in C (streams/_loops.pyx)
            return compiled.LOOPS.exp_encode(self, MAX_SIZE)  # type: ignore[no-any-return]
        counts: list[int] = []
        zeros = 0
        for c in self.counts:
            if c:
                if zeros:
                    counts.append(-zeros if zeros > 1 else 0)
                    zeros = 0
                counts.append(c)
            else:
                zeros += 1
        out = [self.scale, self.zero_count, self.offset, counts, self.count, self.sum, self.min, self.max]
        if self.max_size != MAX_SIZE:
            out.append(self.max_size)
        return out

    @classmethod
    def decode(cls, v: list[Any] | dict[str, Any]) -> ExpHistogram:
        """``encode``'s list back (or ``to_dict``'s dict, as state written before the list was)."""
        if isinstance(v, dict):
            return cls.from_dict(v)
        counts: list[int] = []
        for c in v[3]:
            if c < 0:
                counts += [0] * -c
            else:
                counts.append(c)
        return cls.from_dict({"scale": v[0], "zero_count": v[1], "offset": v[2], "counts": counts, "count": v[4],
                              "sum": v[5], "min": v[6], "max": v[7], "max_size": v[8] if len(v) > 8 else MAX_SIZE})
