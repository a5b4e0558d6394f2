"""A trajectory of ``rlpulse ui``'s trajectory page, read from ClickHouse (``rlpulse.sinks.views.ui_detail`` draws it).

Its spans as the report's trajectories section reads them (``rlpulse.sinks.views.trajectories.SpanRow``, one row
per span_id), the saved query span-tree's rows, the span metric dicts, and what the sink kept out of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views.rewards import find_final_reward
from rlpulse.sinks.views.trajectories import SAMPLE_SQL, SPAN_CAP, SpanRow
from rlpulse.sinks.views.ui_data import has_column, rows, saved

_COLUMNS = ("span_id, parent_span_id, name, kind, start_time_ns, end_time_ns, status, status_message, sequence_id, "
            "attributes, term, outcome, score, judge_input_tokens, judge_output_tokens, reward, completion_tokens, "
            "max_tokens, clipped, step, " + SAMPLE_SQL + ", metrics")
TYPED = ("term", "outcome", "score", "judge_input_tokens", "judge_output_tokens", "reward", "completion_tokens",
         "max_tokens", "clipped")


@dataclass
class TrajectoryData:
    rollout: SpanRow | None
    step: int | None
    sample: str | None
    spans: list[SpanRow]  # every span of the trajectory read (at most SPAN_CAP * 4), in start order
    total: int
    tree: list[dict[str, Any]]  # the span-tree saved query
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # span_id -> its metric dict
    capped: int = 0  # spans the sink stored without their content (past its cap of full trajectories per step)
    cut_chars: int = 0  # characters of attribute values the sink removed


def trajectory(store: Store, project: str, run: str, attempt: int, rollout_id: str) -> TrajectoryData:
    """One rollout's spans: those naming its rollout_id, and those of its trace that name none. A key
    ``trace <id>`` (a ROLLOUT span without a rollout_id, as the step page names it) is that trace's spans."""
    bounds = ("content_capped, content_cut_chars" if has_column(store, "spans", "content_capped")
              else "toUInt8(0), toUInt64(0)")
    by_trace = rollout_id.startswith("trace ")
    match = ("(rollout_id = '' AND trace_id = {trace:String})" if by_trace else
             """(rollout_id = {id:String} OR (rollout_id = '' AND trace_id IN (
                  SELECT trace_id FROM {db}.spans WHERE project = {p:String} AND run_id = {r:String}
                    AND attempt = {a:UInt32} AND rollout_id = {id:String} AND kind = 'ROLLOUT')))""")
    found = rows(store, f"""
        SELECT {_COLUMNS}, count() OVER () AS total, {bounds} FROM (
            SELECT * FROM {{db}}.spans
            WHERE project = {{p:String}} AND run_id = {{r:String}} AND attempt = {{a:UInt32}} AND {match}
            ORDER BY span_id, sequence_id LIMIT 1 BY span_id)
        ORDER BY sequence_id, start_time_ns, span_id LIMIT {SPAN_CAP * 4}""", p=project, r=run, a=attempt, id=rollout_id,
                 trace=rollout_id.removeprefix("trace "))
    spans, metrics, step, sample, total, capped, cut = [], {}, None, None, 0, 0, 0
    for row in found:
        typed = {k: v for k, v in zip(TYPED, row[10:19]) if v is not None}
        span = SpanRow(span_id=str(row[0]), parent_span_id=row[1] or None, name=str(row[2]), kind=str(row[3]),
                       start_ns=int(row[4]), end_ns=int(row[5]), status=str(row[6] or "UNSET"),
                       status_message=str(row[7] or ""), sequence_id=int(row[8]), attributes=dict(row[9] or {}), typed=typed)
        spans.append(span)
        if row[21]:
            metrics[span.span_id] = {str(k): float(v) for k, v in dict(row[21]).items()}
        if span.kind == "ROLLOUT":
            step, sample = (None if row[19] is None else int(row[19])), (None if row[20] is None else str(row[20]))
        total, capped, cut = int(row[22]), capped + int(row[23]), cut + int(row[24])
    rollout = next((s for s in spans if s.kind == "ROLLOUT"), None)
    # the saved query follows rollout ids; a trace without one is drawn from the spans read (below the table)
    tree = saved(store, "span-tree", run_id=run, attempt=attempt, rollout_id=rollout_id) if spans and not by_trace else []
    return TrajectoryData(rollout, step, sample, spans, total, tree, metrics, capped, cut)


def reward_of(data: TrajectoryData) -> float | None:
    """The trajectory's final reward, as ``rlpulse export`` reads it (``rlpulse.sinks.views.rewards``)."""
    return find_final_reward(data.spans)


def first(mapping: Mapping[str, Any], *keys: str) -> Any:
    return next((mapping[k] for k in keys if mapping.get(k) not in (None, "")), None)
