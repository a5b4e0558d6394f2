"""The stored histograms as Prometheus classic histograms: cumulative ``le`` buckets, ``+Inf`` = count.

Completion lengths are stored per step as OpenTelemetry base-2 exponential histograms (the streams'
``ExpHistogram``): at scale ``s`` bucket ``i`` holds ``(2**(i*2**-s), 2**((i+1)*2**-s)]``,
``counts[k]`` is bucket ``offset + k``, and ``zero_count`` holds the zeros. Steps of different
scales merge at the lowest scale (bucket ``i`` at scale ``s`` is bucket ``i >> (s - t)`` at scale
``t < s``: exact, as OpenTelemetry downscales); the merged histogram is downscaled further while it spans
more than ``MAX_BUCKETS`` buckets, so one series never has more than ``MAX_BUCKETS + 2`` ``le``
values. Each bucket's upper bound becomes an ``le``; the lower edge of the first bucket is one more
``le`` holding only the zeros, so histogram_quantile interpolates inside the first bucket from its
real lower edge and not from 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

MAX_BUCKETS = 160  # exponential buckets per served series (OpenTelemetry's default max size)


@dataclass
class ExpHistogram:
    """A base-2 exponential histogram as stored (completion_length_histograms)."""

    scale: int
    zero_count: int = 0
    offset: int = 0
    counts: list[int] = field(default_factory=list)
    count: int = 0
    sum: float = 0.0


def downscale(h: ExpHistogram, scale: int) -> ExpHistogram:
    """``h`` at ``scale`` (<= its own): bucket i becomes i >> (h.scale - scale)."""
    if scale > h.scale:
        raise ValueError(f"cannot upscale a histogram from scale {h.scale} to {scale}")
    k = h.scale - scale
    if not h.counts:
        return ExpHistogram(scale, h.zero_count, 0, [], h.count, h.sum)
    offset = h.offset >> k
    counts = [0] * (((h.offset + len(h.counts) - 1) >> k) - offset + 1)
    for i, c in enumerate(h.counts):
        counts[((h.offset + i) >> k) - offset] += c
    return ExpHistogram(scale, h.zero_count, offset, counts, h.count, h.sum)


def merge(histograms: Iterable[ExpHistogram], max_buckets: int = MAX_BUCKETS) -> ExpHistogram | None:
    """The sum of ``histograms`` at the lowest of their scales, downscaled further while it spans more
    than ``max_buckets`` buckets; None when there are none."""
    hs = list(histograms)
    if not hs:
        return None
    scale = min(h.scale for h in hs)
    filled = [h for h in hs if h.counts]
    while filled:
        lo = min(h.offset >> (h.scale - scale) for h in filled)
        hi = max((h.offset + len(h.counts) - 1) >> (h.scale - scale) for h in filled)
        if hi - lo + 1 <= max_buckets:
            break
        scale -= 1
    out = ExpHistogram(scale, zero_count=sum(h.zero_count for h in hs), count=sum(h.count for h in hs),
                       sum=math.fsum(h.sum for h in hs))
    if filled:
        parts = [downscale(h, scale) for h in filled]
        out.offset = min(p.offset for p in parts)
        out.counts = [0] * (max(p.offset + len(p.counts) for p in parts) - out.offset)
        for p in parts:
            for i, c in enumerate(p.counts):
                out.counts[p.offset - out.offset + i] += c
    return out


def upper_bound(index: int, scale: int) -> float:
    """The upper edge of exponential bucket ``index`` at ``scale``: 2**((index+1) * 2**-scale)."""
    try:
        if scale <= 0:
            return math.ldexp(1.0, (index + 1) << -scale)  # an exact power of two
        return 2.0 ** ((index + 1) / (1 << scale))
    except OverflowError:
        return math.inf


def exponential_to_classic(h: ExpHistogram) -> list[tuple[float, int]]:
    """Cumulative ``(le, count)`` pairs of ``h``, the last ``(inf, h.count)``."""
    out: list[tuple[float, int]] = []
    running = h.zero_count
    if h.counts:
        out.append((upper_bound(h.offset - 1, h.scale), running))  # the first bucket's lower edge: the zeros only
        for i, c in enumerate(h.counts):
            running += c
            le = upper_bound(h.offset + i, h.scale)
            if math.isinf(le):
                break
            out.append((le, running))
    out.append((math.inf, h.count))
    return out


def fixed_to_classic(bounds: Sequence[float], bucket_counts: Sequence[int], count: int) -> list[tuple[float, int]]:
    """Cumulative ``(le, count)`` pairs of a fixed-bucket histogram (the reward's): bucket i holds
    ``bounds[i-1] < x <= bounds[i]``, the last one ``x > bounds[-1]``; the last pair is ``(inf, count)``."""
    if len(bucket_counts) != len(bounds) + 1:
        raise ValueError(f"{len(bucket_counts)} bucket counts for {len(bounds)} bounds: expected {len(bounds) + 1}")
    out, running = [], 0
    for bound, c in zip(bounds, bucket_counts):
        running += c
        out.append((float(bound), running))
    out.append((math.inf, count))
    return out
