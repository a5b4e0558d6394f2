"""Per-step figures from ROLLOUT spans, in two stages.

Stage 1 (:class:`StepPartials`) counts the rollouts of each step per source partition of the
spans topic, skipping offsets it has already counted. Stage 2 (:func:`merge`) merges the
latest partial of every source partition by replacement, so a partial sent twice, or sent
again after a restart, never counts twice. The merged figures give the step stats, the
reward histograms (``total`` and each term's weighted share) and the completion-length
exponential histogram.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable, MutableMapping

from streams.histograms import REWARD_BOUNDS, ExpHistogram, RewardHistogram

MAX_SAMPLES = 4096  # distinct sample ids kept per step and partition; more are counted, not kept
MAX_TERMS = 64  # the SDK's cap on distinct reward terms per run


def _empty(partition: int, span: dict[str, Any]) -> dict[str, Any]:
    return {
        "partition": partition, "project": span["project"], "run_id": span["run_id"], "attempt": span["attempt"],
        "step": span["step"], "offset": -1, "updated_ns": 0, "rollouts": 0, "clipped": 0,
        "reward_sum": 0.0, "reward_sumsq": 0.0, "completions": 0, "completion_sum": 0, "completion_min": None,
        "completion_max": None, "hist": {}, "lengths": ExpHistogram().to_dict(), "samples": {},
        "samples_dropped": 0, "terms_dropped": 0,
    }


class StepPartials:
    """Stage 1: partial step figures per (source partition, run, attempt, step)."""

    def __init__(self, state: MutableMapping[str, Any], retention_s: float):
        self.state = state
        self.retention_ns = int(retention_s * 1e9)
        self.closed: dict[tuple[int, str, str, int], int] = {}  # highest deleted step per (partition, run)
        self.dropped_late = 0

    @staticmethod
    def key(partition: int, project: str, run_id: str, attempt: int, step: int) -> str:
        return json.dumps([partition, project, run_id, attempt, step], separators=(",", ":"))

    def add(self, span: dict[str, Any], partition: int, offset: int, now_ns: int) -> str:
        """Count one ROLLOUT span: ``added``, ``duplicate`` (offset already counted), ``late`` or ``ignored``."""
        if span.get("kind") != "ROLLOUT" or span.get("step") is None or span.get("reward") is None:
            return "ignored"
        key = self.key(partition, span["project"], span["run_id"], span["attempt"], span["step"])
        current = self.state.get(key)
        if current is not None and offset <= current["offset"]:
            return "duplicate"
        if current is None and span["step"] <= self.closed.get((partition, span["project"], span["run_id"], span["attempt"]), -1):
            self.dropped_late += 1
            return "late"
        value = json.loads(json.dumps(current)) if current else _empty(partition, span)  # a new value object
        _count(value, span)
        value["offset"] = offset
        value["updated_ns"] = now_ns
        self.state[key] = value
        return "added"

    def expired(self, now_ns: int, partition: int) -> list[str]:
        """Keys of ``partition`` quiet for longer than the retention; the caller deletes them once emitted."""
        return [k for k, v in list(self.state.items())
                if v is not None and v["partition"] == partition and now_ns - v["updated_ns"] > self.retention_ns]

    def forget(self, key: str) -> None:
        value = self.state.pop(key)
        run = (value["partition"], value["project"], value["run_id"], value["attempt"])
        self.closed[run] = max(self.closed.get(run, -1), value["step"])

    @staticmethod
    def record(value: dict[str, Any], emitted_at_ns: int) -> dict[str, Any]:
        """The StepPartial record carrying ``value``."""
        return {"project": value["project"], "run_id": value["run_id"], "attempt": value["attempt"],
                "step": value["step"], "source_partition": value["partition"],
                "state": json.dumps(value, separators=(",", ":")), "emitted_at_ns": emitted_at_ns}


def _count(value: dict[str, Any], span: dict[str, Any]) -> None:
    reward = float(span["reward"])
    value["rollouts"] += 1
    value["clipped"] += 1 if span.get("clipped") else 0
    value["reward_sum"] += reward
    value["reward_sumsq"] += reward * reward
    _hist_add(value, "total", reward)
    for term, share in sorted((span.get("term_shares") or {}).items()):
        if term in value["hist"] or len(value["hist"]) <= MAX_TERMS:
            _hist_add(value, term, float(share))
        else:
            value["terms_dropped"] += 1
    tokens = span.get("completion_tokens")
    if tokens is not None:
        value["completions"] += 1
        value["completion_sum"] += tokens
        value["completion_min"] = tokens if value["completion_min"] is None else min(value["completion_min"], tokens)
        value["completion_max"] = tokens if value["completion_max"] is None else max(value["completion_max"], tokens)
        lengths = ExpHistogram.from_dict(value["lengths"])
        lengths.add(tokens)
        value["lengths"] = lengths.to_dict()
    sample = span.get("sample_id")
    if sample is not None:
        group = value["samples"].get(sample)
        if group is None and len(value["samples"]) >= MAX_SAMPLES:
            value["samples_dropped"] += 1
        else:
            n, lo, hi, s, sq = group or (0, reward, reward, 0.0, 0.0)
            value["samples"][sample] = [n + 1, min(lo, reward), max(hi, reward), s + reward, sq + reward * reward]


def _hist_add(value: dict[str, Any], term: str, x: float) -> None:
    hist = RewardHistogram.from_dict(value["hist"][term]) if term in value["hist"] else RewardHistogram()
    hist.add(x)
    value["hist"][term] = hist.to_dict()


def merge(partials: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Merge the partial figures of one step (one per source partition)."""
    parts = list(partials)
    out = dict(parts[0])
    for key in ("rollouts", "clipped", "reward_sum", "reward_sumsq", "completions", "completion_sum",
                "samples_dropped", "terms_dropped"):
        out[key] = sum(p[key] for p in parts)
    mins = [p["completion_min"] for p in parts if p["completion_min"] is not None]
    maxs = [p["completion_max"] for p in parts if p["completion_max"] is not None]
    out["completion_min"] = min(mins) if mins else None
    out["completion_max"] = max(maxs) if maxs else None
    hist: dict[str, RewardHistogram] = {}
    lengths = ExpHistogram()
    samples: dict[str, list] = {}
    for p in parts:
        for term, h in p["hist"].items():
            other = RewardHistogram.from_dict(h)
            hist[term] = hist[term].merge(other) if term in hist else other
        lengths = lengths.merge(ExpHistogram.from_dict(p["lengths"]))
        for sample, (n, lo, hi, s, sq) in p["samples"].items():
            if sample in samples:
                n0, lo0, hi0, s0, sq0 = samples[sample]
                samples[sample] = [n0 + n, min(lo0, lo), max(hi0, hi), s0 + s, sq0 + sq]
            else:
                samples[sample] = [n, lo, hi, s, sq]
    out["hist"] = {t: h.to_dict() for t, h in hist.items()}
    out["lengths"] = lengths.to_dict()
    out["samples"] = samples
    return out


def _std(n: int, s: float, sq: float) -> float:
    if n == 0:
        return 0.0
    mean = s / n
    return math.sqrt(max(sq / n - mean * mean, 0.0))


def step_stats(m: dict[str, Any], complete: bool, emitted_at_ns: int) -> dict[str, Any]:
    """The StepStats record of merged figures ``m``."""
    n = m["rollouts"]
    total = RewardHistogram.from_dict(m["hist"]["total"]) if "total" in m["hist"] else RewardHistogram()
    groups = [g for g in m["samples"].values() if g[0] >= 2]
    # rewards are sums of floats: equal within 1e-9 counts as "all scored the same"
    same = sum(1 for g in groups if g[2] - g[1] <= 1e-9)
    spreads = [_std(g[0], g[3], g[4]) for g in groups]
    return {
        "project": m["project"], "run_id": m["run_id"], "attempt": m["attempt"], "step": m["step"],
        "rollouts": n, "clipped": m["clipped"], "clipped_ratio": m["clipped"] / n if n else 0.0,
        "reward_mean": m["reward_sum"] / n if n else 0.0, "reward_std": _std(n, m["reward_sum"], m["reward_sumsq"]),
        "reward_min": total.min if total.min is not None else 0.0,
        "reward_max": total.max if total.max is not None else 0.0,
        "reward_zero_fraction": total.zero_fraction,
        "completion_mean": m["completion_sum"] / m["completions"] if m["completions"] else 0.0,
        "completion_min": m["completion_min"] or 0, "completion_max": m["completion_max"] or 0,
        "samples": len(groups), "samples_same_reward": same,
        "sample_reward_spread_mean": sum(spreads) / len(spreads) if spreads else 0.0,
        "complete": complete, "emitted_at_ns": emitted_at_ns,
    }


def histogram_records(m: dict[str, Any], emitted_at_ns: int) -> list[dict[str, Any]]:
    """RewardHistogram records: ``total`` and one per declared term."""
    out = []
    for term, raw in sorted(m["hist"].items()):
        h = RewardHistogram.from_dict(raw)
        out.append({
            "project": m["project"], "run_id": m["run_id"], "attempt": m["attempt"], "step": m["step"], "term": term,
            "bounds": [float(b) for b in REWARD_BOUNDS], "bucket_counts": list(h.counts), "count": h.count,
            "sum": h.sum, "min": h.min if h.min is not None else 0.0, "max": h.max if h.max is not None else 0.0,
            "zero_fraction": h.zero_fraction, "emitted_at_ns": emitted_at_ns,
        })
    return out


def length_record(m: dict[str, Any], emitted_at_ns: int) -> dict[str, Any]:
    h = ExpHistogram.from_dict(m["lengths"])
    return {
        "project": m["project"], "run_id": m["run_id"], "attempt": m["attempt"], "step": m["step"],
        "scale": h.scale, "zero_count": h.zero_count, "offset": h.offset, "bucket_counts": list(h.counts),
        "count": h.count, "sum": float(h.sum), "min": float(h.min if h.min is not None else 0),
        "max": float(h.max if h.max is not None else 0), "emitted_at_ns": emitted_at_ns,
    }
