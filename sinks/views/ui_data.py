"""What the pages of ``rlpulse ui`` show, read from ClickHouse: rows and dataclasses, no HTML.

Where a saved query (``sinks/read/queries/*.sql``) answers a figure, the page runs that very query
(:func:`saved`), so it shows what ``rlpulse query --saved NAME`` prints: clipped ratio per step
(clipped-ratio-trend), reward percentiles, the trainer's metrics, the engines by step, tokens, tokens/s
and MFU per step (step-throughput, whose STEP event times also place GPU samples and alerts on the step
axis), each term's figures (term-figures), the entry spans' metrics (rollout-metrics, read in
``run_metrics_data``), a trajectory's span tree, how runs ended. Failures by step, term and cause are failures-by-step's
rows read in a quarter of its time (:func:`failures_by_step`). The runs list is ``rlpulse watch``'s
own snapshot (``rlpulse.sinks.views.watch.snapshot``). What no saved query gives (a step's rollouts
grouped by sample, completion length percentiles, alerts and GPU samples placed on the step axis)
is read here with aggregate queries: nothing reads all of a run's rollouts into Python, so a page
of a run of 1,000 steps x 512 rollouts answers within a second.

Every query runs with readonly=1; a run is (project, run_id, attempt), and where a saved query
takes run_id alone its rows of another project are left out here.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

from rlpulse.sinks.read import queries
from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views.html_report import gpu_rows
from rlpulse.sinks.views.run_metrics_data import EntryMetric, entry_metrics
from rlpulse.sinks.views.step_figures import StepThroughput, throughput
from rlpulse.sinks.views.term_figures import term_rows
from rlpulse.sinks.views.trajectories import GRADING_KINDS, SAMPLE_SQL

READ = {"readonly": 1}
ROLLOUT_CAP = 5000  # rollouts read for one step page (512 is a large GRPO step)
GPU_POINTS = 400  # GPU samples per GPU drawn on a run page; more are averaged in bins
METRIC_CHARTS = 6  # trainer metrics drawn at once
DEFAULT_METRICS = 3  # drawn when the URL chooses none: the first by name


def rows(store: Store, sql: str, **params: Any) -> list[tuple]:
    """``sql`` ({db} for the database) read-only, with ClickHouse-side parameters."""
    return store.client.query(sql.replace("{db}", store.database), parameters=params, settings=READ).result_rows


def saved(store: Store, name: str, **params: Any) -> list[dict[str, Any]]:
    """Saved query ``name`` as ``rlpulse query --saved`` runs it: one dict per row."""
    sql = queries.saved_sql(name, {k: str(v) for k, v in params.items()}, store.database)
    result = store.client.query(sql, parameters=params, settings=READ)
    return [dict(zip(result.column_names, row)) for row in result.result_rows]


def has_tables(store: Store) -> bool:
    """The pipeline's tables exist (a store nothing was written to has none yet)."""
    return bool(rows(store, "SELECT count() > 0 FROM system.tables WHERE database = {name:String} AND name = 'steps'",
                     name=store.database)[0][0])


def has_column(store: Store, table: str, column: str) -> bool:
    """Whether ``table`` has ``column`` (a store not migrated to the latest migration may lack it)."""
    return bool(rows(store, "SELECT count() FROM system.columns WHERE database = {d:String} AND table = {t:String} "
                            "AND name = {c:String}", d=store.database, t=table, c=column)[0][0])


def projects(store: Store) -> list[str]:
    return [str(r[0]) for r in rows(store, "SELECT DISTINCT project FROM {db}.steps ORDER BY project LIMIT 1000")]


def staleness(store: Store, keys: list[str]) -> dict[str, tuple[int | None, float | None]]:
    """Per run key (project/run/attempt): staleness max and mean of its highest step."""
    found = rows(store, """
        SELECT concat(project, '/', run_id, '/', toString(attempt)) AS k,
               argMax(staleness_max, (step, emitted_at_ns)), argMax(staleness_mean, (step, emitted_at_ns))
        FROM {db}.step_stats WHERE k IN {keys:Array(String)} GROUP BY k""", keys=keys)
    return {str(k): (None if mx is None else int(mx), None if mean is None else float(mean)) for k, mx, mean in found}


def any_row(store: Store, table: str, where: str, **params: Any) -> bool:
    """Whether ``table`` has a row where ``where`` holds (a LIMIT 1 read). A saved query of many steps (windows,
    joins) over rows a run does not have is skipped: in a chDB session of its own, as each ui request opens,
    its first run costs up to 0.2 s even when it finds nothing."""
    return bool(rows(store, f"SELECT count() FROM (SELECT 1 FROM {{db}}.{table} WHERE {where} LIMIT 1)", **params)[0][0])


def latest_attempt(store: Store, project: str, run: str) -> int | None:
    """The run's latest attempt in its step events, else in its spans (a traced agent's run may have no steps)."""
    for table in ("steps", "spans"):
        found = rows(store, f"SELECT max(attempt), count() FROM {{db}}.{table} WHERE project = {{p:String}} AND "
                     "run_id = {r:String}", p=project, r=run)
        if found and found[0][1]:
            return int(found[0][0])
    return None


# -- a run ---------------------------------------------------------------------------------------

@dataclass
class StepStats:
    step: int
    rollouts: int
    clipped: int
    clipped_ratio: float
    reward_mean: float
    reward_std: float
    samples: int
    samples_same_reward: int
    staleness_max: int | None
    zero_std_fraction: float | None = None  # samples_same_reward / samples (TRL's frac_reward_zero_std)


@dataclass
class RunData:
    project: str
    run: str
    attempt: int
    status: dict[str, Any] | None  # the run-status saved query's row of this attempt
    stats: dict[int, StepStats]
    trend: list[dict[str, Any]]  # clipped-ratio-trend
    percentiles: list[dict[str, Any]]  # reward-percentiles
    heat_bounds: list[float]
    heat: dict[int, list[int]]  # step -> bucket counts of term total
    failures: list[dict[str, Any]]  # failures-by-step's rows of this attempt (failures_by_step)
    lengths: dict[int, tuple[float, float, float]]  # step -> completion length p50, p90, p99
    metric_names: list[str]
    metrics: dict[str, list[tuple[int, float]]]  # the chosen names: (step, value)
    engine: list[dict[str, Any]]  # engine-by-step
    gpus: dict[str, list[tuple[int, float, float]]]  # label -> (time_ns, utilisation, power)
    marks: list[tuple[int, int]]  # (time_ns, step) of the attempt's STEP events: times onto the step axis
    alerts: list[tuple[int, str, str, str]]  # (time_ns, rule, state, summary)
    steps: list[int] = field(default_factory=list)  # every step with figures, ascending
    # step-throughput's rows by step (tokens, tokens/s, MFU); more per-step figure families go beside it
    throughput: dict[int, StepThroughput] = field(default_factory=dict)
    terms: list[dict[str, Any]] = field(default_factory=list)  # term-figures' rows of this attempt
    entry_metrics: list[EntryMetric] = field(default_factory=list)  # rollout-metrics' rows (run_metrics_data)


def run_data(store: Store, project: str, run: str, attempt: int, wanted: list[str]) -> RunData:
    """Every figure of a run's page; ``wanted``: the trainer metrics the URL chose (``metrics`` holds those
    the run has, at most METRIC_CHARTS; the first DEFAULT_METRICS by name when it chose none)."""
    p = {"p": project, "r": run, "a": attempt}
    where = "project = {p:String} AND run_id = {r:String} AND attempt = {a:UInt32}"
    status = run_status(store, project, run, attempt)
    stats = {int(r[0]): StepStats(int(r[0]), int(r[1]), int(r[2]), float(r[3]), float(r[4]), float(r[5]), int(r[6]),
                                  int(r[7]), None if r[8] is None else int(r[8]), None if r[9] is None else float(r[9]))
             for r in rows(store, f"""
        SELECT step, argMax(rollouts, emitted_at_ns), argMax(clipped, emitted_at_ns), argMax(clipped_ratio, emitted_at_ns),
               argMax(reward_mean, emitted_at_ns), argMax(reward_std, emitted_at_ns), argMax(samples, emitted_at_ns),
               argMax(samples_same_reward, emitted_at_ns), argMax(staleness_max, emitted_at_ns),
               argMax(tuple(zero_std_fraction), emitted_at_ns).1
        FROM {{db}}.step_stats WHERE {where} GROUP BY step ORDER BY step""", **p)}
    hist = rows(store, f"""SELECT step, argMax(bounds, emitted_at_ns), argMax(bucket_counts, emitted_at_ns)
        FROM {{db}}.reward_histograms WHERE {where} AND term = 'total' GROUP BY step ORDER BY step""", **p)
    lengths = {int(r[0]): (exp_quantile(0.5, *r[1:]), exp_quantile(0.9, *r[1:]), exp_quantile(0.99, *r[1:])) for r in rows(
        store, f"""
        SELECT step, argMax(scale, emitted_at_ns), argMax(zero_count, emitted_at_ns), argMax(offset, emitted_at_ns),
               argMax(bucket_counts, emitted_at_ns), argMax(count, emitted_at_ns), argMax(min, emitted_at_ns),
               argMax(max, emitted_at_ns)
        FROM {{db}}.completion_length_histograms WHERE {where} GROUP BY step HAVING argMax(count, emitted_at_ns) > 0
        ORDER BY step""", **p)}
    metric_rows = [r for r in saved(store, "step-metrics", run_id=run) if (r["project"], r["attempt"]) == (project, attempt)]
    names = sorted({str(r["name"]) for r in metric_rows})
    chosen = [n for n in dict.fromkeys(wanted) if n in names][:METRIC_CHARTS] or names[:DEFAULT_METRICS]
    metrics: dict[str, list[tuple[int, float]]] = {n: [] for n in chosen}
    for r in metric_rows:
        if r["name"] in metrics:
            metrics[r["name"]].append((int(r["step"]), float(r["value"])))
    per_step = throughput(store, project, run, attempt)
    marks = sorted((r.time_ns, r.step) for r in per_step)  # its rows are the steps' latest STEP events
    alerts = [(int(t), str(rule), str(state), str(summary)) for t, rule, state, summary in rows(store, f"""
        SELECT time_ns, rule, state, any(summary) FROM {{db}}.alerts
        WHERE ({where}) OR key IN (SELECT assumeNotNull(hw_id) FROM {{db}}.placements WHERE {where} AND hw_id IS NOT NULL)
        GROUP BY time_ns, rule, key, state ORDER BY time_ns, rule, state LIMIT 2000""", **p)]
    data = RunData(
        project, run, attempt, status, stats,
        trend=saved(store, "clipped-ratio-trend", run_id=run, attempt=attempt),
        percentiles=saved(store, "reward-percentiles", run_id=run, attempt=attempt),
        heat_bounds=[float(b) for b in hist[0][1]] if hist else [], heat={int(s): [int(c) for c in cs] for s, _, cs in hist},
        failures=failures_by_step(store, project, run, attempt),
        lengths=lengths, metric_names=names, metrics=metrics,
        engine=saved(store, "engine-by-step", run_id=run, attempt=attempt) if any_row(
            store, "engine_samples", "run_id = {r:String} AND attempt = {a:UInt32}", r=run, a=attempt) else [],
        gpus=_gpus(store, run, attempt), marks=marks, alerts=alerts, throughput={r.step: r for r in per_step},
        terms=term_rows(store, project, run, attempt), entry_metrics=entry_metrics(store, project, run, attempt))
    data.steps = sorted(set(stats) | {int(r["step"]) for r in data.trend} | set(data.heat) | set(data.throughput))
    return data


def failures_by_step(store: Store, project: str, run: str, attempt: int) -> list[dict[str, Any]]:
    """The rows of the saved query failures-by-step for one attempt (step, term, cause, failures, graded):
    graded counts every score of the term in the step, failures those whose outcome is a cause; the browser
    test checks they are the saved query's. Read as it reads them (GRADER spans, FINAL), with the kind
    filter as PREWHERE and the run's whole key: the saved query's window over a million GRADER spans took
    a run's page past a second on a busy machine, this takes a quarter of its time (duplicates of a span
    are one event, so filtering them on kind before FINAL merges them keeps one of each)."""
    counts = rows(store, """
        SELECT step, ifNull(term, ''), ifNull(outcome, ''), count() FROM {db}.spans FINAL PREWHERE kind = 'GRADER'
        WHERE project = {p:String} AND run_id = {r:String} AND attempt = {a:UInt32}
        GROUP BY step, term, outcome ORDER BY step, term, outcome""", p=project, r=run, a=attempt)
    graded: dict[tuple[Any, str], int] = {}
    for step, term, _, n in counts:
        graded[(step, term)] = graded.get((step, term), 0) + int(n)
    return [{"step": step, "term": term, "cause": outcome, "failures": int(n), "graded": graded[(step, term)]}
            for step, term, outcome, n in counts if outcome != "ok"]


def run_status(store: Store, project: str, run: str, attempt: int) -> dict[str, Any] | None:
    """The saved query run-status's row of one attempt (status, steps, last_event). Its SQL reads every
    run's steps, a cost that grows with the store: it runs here on this attempt's rows alone (its FROM
    narrowed with a WHERE); should its text change so that no longer applies, on every run, filtered here."""
    sql = queries.saved_sql("run-status", {}, store.database)
    table = f"FROM {store.database}.steps FINAL\n"
    if sql.count(table) != 1:
        return next((r for r in saved(store, "run-status") if (r["project"], r["run_id"], r["attempt"]) ==
                     (project, run, attempt)), None)
    sql = sql.replace(table, table.rstrip("\n") + " WHERE project = {p:String} AND run_id = {r:String} "
                      "AND attempt = {a:UInt32}\n")
    result = store.client.query(sql, parameters={"p": project, "r": run, "a": attempt}, settings=READ)
    return next((dict(zip(result.column_names, row)) for row in result.result_rows), None)


def _gpus(store: Store, run: str, attempt: int) -> dict[str, list[tuple[int, float, float]]]:
    """The report's GPU rows (placements joined on hw_id), at most GPU_POINTS per GPU (averaged in bins)."""
    out: dict[str, list[tuple[int, float, float]]] = {}
    for label, t, util, power in gpu_rows(store, run, attempt):
        out.setdefault(str(label), []).append((int(t), float(util), float(power)))
    for label, points in out.items():
        if len(points) > GPU_POINTS:
            size = math.ceil(len(points) / GPU_POINTS)
            bins = [points[i:i + size] for i in range(0, len(points), size)]
            out[label] = [(b[len(b) // 2][0], sum(x[1] for x in b) / len(b), sum(x[2] for x in b) / len(b)) for b in bins]
    return out


def exp_quantile(q: float, scale: int, zero_count: int, offset: int, counts: list[int], count: int,
                 lo: float, hi: float) -> float:
    """The q-quantile of an OpenTelemetry base-2 exponential histogram row, as the streams estimate it:
    nearest rank; the first and last ranks are min and max; a bucket's value is its geometric midpoint
    base**(i + 0.5), clamped to [min, max]."""
    rank = max(1, math.ceil(q * count))
    if rank == 1:
        return float(lo)
    if rank >= count:
        return float(hi)
    seen = int(zero_count)
    if rank <= seen:
        return 0.0
    base = 2.0 ** (2.0 ** -int(scale))
    for i, c in enumerate(counts):
        seen += int(c)
        if rank <= seen:
            return min(max(base ** (int(offset) + i + 0.5), float(lo)), float(hi))
    return float(hi)


def step_at(marks: list[tuple[int, int]], time_ns: int) -> float:
    """Where ``time_ns`` lies on the step axis: between two STEP events, the fraction of the way from
    the earlier one's step to the later one's; before the first or after the last, at that one."""
    if not marks:
        return 0.0
    times = [t for t, _ in marks]
    i = bisect.bisect_right(times, time_ns)
    if i == 0:
        return float(marks[0][1])
    if i == len(marks):
        return float(marks[-1][1])
    (t0, s0), (t1, s1) = marks[i - 1], marks[i]
    return s0 + (s1 - s0) * (time_ns - t0) / ((t1 - t0) or 1)


# -- a step --------------------------------------------------------------------------------------

@dataclass
class Rollout:
    key: str  # rollout_id (or "trace <id>" for a rollout span without one)
    sample: str | None
    reward: float | None  # the ROLLOUT span's, else its REWARD entry span's
    status: str
    message: str
    clipped: bool
    completion_tokens: int | None
    finish_reason: str | None
    graders: list[tuple[str, str, float | None]]  # (term, outcome, score)
    spans: int
    capped: bool = False  # stored without its content: past the sink's cap of full trajectories per step
    prompt: str | None = None  # the task, cut to PREVIEW characters (content recorded; see step_rollouts)
    completion: str | None = None  # the policy's last reply, cut the same way

    @property
    def failed(self) -> list[str]:
        return sorted({term for term, outcome, _ in self.graders if outcome not in ("ok", "")})


def step_rollouts(store: Store, project: str, run: str, attempt: int, step: int) -> list[Rollout]:
    """The step's rollouts with their graders, one aggregate query (each span once: LIMIT 1 BY span_id)."""
    capped = "content_capped" if has_column(store, "spans", "content_capped") else "0"
    found = rows(store, f"""
        SELECT traj, anyIf(smp, kind = 'ROLLOUT'), anyIf(reward, kind = 'ROLLOUT'), anyIf(reward, kind = 'REWARD'),
               anyIf(status, kind = 'ROLLOUT'), anyIf(status_message, kind = 'ROLLOUT'), anyIf(clipped, kind = 'ROLLOUT'),
               anyIf(completion_tokens, kind = 'ROLLOUT'), anyIf(finish_reason, kind = 'ROLLOUT'),
               arraySort(groupArrayIf((ifNull(term, ''), ifNull(outcome, ''), score), kind = 'GRADER')), count(),
               max(capped), mapFromArrays(groupArray(span_id), groupArray((ifNull(parent_span_id, ''), toString(kind)))),
               arraySort(groupArrayIf((sequence_id, ifNull(parent_span_id, ''), asked, said), kind = 'LLM'))
        FROM (SELECT if(rollout_id != '', rollout_id, concat('trace ', trace_id)) AS traj, {SAMPLE_SQL} AS smp, kind,
                     reward, status, status_message, clipped, completion_tokens, finish_reason, term, outcome, score,
                     {capped} AS capped, span_id, parent_span_id, sequence_id,
                     if(kind = 'LLM', {_ASKED}, '') AS asked, if(kind = 'LLM', {_SAID}, '') AS said
              FROM {{db}}.spans
              WHERE project = {{p:String}} AND run_id = {{r:String}} AND attempt = {{a:UInt32}} AND step = {{s:Int64}}
              ORDER BY span_id, sequence_id LIMIT 1 BY span_id)
        GROUP BY traj HAVING countIf(kind = 'ROLLOUT') > 0 ORDER BY traj LIMIT {ROLLOUT_CAP}""",
                 p=project, r=run, a=attempt, s=step)
    out = []
    for key, sample, reward, reward_span, status, message, clipped, tokens, finish, graders, n, cut, up, calls in found:
        reward = reward if reward is not None else reward_span
        links = dict(up)
        policy = [(asked, said) for _, parent, asked, said in calls if not _graded(links, parent)]
        out.append(Rollout(str(key), None if sample is None else str(sample), None if reward is None else float(reward),
                           str(status or "UNSET"), str(message or ""), bool(clipped), None if tokens is None else int(tokens),
                           None if finish is None else str(finish),
                           [(str(t), str(o), None if s is None else float(s)) for t, o, s in graders], int(n), bool(cut),
                           prompt=str(policy[0][0]) if policy and policy[0][0] else None,
                           completion=str(policy[-1][1]) if policy and policy[-1][1] else None))
    return out


# A card's preview of a rollout (content recorded): the task, its policy's first call's first user message, and
# the answer, its last policy call's reply text; PREVIEW characters each, cut in SQL so a page reads little.
PREVIEW = 240
_ASKED = (f"substringUTF8(JSONExtractString(arrayFirst(m -> JSONExtractString(m, 'role') = 'user', "
          f"JSONExtractArrayRaw(attributes['gen_ai.input.messages'])), 'content'), 1, {PREVIEW})")
_SAID = (f"substringUTF8(JSONExtractString(arrayElement(JSONExtractArrayRaw(attributes['gen_ai.output.messages']), 1), "
         f"'content'), 1, {PREVIEW})")


def _graded(up: dict[str, tuple[str, str]], parent: str, depth: int = 64) -> bool:
    """A call whose ancestors hold a REWARD entry or GRADER span: a judge's, no turn of the policy."""
    for _ in range(depth):
        if not parent or parent not in up:
            return False
        parent, kind = up[parent]
        if kind in GRADING_KINDS:
            return True
    return False


def step_stats(store: Store, project: str, run: str, attempt: int, step: int) -> StepStats | None:
    found = rows(store, """
        SELECT step, argMax(rollouts, emitted_at_ns), argMax(clipped, emitted_at_ns), argMax(clipped_ratio, emitted_at_ns),
               argMax(reward_mean, emitted_at_ns), argMax(reward_std, emitted_at_ns), argMax(samples, emitted_at_ns),
               argMax(samples_same_reward, emitted_at_ns), argMax(staleness_max, emitted_at_ns)
        FROM {db}.step_stats WHERE project = {p:String} AND run_id = {r:String} AND attempt = {a:UInt32}
          AND step = {s:Int64} GROUP BY step""", p=project, r=run, a=attempt, s=step)
    if not found:
        return None
    r = found[0]
    return StepStats(int(r[0]), int(r[1]), int(r[2]), float(r[3]), float(r[4]), float(r[5]), int(r[6]), int(r[7]),
                     None if r[8] is None else int(r[8]))


@dataclass
class Group:
    """One sample's rollouts: what the step page shows side by side."""

    sample: str | None
    rollouts: list[Rollout]

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts if r.reward is not None]

    @property
    def zero_variance(self) -> bool:
        """Two or more rewards, all equal (as the streams count samples_same_reward: exact equality)."""
        rewards = self.rewards
        return len(rewards) >= 2 and min(rewards) == max(rewards)

    @property
    def mean(self) -> float | None:
        rewards = self.rewards
        return sum(rewards) / len(rewards) if rewards else None

    @property
    def spread(self) -> float:
        rewards = self.rewards
        return max(rewards) - min(rewards) if rewards else 0.0


def groups(rollouts: list[Rollout]) -> list[Group]:
    by: dict[str | None, list[Rollout]] = {}
    for r in rollouts:
        by.setdefault(r.sample, []).append(r)
    return [Group(s, rs) for s, rs in sorted(by.items(), key=lambda kv: (kv[0] is None, kv[0] or ""))]
