"""What the compare page of ``rlpulse ui`` overlays, read from ClickHouse for N runs at once: no HTML.

Each figure is one query over every chosen run, ``(project, run_id, attempt) IN {runs:...}`` as a
ClickHouse-side parameter (never pasted into the SQL), on the per-step tables only (step_stats,
step_term_stats, reward_histograms, completion_length_histograms, steps and its step_metrics view):
nothing reads a run's rollouts, so 8 runs x 1,000 steps x 512 rollouts answer within a second. Each
query keeps the semantics of the saved query that gives the figure for one run (the browser test
compares them): the latest emission per step wins (argMax over emitted_at_ns), reward percentiles as
reward-percentiles estimates them, tokens/s and MFU as step-throughput publishes them, trainer
scalars from step_metrics as step-metrics reads them, configuration as run-config reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views.ui_data import exp_quantile, has_column, rows

MAX_RUNS = 8  # runs overlaid at once: 8 colours and 8 dash patterns tell them apart
METRIC_CHARTS = 6  # trainer scalars drawn at once
DEFAULT_METRICS = 3  # drawn when the URL chooses none: the first names every run has
INT_MAX = 2**63 - 1

Key = tuple[str, str, int]  # project, run_id, attempt
PerStep = dict[int, float]  # step -> value
Spread = dict[int, tuple[float, float, float]]  # step -> p10, p50, p90

RUNS = "(project, run_id, attempt) IN {runs:Array(Tuple(String, String, UInt32))}"
STEPS = "step BETWEEN {lo:Int64} AND {hi:Int64}"


@dataclass
class CompareData:
    """The figures of the chosen runs, each as {run key: {step: value}}; a run without a figure has no entry."""

    runs: list[Key]
    minutes: dict[Key, PerStep]  # step -> minutes from the run's first STEP event to the step's latest STEP event
    reward_mean: dict[Key, PerStep]  # step_stats
    clipped_ratio: dict[Key, PerStep]  # step_stats, rounded to 4 digits as clipped-ratio-trend
    reward: dict[Key, Spread]  # reward-percentiles' p10 / p50 / p90
    failure_rate: dict[str, dict[Key, PerStep]]  # term -> term-figures' failure_rate, 4 digits (steps with grader calls)
    lengths: dict[Key, Spread]  # completion length p10 / p50 / p90 (ui_data.exp_quantile)
    tokens_per_s: dict[Key, PerStep]  # step-throughput
    mfu: dict[Key, PerStep]  # step-throughput
    metric_names: dict[Key, list[str]]  # every trainer scalar each run logged
    metrics: dict[str, dict[Key, PerStep]]  # the chosen names
    config: dict[Key, dict[str, str]] | None  # run-config; None: the store predates migration 018
    chosen: list[str] = field(default_factory=list)


def resolve(store: Store, wanted: list[tuple[str, str, int | None]]
            ) -> tuple[list[Key], list[str], dict[Key, list[tuple[str, str, int | None]]]]:
    """The runs named (attempt None: the latest), a description of each one the store has no rows of, and for
    each run the URL's entries that name it (``p/r`` and ``p/r/2`` both name attempt 2 when it is the latest)."""
    pairs = sorted({(p, r) for p, r, _ in wanted})
    found = {(str(p), str(r)): {int(a) for a in attempts} for p, r, attempts in rows(store, """
        SELECT project, run_id, groupUniqArray(attempt) FROM {db}.steps
        WHERE (project, run_id) IN {pairs:Array(Tuple(String, String))} GROUP BY project, run_id""", pairs=pairs)}
    keys: list[Key] = []
    missing: list[str] = []
    named: dict[Key, list[tuple[str, str, int | None]]] = {}  # key -> the URL's entries that name it
    for project, run, attempt in wanted:
        attempts = found.get((project, run), set())
        if not attempts or (attempt is not None and attempt not in attempts):
            missing.append(f"{run!r} of project {project!r}" + (f" attempt {attempt}" if attempt is not None else ""))
            continue
        key = (project, run, attempt if attempt is not None else max(attempts))
        if key not in keys:
            keys.append(key)
        named.setdefault(key, []).append((project, run, attempt))
    return keys, missing, named


def _finite(v: Any) -> bool:
    """A figure that has a place on an axis: a NaN or an infinity (a trainer scalar that blew up, a histogram
    of zero counts) is left out of its line, as a step without the figure is; checked here, once per value,
    not per point drawn."""
    return all(map(math.isfinite, v)) if isinstance(v, tuple) else math.isfinite(v)


def _by_run(found: list[tuple], value: Any = None) -> dict[Key, dict[int, Any]]:
    """Rows (project, run_id, attempt, step, *values) as {key: {step: value(values)}}, finite values only."""
    out: dict[Key, dict[int, Any]] = {}
    for r in found:
        v = value(r[4:]) if value else float(r[4])
        if _finite(v):
            out.setdefault((str(r[0]), str(r[1]), int(r[2])), {})[int(r[3])] = v
    return out


def compare_data(store: Store, runs: list[Key], lo: int | None, hi: int | None, wanted: list[str]) -> CompareData:
    """Every figure of the compare page for ``runs`` over steps ``lo``..``hi``; ``wanted``: the trainer
    scalars the URL chose (at most METRIC_CHARTS of those any run has; none: the first DEFAULT_METRICS
    names every run has, or of any run when they share none)."""
    p: dict[str, Any] = {"runs": [tuple(k) for k in runs], "lo": -INT_MAX if lo is None else lo,
                         "hi": INT_MAX if hi is None else hi}
    stats = rows(store, f"""
        SELECT project, run_id, attempt, step, argMax(reward_mean, emitted_at_ns), round(argMax(clipped_ratio, emitted_at_ns), 4)
        FROM {{db}}.step_stats WHERE {RUNS} AND {STEPS} GROUP BY project, run_id, attempt, step""", **p)
    # reward-percentiles, grouped by run as well: the rank's bucket, interpolated, edges clamped to min / max
    reward = rows(store, f"""
        SELECT project, run_id, attempt, step, round(ps[1], 4), round(ps[2], 4), round(ps[3], 4) FROM (
            SELECT project, run_id, attempt, step, [0.1, 0.5, 0.9] AS qs,
                   arrayMap(q -> arrayFirstIndex(c -> c >= q * n, cum), qs) AS ks,
                   arrayMap((q, k) ->
                       if(k = 1, min_v, greatest(b[k - 1], min_v))
                       + (if(k = length(counts), max_v, least(b[k], max_v)) - if(k = 1, min_v, greatest(b[k - 1], min_v)))
                         * (q * n - (cum[k] - counts[k])) / counts[k], qs, ks) AS ps
            FROM (
                SELECT project, run_id, attempt, step, argMax(bounds, emitted_at_ns) AS b,
                       argMax(bucket_counts, emitted_at_ns) AS counts, arrayCumSum(counts) AS cum,
                       argMax(count, emitted_at_ns) AS n, argMax(min, emitted_at_ns) AS min_v,
                       argMax(max, emitted_at_ns) AS max_v
                FROM {{db}}.reward_histograms WHERE {RUNS} AND term = 'total' AND {STEPS}
                GROUP BY project, run_id, attempt, step)
            WHERE n > 0)""", **p)
    terms = rows(store, f"""
        SELECT project, run_id, attempt, step, term, round(argMax(failure_rate, emitted_at_ns), 4)
        FROM {{db}}.step_term_stats WHERE {RUNS} AND {STEPS} GROUP BY project, run_id, attempt, step, term
        HAVING argMax(graded, emitted_at_ns) > 0""", **p)
    lengths = rows(store, f"""
        SELECT project, run_id, attempt, step, argMax(scale, emitted_at_ns), argMax(zero_count, emitted_at_ns),
               argMax(offset, emitted_at_ns), argMax(bucket_counts, emitted_at_ns), argMax(count, emitted_at_ns),
               argMax(min, emitted_at_ns), argMax(max, emitted_at_ns)
        FROM {{db}}.completion_length_histograms WHERE {RUNS} AND {STEPS} GROUP BY project, run_id, attempt, step
        HAVING argMax(count, emitted_at_ns) > 0""", **p)
    # step-throughput: the step's latest STEP event; first_ns: the run's first STEP event (the time axis' 0)
    steps = rows(store, f"""
        SELECT project, run_id, attempt, step, (time_ns - first_ns) / 60e9,
            if(isFinite(throughput) AND (throughput > 0 OR (throughput = 0 AND duration_s > 0)), round(throughput, 2), NULL),
            if(mfu >= 0 AND mfu <= 1, round(mfu, 4), NULL)
        FROM (
            SELECT project, run_id, attempt, step, time_ns, throughput, duration_s, mfu,
                   min(time_ns) OVER (PARTITION BY project, run_id, attempt) AS first_ns
            FROM {{db}}.steps WHERE {RUNS} AND type = 'STEP'
            ORDER BY project, run_id, attempt, step, time_ns DESC LIMIT 1 BY project, run_id, attempt, step)
        WHERE {STEPS}""", **p)
    names = {(str(a), str(b), int(c)): sorted(str(n) for n in ns) for a, b, c, ns in rows(store, f"""
        SELECT project, run_id, attempt, groupUniqArray(name) FROM {{db}}.steps
        ARRAY JOIN mapKeys(metrics) AS name WHERE {RUNS} AND type IN ('STEP', 'METRICS') AND step >= 0
        GROUP BY project, run_id, attempt""", **p)}
    union = sorted({n for ns in names.values() for n in ns})
    shared = sorted(set.intersection(*(set(names.get(k, ())) for k in runs))) if runs else []
    chosen = [n for n in dict.fromkeys(wanted) if n in union][:METRIC_CHARTS] or (shared or union)[:DEFAULT_METRICS]
    metric_rows = rows(store, f"""
        SELECT project, run_id, attempt, step, name, value FROM {{db}}.step_metrics
        WHERE {RUNS} AND {STEPS} AND name IN {{names:Array(String)}}""", names=chosen, **p) if chosen else []
    metrics: dict[str, dict[Key, PerStep]] = {n: {} for n in chosen}
    for project, run, attempt, step, name, value in metric_rows:
        if math.isfinite(value):
            metrics[str(name)].setdefault((str(project), str(run), int(attempt)), {})[int(step)] = float(value)
    failure_rate: dict[str, dict[Key, PerStep]] = {}
    for project, run, attempt, step, term, rate in terms:
        if math.isfinite(rate):
            failure_rate.setdefault(str(term), {}).setdefault((str(project), str(run), int(attempt)), {})[int(step)] = float(rate)
    return CompareData(
        runs=runs,
        minutes=_by_run([r[:5] for r in steps]),
        reward_mean=_by_run([r[:5] for r in stats]),
        clipped_ratio=_by_run([(*r[:4], r[5]) for r in stats]),
        reward=_by_run(reward, lambda v: tuple(float(x) for x in v)),
        failure_rate=dict(sorted(failure_rate.items())),
        lengths=_by_run(lengths, lambda v: tuple(exp_quantile(q, *v) for q in (0.1, 0.5, 0.9))),
        tokens_per_s=_by_run([r[:5] for r in ((*s[:4], s[5]) for s in steps) if r[4] is not None]),
        mfu=_by_run([r[:5] for r in ((*s[:4], s[6]) for s in steps) if r[4] is not None]),
        metric_names={k: names.get(k, []) for k in runs}, metrics=metrics, config=run_config(store, runs), chosen=chosen)


def run_config(store: Store, runs: list[Key]) -> dict[Key, dict[str, str]] | None:
    """Each run's configuration as the saved query run-config reads it: the attempt's latest RUN_START
    that carried one ({} for a run that sent none); None when the store has no config column yet."""
    if not has_column(store, "steps", "config"):
        return None
    found = rows(store, f"""
        SELECT project, run_id, attempt, argMax(config, (time_ns, sequence_id)) FROM {{db}}.steps
        WHERE {RUNS} AND type = 'RUN_START' AND length(config) > 0 GROUP BY project, run_id, attempt""",
                 runs=[tuple(k) for k in runs])
    config: dict[Key, dict[str, str]] = {k: {} for k in runs}
    for project, run, attempt, settings in found:
        config[(str(project), str(run), int(attempt))] = {str(k): str(v) for k, v in settings.items()}
    return config


def differing(config: dict[Key, dict[str, str]]) -> list[str]:
    """The keys whose value is not the same in every run that sent a configuration (a key missing in
    one of them differs), sorted. A run that sent none ({}) takes no part: were it counted, every key
    would differ and the table would say nothing about the runs that do have settings."""
    present = [settings for settings in config.values() if settings]
    keys = sorted({k for settings in present for k in settings})
    return [k for k in keys if len({settings.get(k) for settings in present}) > 1]
