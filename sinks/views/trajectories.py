"""The trajectories of one sample at one step, as in the seeds' console pages (seed 000).

A trajectory is one ROLLOUT span with its reward and status, plus the span tree rebuilt from
``spans``: every span of the same run and attempt sharing its ``rollout_id`` (or, for a span
without one, its ``trace_id``), children under ``parent_span_id``, siblings in start-time
order. Nothing read is dropped silently: a span whose parent is missing (never sent, refused,
or in another trace) is shown at the root and marked; a parent cycle is broken the same way;
past the per-trajectory cap the page says how many spans it did not show.

This module reads and links (``select``, ``build_tree``); ``rlpulse.sinks.views.trajectory_html.render_section``
draws the page's "Trajectories" section from it. Reads use FINAL and keep one row per span_id,
so a replayed offset range or a span exported twice shows once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Sequence

from rlpulse.schemas.enums import SPAN_KINDS
from rlpulse.sinks.store.clickhouse import Store

SPAN_CAP = 500  # spans drawn per trajectory; more would make a page nobody can scroll
FETCH_FACTOR = 4  # rows read per trajectory: enough past the cap to link the shown spans' parents
TRAJECTORY_CAP = 100  # trajectories drawn per sample (GRPO groups are 4 to 64)
SAMPLE_LIST_CAP = 50  # other samples of the step listed by name
NO_SAMPLE = "no sample id"

# The sample a rollout answered: the Span field, or an OpenTelemetry attribute for spans made
# through rlpulse.producers.sdk.otel (it fills the typed fields it knows, and keeps every attribute).
SAMPLE_SQL = "if(ifNull(sample_id, '') != '', sample_id, nullIf(attributes['rlpulse.sample_id'], ''))"


@dataclass
class SpanRow:
    span_id: str
    parent_span_id: str | None
    name: str
    kind: str
    start_ns: int
    end_ns: int
    status: str = "UNSET"
    status_message: str = ""
    sequence_id: int = 0
    attributes: dict[str, str] = field(default_factory=dict)
    typed: dict[str, Any] = field(default_factory=dict)  # term, outcome, score, reward, ... (non-null only)
    children: list[SpanRow] = field(default_factory=list)
    orphan: bool = False  # names a parent that is not among the trajectory's spans (or a cycle)


@dataclass
class Tree:
    roots: list[SpanRow]
    shown: int  # spans kept in the tree (at most the cap)
    not_shown: int  # spans read or counted but past the cap
    orphans: int


def _order(span: SpanRow) -> tuple:
    # sequence_id is start order across the rollout's processes, whatever their clocks say (a span
    # written before it was, had its writer's publish order there: close to start order among siblings)
    return (span.sequence_id, span.start_ns, span.span_id)


def build_tree(spans: Iterable[SpanRow], cap: int = SPAN_CAP, total: int | None = None) -> Tree:
    """Link spans by parent_span_id; a span whose parent never arrived hangs under the rollout's
    ROLLOUT entry (at the root when there is none), marked; cycle members at the root; keep the first
    ``cap`` spans in depth-first order (a kept span's parent is always kept).

    ``total``: how many spans the trajectory has in all, when only some were read.
    """
    by_id: dict[str, SpanRow] = {}
    for s in spans:
        s.children, s.orphan = [], False
        by_id.setdefault(s.span_id, s)  # one row per span id (the caller dedups; this is a guard)
    items = sorted(by_id.values(), key=_order)
    entry = next((s for s in items if s.kind == "ROLLOUT" and not s.parent_span_id), None)
    roots: list[SpanRow] = []
    for s in items:
        parent = by_id.get(s.parent_span_id) if s.parent_span_id else None
        if parent is None or parent is s:
            s.orphan = bool(s.parent_span_id)
            if s.orphan and parent is None and entry is not None and s is not entry:
                entry.children.append(s)  # its parent never arrived: shown in its rollout, marked
            else:
                roots.append(s)
        else:
            parent.children.append(s)
    # A parent cycle (a -> b -> a) is reachable from no root: cut it at one of its spans, shown at the root.
    reached = _walk(roots, len(items))
    for s in items:
        if s.span_id not in reached:
            loop, x = set(), s
            while x.span_id not in loop:  # up the parents until one repeats: that one is on the cycle
                loop.add(x.span_id)
                x = by_id[x.parent_span_id]  # type: ignore[index]
            x.orphan = True
            by_id[x.parent_span_id].children.remove(x)  # type: ignore[index]
            roots.append(x)
            reached |= _walk([x], len(items))
    roots.sort(key=_order)
    kept = _walk(roots, cap)
    for s in items:
        s.children = [c for c in s.children if c.span_id in kept]
    total = max(total if total is not None else 0, len(items))
    return Tree(roots=[r for r in roots if r.span_id in kept], shown=len(kept), not_shown=total - len(kept),
                orphans=sum(1 for s in items if s.orphan and s.span_id in kept))


def _walk(roots: Sequence[SpanRow], limit: int) -> set[str]:
    """Span ids in depth-first pre-order from roots, the first ``limit`` of them (no recursion)."""
    seen: set[str] = set()
    stack = list(reversed(roots))
    while stack and len(seen) < limit:
        s = stack.pop()
        if s.span_id in seen:
            continue
        seen.add(s.span_id)
        stack.extend(reversed(s.children))
    return seen


GRADING_KINDS = frozenset({SPAN_KINDS[1], SPAN_KINDS[4]})  # REWARD, GRADER: a call below one is a judge's, no turn of the policy


def grader_call_ids(spans: Iterable[SpanRow], depth: int = 64) -> set[str]:
    """The LLM spans among ``spans`` (one trajectory's) with a REWARD entry or GRADER span above them: the
    calls a reward function made (a judge), which are no turn of the policy (as ``rlpulse export`` reads them)."""
    by_id = {s.span_id: s for s in spans}
    found = set()
    for s in by_id.values():
        if s.kind != "LLM":
            continue
        up = by_id.get(s.parent_span_id or "")
        for _ in range(depth):  # bounded: a parent cycle ends here too
            if up is None:
                break
            if up.kind in GRADING_KINDS:
                found.add(s.span_id)
                break
            up = by_id.get(up.parent_span_id or "")
    return found


# -- reading ---------------------------------------------------------------------------------

@dataclass
class Trajectory:
    key: str
    rollout: SpanRow
    tree: Tree
    reward: float | None = None  # the ROLLOUT span's, else its REWARD entry span's (seed 000's model)


@dataclass
class Selection:
    step: int | None
    sample: str | None  # None: the rollouts without a sample id
    samples: list[tuple[str | None, int]]  # every sample of the step with its rollout count
    note: str  # how the step and sample were chosen
    trajectories: list[Trajectory]
    more_trajectories: int = 0


def _rows(store: Store, sql: str, **params: Any) -> list[tuple]:
    return store.client.query(sql.replace("{db}", store.database), parameters=params).result_rows


def _where(run: str, attempt: int) -> tuple[str, dict[str, Any]]:
    return "run_id = {run:String} AND attempt = {attempt:UInt32}", {"run": run, "attempt": attempt}


def counted(count: int, one: str, many: str = "") -> str:
    """``3 samples``, ``1 sample``: ``many`` defaults to ``one`` + s."""
    return f"{count} {one if count == 1 else many or one + 's'}"


def sample_label(sample: str | None) -> str:
    """How a sample id is shown; spans without one are grouped as NO_SAMPLE."""
    return NO_SAMPLE if sample is None else sample


def select(store: Store, run: str, attempt: int, step: int | None = None, sample: str | None = None,
           cap: int = SPAN_CAP) -> Selection:
    """The trajectories of (step, sample); defaults: the latest step with rollouts (of the sample,
    when one is given), its first sample by id. Raises ValueError for a step or sample that has no
    rollouts."""
    where, p = _where(run, attempt)
    notes = []
    if step is None:
        of_sample = "" if sample is None else f" AND {SAMPLE_SQL} = {{sample:String}}"
        found = _rows(store, f"SELECT max(step), count() FROM {{db}}.spans FINAL WHERE {where} "
                             f"AND kind = 'ROLLOUT' AND step IS NOT NULL{of_sample}", sample=sample or "", **p)
        if not found or not found[0][1]:
            if sample is not None:
                raise ValueError(f"run {run} attempt {attempt} has no rollouts of sample {sample} at any step")
            return Selection(None, None, [], f"Run {run}, attempt {attempt} has no rollouts.", [])
        step = int(found[0][0])
        notes.append(f"step {step} (the latest step with rollouts{'' if sample is None else ' of this sample'}; "
                     "choose another with --step N)")
    samples = [(s, int(n)) for s, n in _rows(
        store, f"SELECT {SAMPLE_SQL} AS s, uniqExact(span_id) FROM {{db}}.spans FINAL WHERE {where} "
               "AND kind = 'ROLLOUT' AND step = {step:Int64} GROUP BY s ORDER BY s IS NULL, s", step=step, **p)]
    if not samples:
        span = _rows(store, f"SELECT min(step), max(step), uniqExact(step) FROM {{db}}.spans FINAL WHERE {where} "
                            "AND kind = 'ROLLOUT' AND step IS NOT NULL", **p)[0]
        has = f"its {span[2]} steps with rollouts run from {span[0]} to {span[1]}" if span[2] else "it has no rollouts"
        raise ValueError(f"run {run} attempt {attempt} has no rollouts at step {step}; {has}")
    names = [s for s, _ in samples]
    if sample is None:
        sample = names[0]
        notes.append(f"sample {sample_label(sample)} (the first by id of the step's {counted(len(names), 'sample')}; "
                     "choose another with --sample ID)")
    elif sample not in names:
        listed = ", ".join(sample_label(s) for s in names[:SAMPLE_LIST_CAP])
        raise ValueError(f"step {step} of run {run} attempt {attempt} has no rollouts of sample {sample}; "
                         f"its samples: {listed}{' …' if len(names) > SAMPLE_LIST_CAP else ''}")
    trajectories, more = _trajectories(store, run, attempt, step, sample, cap)
    note = f"Showing {'; '.join(notes)}." if notes else f"Step {step}, sample {sample_label(sample)}."
    return Selection(step, sample, samples, note, trajectories, more)


_SPAN_COLUMNS = ("span_id, parent_span_id, name, kind, start_time_ns, end_time_ns, status, status_message, "
                 "sequence_id, attributes, term, outcome, score, judge_input_tokens, judge_output_tokens, reward, "
                 "completion_tokens, max_tokens, clipped")
_TYPED = ("term", "outcome", "score", "judge_input_tokens", "judge_output_tokens", "reward", "completion_tokens",
          "max_tokens", "clipped")


def _span(row: Sequence[Any]) -> SpanRow:
    typed = {k: v for k, v in zip(_TYPED, row[10:19]) if v is not None}
    return SpanRow(span_id=row[0], parent_span_id=row[1] or None, name=row[2], kind=row[3], start_ns=int(row[4]),
                   end_ns=int(row[5]), status=row[6] or "UNSET", status_message=row[7] or "", sequence_id=int(row[8]),
                   attributes=dict(row[9] or {}), typed=typed)


def _trajectories(store: Store, run: str, attempt: int, step: int, sample: str | None,
                  cap: int) -> tuple[list[Trajectory], int]:
    where, p = _where(run, attempt)
    match = f"{SAMPLE_SQL} IS NULL" if sample is None else f"{SAMPLE_SQL} = {{sample:String}}"
    rows = _rows(store, f"""SELECT rollout_id, trace_id, {_SPAN_COLUMNS} FROM {{db}}.spans FINAL
        WHERE {where} AND kind = 'ROLLOUT' AND step = {{step:Int64}} AND {match}
        ORDER BY span_id, sequence_id LIMIT 1 BY span_id""", step=step, sample=sample or "", **p)
    rollouts = sorted(((r[0] or f"trace {r[1]}", r[1], _span(r[2:])) for r in rows), key=lambda t: (t[0], t[2].span_id))
    more = max(0, len(rollouts) - TRAJECTORY_CAP)
    rollouts = rollouts[:TRAJECTORY_CAP]
    if not rollouts:
        return [], 0
    # Each span joins the trajectory of its rollout_id, else of its trace (children made without one).
    ids = [k for k, _, _ in rollouts if not k.startswith("trace ")]
    traces = [t for _, t, _ in rollouts]
    keys = [k for k, _, _ in rollouts]
    spans = _rows(store, f"""
        SELECT traj, count() OVER (PARTITION BY traj) AS total, {_SPAN_COLUMNS} FROM (
            SELECT if(rollout_id != '' AND has({{ids:Array(String)}}, rollout_id), rollout_id,
                      {{keys:Array(String)}}[indexOf({{traces:Array(String)}}, trace_id)]) AS traj, *
            FROM {{db}}.spans FINAL
            WHERE {where} AND (has({{ids:Array(String)}}, rollout_id) OR has({{traces:Array(String)}}, trace_id))
              AND (step IS NULL OR step = {{step:Int64}})
            ORDER BY span_id, sequence_id LIMIT 1 BY span_id)
        WHERE traj != ''
        ORDER BY traj, sequence_id, start_time_ns, span_id LIMIT {{fetch:UInt64}} BY traj""",
                  ids=ids, keys=keys, traces=traces, step=step, fetch=cap * FETCH_FACTOR, **p)
    grouped: dict[str, list[SpanRow]] = {}
    totals: dict[str, int] = {}
    for row in spans:
        grouped.setdefault(row[0], []).append(_span(row[2:]))
        totals[row[0]] = int(row[1])
    out = []
    for key, _, rollout in rollouts:
        members = grouped.get(key, [])
        if all(s.span_id != rollout.span_id for s in members):
            members.append(rollout)  # its own span was read above even if past the fetch limit
        reward = rollout.typed.get("reward")
        if reward is None:
            reward = next((s.typed["reward"] for s in members if s.kind == "REWARD" and "reward" in s.typed), None)
        out.append(Trajectory(key, rollout, build_tree(members, cap, totals.get(key)), reward))
    return out, more
