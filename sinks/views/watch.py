"""``rlpulse watch``: a live terminal view of the active runs, read from ClickHouse.

:func:`snapshot` reads one frame's figures into plain dataclasses (sinks/views/watch_data.py);
:func:`render` turns a snapshot into a rich renderable that lays itself out on the terminal's
width (sinks/views/watch_view.py); :func:`watch` refreshes it in a rich ``Live`` view.

What the view counts as an active run, and how each figure is taken:

* A run is the latest attempt of a (project, run_id). It is shown when it reported (any step
  event: RUN_START, STEP, HEARTBEAT, RUN_END) in the last ``recent_s`` (10 min), or when a
  ``stalled_run``, ``first_step_stalled`` or ``silent_run`` alert of it is open whatever its age (a silent run stays
  on screen until it reports again or its alert resolves). ``show_all`` shows every run.
* State: ENDED after a RUN_END, shown as its status (FINISHED, FAILED, CANCELLED; ENDED from an
  SDK before the status); else SILENT or STALLED while that alert is open (SILENT wins:
  no report at all says more than no progress); else RUNNING.
* Step: the highest ``step`` of the attempt's STEP events. Steps per minute: the rise of
  ``step_count`` over the ``rate_window_s`` (5 min) up to now, or up to its RUN_END for an
  ended run (which keeps the pace it ended at; a stalled or silent run falls to 0); over the
  run's whole life when it is younger than that. ``step_count`` is a maximum, so several
  writers reporting the same steps do not add up.
* Reward mean and clipped ratio: the ``step_stats`` row of the attempt's highest step (the
  latest emission of that step wins).
* Failure rate: failures / graded over the ``grader_windows`` (all terms) that overlap the
  same ``rate_window_s`` (up to now or the RUN_END); the latest emission of a window wins.
* Open alerts: the latest record of each (rule, key) is FIRING (RESOLVED wins a tie of
  time_ns), as in the saved query ``stalled-runs``. An alert belongs to a run by its
  project/run_id/attempt, or, for GPU alerts keyed by ``hw_id``, by a GPU placed on the run.
* Tokens/s: the throughput of the attempt's latest STEP event, as the saved query ``step-throughput``
  takes it (none when not a finite number of 0 or more, or 0 without a duration).
* Chosen trainer scalars (``--metric loss``): each one's value at the highest step that logged it
  (``step_metrics``).
* GPUs: those placed on the attempt (``placements`` joined on ``hw_id``), with the latest
  sample of each inside [first placement, last placement + 60 s], as the report's GPU charts.

No query uses FINAL: every figure is a min/max/argMax that duplicates cannot change.
"""

from __future__ import annotations

import time
from typing import Any
from collections.abc import Callable

from rich.console import Console
from rich.live import Live

from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views.watch_data import NS, RECENT_S, Alert, Gpu, RunLine, WatchSnapshot
from rlpulse.sinks.views.watch_view import render  # the layout on the terminal's width

RATE_WINDOW_S = 300.0
PLACEMENT_SPAN_NS = 60 * NS  # a placement row covers its GPU for this long (as sinks/read/queries/gpu-utilization-by-run.sql)


def _rows(store: Store, sql: str, **params: Any) -> list[tuple]:
    return store.client.query(sql.replace("{db}", store.database), parameters=params).result_rows


def open_alerts(store: Store, project: str | None = None) -> list[Alert]:
    where = "WHERE project = {project:String}" if project else ""
    rows = _rows(store, f"""
        SELECT rule, key, severity_, summary_, project_, run_id_, attempt_, first_seen_ FROM (
            SELECT rule, key,
                   argMax(state, (time_ns, state = 'RESOLVED')) AS latest,
                   argMax(severity, (time_ns, state = 'RESOLVED')) AS severity_,
                   argMax(summary, (time_ns, state = 'RESOLVED')) AS summary_,
                   argMax(project, (time_ns, state = 'RESOLVED')) AS project_,
                   argMax(run_id, (time_ns, state = 'RESOLVED')) AS run_id_,
                   argMax(attempt, (time_ns, state = 'RESOLVED')) AS attempt_,
                   argMax(first_seen_ns, (time_ns, state = 'RESOLVED')) AS first_seen_
            FROM {{db}}.alerts {where} GROUP BY rule, key)
        WHERE latest = 'FIRING' ORDER BY first_seen_, rule, key""", project=project or "")
    return [Alert(str(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), str(r[5]), int(r[6]), int(r[7])) for r in rows]


def _attempts(store: Store, scope: str, now_ns: int, rate_ns: int, **params: Any) -> list[tuple]:
    """Per attempt in scope: first/last report, ended, last step, as-of time (RUN_END or now),
    step_count at the as-of time and rate_ns before it, RUN_END's status, and the tokens/s of the latest
    STEP event (a tuple, so that a NULL one is that step's and not skipped for an earlier one)."""
    return _rows(store, f"""
        SELECT project, run_id, attempt, min(time_ns), max(time_ns), countIf(type = 'RUN_END') > 0,
               countIf(type = 'STEP') > 0, maxIf(step, type = 'STEP'), any(asof_ns),
               maxIf(step_count, time_ns <= asof_ns),
               countIf(time_ns <= asof_ns - {{rate_ns:Int64}}) > 0,
               maxIf(step_count, time_ns <= asof_ns - {{rate_ns:Int64}}),
               argMaxIf(status, time_ns, type = 'RUN_END'),
               argMaxIf(tuple(if(isFinite(throughput) AND (throughput > 0 OR (throughput = 0 AND duration_s > 0)),
                                 throughput, NULL)), time_ns, type = 'STEP').1
        FROM (SELECT project, run_id, attempt, type, step, step_count, time_ns, status, throughput, duration_s,
                     if(countIf(type = 'RUN_END') OVER run > 0, minIf(time_ns, type = 'RUN_END') OVER run,
                        {{now:Int64}}) AS asof_ns
              FROM {{db}}.steps WHERE {scope}
              WINDOW run AS (PARTITION BY project, run_id, attempt))
        GROUP BY project, run_id, attempt ORDER BY project, run_id, attempt""", now=now_ns, rate_ns=rate_ns, **params)


def _rate(first_ns: int, asof_ns: int, count: int, has_before: bool, count_before: int, rate_ns: int) -> float | None:
    if has_before:
        return (count - count_before) * 60 * NS / rate_ns
    if asof_ns <= first_ns:
        return None
    return count * 60 * NS / (asof_ns - first_ns)  # younger than the window: over its whole life


def _step_stats(store: Store, keys: list[str]) -> dict[str, tuple[float, float]]:
    rows = _rows(store, """
        SELECT concat(project, '/', run_id, '/', toString(attempt)) AS k,
               argMax(reward_mean, (step, emitted_at_ns)), argMax(clipped_ratio, (step, emitted_at_ns))
        FROM {db}.step_stats WHERE k IN {keys:Array(String)} GROUP BY k""", keys=keys)
    return {r[0]: (float(r[1]), float(r[2])) for r in rows}


def _metrics(store: Store, keys: list[str], names: tuple[str, ...]) -> list[tuple]:
    """(run key, name, value at the highest step that logged it) of the chosen trainer scalars."""
    return _rows(store, """
        SELECT concat(project, '/', run_id, '/', toString(attempt)) AS k, name, argMax(value, (step, logged_ns))
        FROM {db}.step_metrics WHERE k IN {keys:Array(String)} AND name IN {names:Array(String)}
        GROUP BY k, name""", keys=keys, names=list(names))


def _windows(store: Store, keys: list[str], lo_ns: int) -> list[tuple]:
    return _rows(store, """
        SELECT concat(project, '/', run_id, '/', toString(attempt)) AS k, window_start_ns,
               argMax(window_end_ns, emitted_at_ns), argMax(failures, emitted_at_ns), argMax(graded, emitted_at_ns)
        FROM {db}.grader_windows WHERE k IN {keys:Array(String)} AND window_end_ns > {lo:Int64}
        GROUP BY k, term, window_start_ns""", keys=keys, lo=lo_ns)


def _gpus(store: Store, keys: list[str]) -> dict[str, list[Gpu]]:
    rows = _rows(store, f"""
        SELECT p.k, p.hw_id, p.host, p.idx,
               countIf(s.time_ns BETWEEN p.lo AND p.hi) AS n,
               argMaxIf(s.gpu_utilization, s.time_ns, s.time_ns BETWEEN p.lo AND p.hi),
               argMaxIf(s.power_w, s.time_ns, s.time_ns BETWEEN p.lo AND p.hi),
               maxIf(s.time_ns, s.time_ns BETWEEN p.lo AND p.hi),
               argMaxIf(s.memory_utilization, s.time_ns, s.time_ns BETWEEN p.lo AND p.hi)
        FROM (SELECT concat(project, '/', run_id, '/', toString(attempt)) AS k, assumeNotNull(hw_id) AS hw_id,
                     any(host) AS host, any(`index`) AS idx, min(time_ns) AS lo, max(time_ns) + {PLACEMENT_SPAN_NS} AS hi
              FROM {{db}}.placements
              WHERE k IN {{keys:Array(String)}} AND hw_id IS NOT NULL AND hw_id != ''
              GROUP BY k, hw_id) AS p
        LEFT JOIN (SELECT hw_id, time_ns, gpu_utilization, power_w, memory_utilization FROM {{db}}.gpu_samples
                   WHERE hw_id IN (SELECT assumeNotNull(hw_id) FROM {{db}}.placements
                                   WHERE concat(project, '/', run_id, '/', toString(attempt)) IN {{keys:Array(String)}}
                                     AND hw_id IS NOT NULL)) AS s ON s.hw_id = p.hw_id
        GROUP BY p.k, p.hw_id, p.host, p.idx ORDER BY p.k, p.idx, p.hw_id""", keys=keys)
    out: dict[str, list[Gpu]] = {}
    for k, hw_id, host, idx, n, util, power, t, memory in rows:
        sampled = n > 0
        out.setdefault(k, []).append(Gpu(hw_id, host, None if idx is None else int(idx), float(util) if sampled else None,
                                         float(power) if sampled else None, int(t) if sampled else None,
                                         float(memory) if sampled else None))
    return out


def snapshot(store: Store, now_ns: int, project: str | None = None, show_all: bool = False,
             recent_s: float = RECENT_S, rate_window_s: float = RATE_WINDOW_S,
             metrics: tuple[str, ...] = ()) -> WatchSnapshot:
    """The figures of one frame, read from ``store`` as of ``now_ns`` (see the module docstring);
    ``metrics``: trainer scalars (``step_metrics`` names) shown as columns, at their latest step."""
    rate_ns = int(rate_window_s * NS)
    since_ns = now_ns - int(recent_s * NS)
    if not _rows(store, "SELECT count() > 0 FROM system.tables WHERE database = {name:String} AND name = 'steps'",
                 name=store.database)[0][0]:  # nothing migrated yet: no run ever reached this store
        return WatchSnapshot(store.url, store.database, now_ns, [], False, show_all, project, recent_s,
                             getattr(store, "endpoint", None), metrics)
    alerts = open_alerts(store, project)
    stall_rules = {"stalled_run": "STALLED", "first_step_stalled": "STALLED", "silent_run": "SILENT"}
    stalls: dict[str, set[str]] = {}
    for a in alerts:
        if a.rule in stall_rules:
            stalls.setdefault(f"{a.project}/{a.run_id}/{a.attempt}", set()).add(stall_rules[a.rule])
    conditions = ["project = {project:String}"] if project else []
    if not show_all:
        conditions.append("((project, run_id) IN (SELECT project, run_id FROM {db}.steps WHERE time_ns >= {since:Int64})"
                          " OR concat(project, '/', run_id, '/', toString(attempt)) IN {stalled:Array(String)})")
    rows = _attempts(store, " AND ".join(conditions) or "1", now_ns, rate_ns, project=project or "", since=since_ns,
                     stalled=sorted(stalls))
    latest: dict[tuple[str, str], tuple] = {}
    for r in rows:  # ordered by attempt: the last one of a run wins
        latest[(r[0], r[1])] = r
    runs = []
    for (proj, run_id, attempt, first_ns, last_ns, ended, stepped, step, asof_ns, count, has_before, before,
         status, tokens_per_s) in latest.values():
        key = f"{proj}/{run_id}/{attempt}"
        if not (show_all or last_ns >= since_ns or key in stalls):
            continue
        state = "ENDED" if ended else next((s for s in ("SILENT", "STALLED") if s in stalls.get(key, ())), "RUNNING")
        runs.append(RunLine(str(proj), str(run_id), int(attempt), state, int(step) if stepped else None, int(count),
                            _rate(first_ns, asof_ns, count, bool(has_before), before, rate_ns), None, None, None, 0,
                            int(first_ns), int(last_ns), int(asof_ns), end_status=status if ended else None,
                            tokens_per_s=None if tokens_per_s is None else float(tokens_per_s)))
    keys = [r.key for r in runs]
    if runs:
        stats = _step_stats(store, keys)
        by_key = {r.key: r for r in runs}
        for k, (reward, clipped) in stats.items():
            by_key[k].reward_mean, by_key[k].clipped_ratio = reward, clipped
        totals: dict[str, list[int]] = {}
        for k, start_ns, end_ns, failures, graded in _windows(store, keys, min(r.asof_ns for r in runs) - rate_ns):
            run = by_key[k]
            if end_ns > run.asof_ns - rate_ns and start_ns <= run.asof_ns:
                t = totals.setdefault(k, [0, 0])
                t[0], t[1] = t[0] + int(failures), t[1] + int(graded)
        for k, (failures, graded) in totals.items():
            by_key[k].graded = graded
            by_key[k].failure_rate = failures / graded if graded else None
        if metrics:
            for k, name, value in _metrics(store, keys, metrics):
                by_key[k].metrics[name] = float(value)
        for k, gpus in _gpus(store, keys).items():
            by_key[k].gpus = gpus
        for run in runs:
            hw = {g.hw_id for g in run.gpus}
            run.alerts = [a for a in alerts if (a.project, a.run_id, a.attempt) == (run.project, run.run_id, run.attempt)
                          or a.key in hw]
    order = {"SILENT": 0, "STALLED": 1, "RUNNING": 2, "ENDED": 3}
    runs.sort(key=lambda r: (order[r.state], r.project, r.run_id))
    any_runs = bool(latest)
    if not any_runs:  # only then: is the view empty because nothing is recent, or because nothing ever ran?
        where = " WHERE project = {project:String}" if project else ""
        any_runs = bool(_rows(store, "SELECT count() > 0 FROM {db}.steps" + where, project=project or "")[0][0])
    return WatchSnapshot(store.url, store.database, now_ns, runs, any_runs, show_all, project, recent_s,
                         getattr(store, "endpoint", None), metrics)


class _Reader:
    """Opens the store for each frame when it is a chDB store (so the lock is never held between
    frames and a sink can start meanwhile; its owner may change), keeps one client to a server."""

    def __init__(self, dsn: str, opener: Callable[[str], Store]):
        self.dsn, self.opener = dsn, opener
        self.keep = not dsn.startswith("chdb:")
        self.store: Store | None = None

    def read(self, fn: Callable[[Store], WatchSnapshot]) -> WatchSnapshot:
        store = self.store or self.opener(self.dsn)
        ok = False
        try:
            snap = fn(store)
            ok = True
            return snap
        finally:
            if ok and self.keep:
                self.store = store
            else:  # a chDB store, or a failed client: closed, a fresh one next time
                self.store = None
                store.close()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


def watch(dsn: str, opener: Callable[[str], Store], interval_s: float = 2.0, project: str | None = None,
          show_all: bool = False, once: bool = False, console: Console | None = None, metrics: tuple[str, ...] = ()) -> int:
    """Show the view until Ctrl-C (exit 0); ``once``: print one frame and return.

    The first frame's errors (server unreachable, store busy) propagate, so the command fails
    with one line; later ones are shown on the last frame while it keeps retrying.
    """
    console = console or Console()
    reader = _Reader(dsn, opener)
    note = "" if once else f"refresh {interval_s:g}s, Ctrl-C quits"
    take = lambda store: snapshot(store, time.time_ns(), project, show_all, metrics=metrics)  # noqa: E731
    try:
        snap = reader.read(take)
        if once:
            console.print(render(snap))
            return 0
        with Live(render(snap, note), console=console, screen=True, auto_refresh=False) as live:
            while True:
                time.sleep(interval_s)
                try:
                    snap = reader.read(take)
                    live.update(render(snap, note), refresh=True)
                except Exception as exc:  # a server restart, a busy store: say so and retry
                    reason = str(exc) if len(str(exc)) <= 500 else str(exc)[:500] + "…"
                    error = f"cannot read {snap.url} ({type(exc).__name__}: {reason}); retrying"
                    live.update(render(snap, note, error=error), refresh=True)
    except KeyboardInterrupt:
        return 0
    finally:
        reader.close()
