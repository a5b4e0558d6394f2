"""A run's per-step throughput and efficiency (seed 001's step.tokens, step.throughput, step.mfu), read
with the saved query ``step-throughput`` and summed up the one way every view shows them.

The run page of ``rlpulse ui``, the demo's text report and the HTML report all read the saved query's
rows (what ``rlpulse query --saved step-throughput`` prints) and summarise them with :func:`summarize`,
so the three never disagree. The query decides what counts: a tokens/s of 0 without a duration is no
figure, and an MFU outside [0, 1] (which only a writer other than the SDK can send) is shown as none
and counted, so a page says "–" and how many steps sent one, never an MFU of 1.7.

More per-step figures slot in the same way: a saved query per family, a reader and a row class here,
the summary pairs in :func:`summary_figures` (the report's per-run table and the run page's figures).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlpulse.sinks.read import queries
from rlpulse.sinks.store.clickhouse import Store

QUERY = "step-throughput"
LAST_STEPS = 10  # the summary's median tokens/s and mean MFU are over the run's last this many steps


@dataclass(frozen=True)
class StepThroughput:
    """One row of the saved query step-throughput (its latest STEP event of the step)."""

    step: int
    time_ns: int
    tokens: int
    duration_s: float | None
    tokens_per_s: float | None
    mfu: float | None  # None: none published, or published outside [0, 1] (then mfu_out_of_range)
    mfu_out_of_range: bool


def throughput(store: Store, project: str | None, run: str, attempt: int) -> list[StepThroughput]:
    """The saved query's rows of one attempt, ascending by step. It takes run_id and attempt: another
    project's rows are left out here; ``project`` None (the HTML report names a run by its id alone):
    the project of the attempt's latest STEP event."""
    params = {"run_id": run, "attempt": attempt}
    sql = queries.saved_sql(QUERY, {k: str(v) for k, v in params.items()}, store.database)
    result = store.client.query(sql, parameters=params, settings={"readonly": 1})
    found = [dict(zip(result.column_names, row)) for row in result.result_rows]
    if project is None and found:
        project = max(found, key=lambda r: r["time_ns"])["project"]
    out = []
    for r in found:
        if r["project"] != project:
            continue
        out.append(StepThroughput(int(r["step"]), int(r["time_ns"]), int(r["tokens"]), _float(r["duration_s"]),
                                  _float(r["tokens_per_s"]), _float(r["mfu"]), bool(r["mfu_out_of_range"])))
    return out


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class ThroughputSummary:
    steps: int  # steps with a STEP event
    tokens: int  # over all of them
    median_tokens_per_s: float | None  # over the last LAST_STEPS steps that have one
    mean_mfu: float | None  # the same, of the MFUs in [0, 1]
    mfu_out_of_range: int  # steps (all of the run's) whose published MFU lies outside [0, 1]


def summarize(rows: Sequence[StepThroughput], last: int = LAST_STEPS) -> ThroughputSummary:
    """The run's figures: the median tokens/s and mean MFU over its ``last`` highest steps (a step
    without the figure is left out of that one), tokens and out-of-range MFUs over all its steps."""
    tail = sorted(rows, key=lambda r: r.step)[-last:] if last > 0 else []
    rates = [r.tokens_per_s for r in tail if r.tokens_per_s is not None]
    mfus = [r.mfu for r in tail if r.mfu is not None]
    return ThroughputSummary(len(rows), sum(r.tokens for r in rows), statistics.median(rates) if rates else None,
                             statistics.fmean(mfus) if mfus else None, sum(r.mfu_out_of_range for r in rows))


def summary_figures(s: ThroughputSummary) -> list[tuple[str, str, Any]]:
    """(key, label, value) of the summary, in the order every view shows them; values rounded as shown
    (tokens/s to 2 decimals, MFU to 4); None where there is no figure."""
    return [
        ("tokens", "tokens", s.tokens),
        ("median-tokens-per-s", f"median tokens/s (last {LAST_STEPS} steps)",
         None if s.median_tokens_per_s is None else round(s.median_tokens_per_s, 2)),
        ("mean-mfu", f"mean MFU (last {LAST_STEPS} steps)", None if s.mean_mfu is None else round(s.mean_mfu, 4)),
        ("mfu-out-of-range", "steps with an MFU outside [0, 1]", s.mfu_out_of_range),
    ]


def out_of_range_note(count: int) -> str:
    """What a view says when some steps published an MFU outside [0, 1] ('' when none did)."""
    if not count:
        return ""
    steps = "1 step" if count == 1 else f"{count} steps"
    return f"{steps} reported an MFU outside [0, 1]: no MFU is shown for them, and the mean leaves them out."


@dataclass(frozen=True)
class GpuTime:
    """One row of the saved query gpu-time: the GPU time and energy of one attempt (seed 001's GPU time)."""

    project: str
    run_id: str
    attempt: int
    gpus: int
    gpu_hours: float
    energy_kwh: float | None  # None: none of its GPUs reports energy


def gpu_time(store: Store, project: str | None = None, run: str | None = None) -> list[GpuTime]:
    """The saved query's rows (it takes no parameters), of one project and run when given."""
    sql = queries.saved_sql("gpu-time", {}, store.database)
    result = store.client.query(sql, settings={"readonly": 1})
    out = []
    for row in result.result_rows:
        r = dict(zip(result.column_names, row))
        if (project is None or r["project"] == project) and (run is None or r["run_id"] == run):
            out.append(GpuTime(str(r["project"]), str(r["run_id"]), int(r["attempt"]), int(r["gpus"]),
                               float(r["gpu_hours"]), _float(r["energy_kwh"])))
    return out
