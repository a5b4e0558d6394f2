"""A run's per-term figures (seed 001: each term's share mean and spread per step, grader.duration,
grader.failures, grader.tokens), read with the saved query ``term-figures`` and summed up the one way
every view shows them.

The run page of ``rlpulse ui``, the demo's text report and the HTML report read the saved query's rows
(what ``rlpulse query --saved term-figures`` prints) and summarise them per term with
:func:`summarize`, so the three never disagree with each other or with the query.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlpulse.sinks.read import queries
from rlpulse.sinks.store.clickhouse import Store

QUERY = "term-figures"


def term_rows(store: Store, project: str | None, run: str, attempt: int | None = None) -> list[dict[str, Any]]:
    """The saved query's rows of a run (one per step and term), of one project and attempt when given,
    ascending by (project, attempt, step, term)."""
    sql = queries.saved_sql(QUERY, {"run_id": run}, store.database)
    result = store.client.query(sql, parameters={"run_id": run}, settings={"readonly": 1})
    found = [dict(zip(result.column_names, row)) for row in result.result_rows]
    return [r for r in found if (project is None or r["project"] == project) and (attempt is None or r["attempt"] == attempt)]


@dataclass(frozen=True)
class TermSummary:
    """One term over a run's steps."""

    term: str
    steps: int  # steps with a row for the term
    share_mean: float | None  # mean over the steps of the step's mean share (each step weighs the same)
    share_std: float | None  # mean over the steps of the step's spread
    graded: int  # grader calls, failed ones included
    failures: int
    failure_cost: float  # the steps' failure costs summed (a step whose cost is unknown adds nothing)
    cost_unknown: int  # steps whose failures have no cost figure: the term scored none of their rollouts
    duration_p90_s: float | None  # the largest step p90 of the term's grader calls
    judge_input_tokens: int
    judge_output_tokens: int


def summarize(rows: Sequence[dict[str, Any]]) -> list[TermSummary]:
    """Per term, by name: its figures over the rows (one attempt's, as term_rows gives them)."""
    by_term: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_term.setdefault(str(r["term"]), []).append(r)
    out = []
    for term, rs in sorted(by_term.items()):
        shares = [float(r["share_mean"]) for r in rs if r["rollouts"]]
        spreads = [float(r["share_std"]) for r in rs if r["rollouts"]]
        p90s = [float(r["duration_p90_s"]) for r in rs if r["graded"]]
        out.append(TermSummary(
            term, len(rs), statistics.fmean(shares) if shares else None, statistics.fmean(spreads) if spreads else None,
            sum(int(r["graded"]) for r in rs), sum(int(r["failures"]) for r in rs),
            sum(float(r["failure_cost"]) for r in rs if r["failure_cost"] is not None),
            sum(1 for r in rs if r["failure_cost"] is None), max(p90s) if p90s else None,
            sum(int(r["judge_input_tokens"]) for r in rs), sum(int(r["judge_output_tokens"]) for r in rs)))
    return out


# (heading, attribute) of a TermSummary, in the order every view shows them
COLUMNS: tuple[tuple[str, str], ...] = (
    ("term", "term"), ("steps", "steps"), ("share mean", "share_mean"), ("share spread", "share_std"),
    ("grader calls", "graded"), ("failures", "failures"), ("failure cost", "failure_cost"),
    ("grader p90 s (max)", "duration_p90_s"), ("judge tokens in", "judge_input_tokens"),
    ("judge tokens out", "judge_output_tokens"),
)


def summary_row(s: TermSummary) -> tuple[Any, ...]:
    """A summary's values in COLUMNS' order, rounded as shown (4 digits; durations 3)."""
    def rounded(attr: str) -> Any:
        v = getattr(s, attr)
        if isinstance(v, float):
            return round(v, 3 if attr == "duration_p90_s" else 4)
        return v
    return tuple(rounded(attr) for _, attr in COLUMNS)


def cost_note(summaries: Sequence[TermSummary]) -> str:
    """What a view says when some failures have no cost ('' when all do)."""
    unknown = [f"{s.term} ({s.cost_unknown})" for s in summaries if s.cost_unknown]
    if not unknown:
        return ""
    return ("failure cost unknown for steps where the term scored no rollout, left out of the sum: "
            + ", ".join(unknown))
