"""Small statistics helpers for the benchmarks: medians, percentiles, ratios.

Kept free of numpy so ``make bench`` needs nothing the pipeline does not already install.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not None; None when there are none (a figure that failed)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks.

    Linear interpolation (numpy's default) so that p50 of an even-sized sample is the median.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def weighted_percentile(pairs: Iterable[tuple[float, int]], q: float) -> float | None:
    """Percentile of values given with repeat counts, e.g. one latency per Kafka message shared by
    all its records; the lower value at a tie (nearest rank), so no expansion is needed."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    ordered = sorted((v, n) for v, n in pairs if n > 0)
    total = sum(n for _, n in ordered)
    if total == 0:
        return None
    rank = max(1, math.ceil(total * q / 100.0))  # 1-based nearest rank
    seen = 0
    for value, count in ordered:
        seen += count
        if seen >= rank:
            return value
    return ordered[-1][0]


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator
