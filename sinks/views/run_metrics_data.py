"""Seed 000's per-rollout and per-reward metrics of a run (``rollout_metrics`` / ``reward_metrics`` on its
ROLLOUT and REWARD entry spans), read for the run page of ``rlpulse ui`` with the saved query
``rollout-metrics``: the page shows what ``rlpulse query --saved rollout-metrics`` prints.

Kept apart from ``ui_data`` (which fills its ``RunData.entry_metrics`` from here) so that module stays
one screenful of reads per figure family; it imports nothing of the views, so no import runs in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlpulse.schemas.enums import SPAN_KINDS
from rlpulse.sinks.read import queries
from rlpulse.sinks.store.clickhouse import Store

QUERY = "rollout-metrics"
KINDS = (SPAN_KINDS[0], SPAN_KINDS[1])  # the entry kinds ROLLOUT and REWARD, in the order the page draws them
_BY_RUN = "WHERE run_id = {run_id:String}"
NAMES_PER_KIND = 10  # charts drawn per kind: seed 000 advises at most 10 names, and the SDK refuses more


@dataclass(frozen=True)
class EntryMetric:
    """One row of the saved query: a metric of one kind of entry span at one step."""

    step: int
    kind: str  # ROLLOUT (rollout_metrics) or REWARD (reward_metrics)
    name: str
    rollouts: int  # entries of the step that carry the name
    mean: float
    std: float  # population standard deviation, as the streams' reward_std
    min: float
    max: float


def entry_metrics(store: Store, project: str, run: str, attempt: int) -> list[EntryMetric]:
    """The saved query's rows of one attempt, ascending by (step, kind, name). It takes run_id alone:
    rows of another project or attempt are left out here."""
    sql = queries.saved_sql(QUERY, {"run_id": run}, store.database)
    # Narrowed to the attempt's whole key, the prefix of the spans' sort key: by run_id alone ClickHouse reads
    # every run's entry spans (0.12 s of a 1,000-step run's page with 8 such runs stored). Should the text
    # change so this no longer applies, the rows are still filtered below.
    sql = sql.replace(_BY_RUN, "WHERE project = {p:String} AND run_id = {run_id:String} AND attempt = {a:UInt32}")
    result = store.client.query(sql, parameters={"run_id": run, "p": project, "a": attempt}, settings={"readonly": 1})
    out = []
    for row in result.result_rows:
        r = dict(zip(result.column_names, row))
        if (r["project"], int(r["attempt"])) == (project, attempt):
            out.append(EntryMetric(int(r["step"]), str(r["kind"]), str(r["name"]), int(r["rollouts"]), float(r["mean"]),
                                   float(r["std"]), float(r["min"]), float(r["max"])))
    return out


def by_name(rows: list[EntryMetric]) -> dict[tuple[str, str], list[EntryMetric]]:
    """(kind, name) -> its rows by step, kinds in KINDS' order then names sorted, NAMES_PER_KIND per kind."""
    found: dict[tuple[str, str], list[EntryMetric]] = {}
    for r in rows:
        found.setdefault((r.kind, r.name), []).append(r)
    keys = sorted(found, key=lambda k: (KINDS.index(k[0]) if k[0] in KINDS else len(KINDS), k[0], k[1]))
    kept: dict[str, int] = {}
    out = {}
    for kind, name in keys:
        kept[kind] = kept.get(kind, 0) + 1
        if kept[kind] <= NAMES_PER_KIND:
            out[(kind, name)] = sorted(found[(kind, name)], key=lambda r: r.step)
    return out


def names_left_out(rows: list[EntryMetric]) -> int:
    """How many (kind, name) pairs :func:`by_name` leaves out (a writer other than the SDK sent more)."""
    return len({(r.kind, r.name) for r in rows}) - len(by_name(rows))
