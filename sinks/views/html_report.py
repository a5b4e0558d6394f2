"""A self-contained HTML page of one run's figures (``rlpulse report RUN --html out.html``).

Every chart is inline SVG drawn in Python by the ui's chart module (``rlpulse.sinks.views.ui_charts``), so
the report and ``rlpulse ui`` draw a figure the same way (GPU utilisation on a 0..1 axis labelled in %);
no scripts, fonts or CDNs, so the page opens on a machine without network. Step figures are drawn
per step, GPU samples, grader windows and alerts by wall-clock time (UTC). Tables are
ReplacingMergeTree, so every read uses FINAL.
"""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from rlpulse.sinks.views import trajectory_html
from rlpulse.sinks.views import ui_charts as charts
from rlpulse.sinks.views.ui_charts import clock
from rlpulse.sinks.views.ui_html import fmt_count, fmt_rate, fmt_ratio
from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views.html_escape import esc  # one escaping function for the whole page
from rlpulse.sinks.views.step_figures import out_of_range_note, summarize, summary_figures, throughput
from rlpulse.sinks.views import term_figures

NS = 1_000_000_000


def _step_axis(steps: Sequence[float]) -> charts.Axis:
    """Each chart of the report spans its own steps (the ui's run page shares one axis among them)."""
    return charts.Axis(float(min(steps)), float(max(steps))) if steps else charts.Axis(0.0, 1.0)


def _rows(store: Store, sql: str, **params: Any) -> list[tuple]:
    return store.client.query(sql.replace("{db}", store.database), parameters=params).result_rows


def latest_attempt(store: Store, run_id: str) -> int | None:
    """The highest attempt of the run that has rows in any per-run table; None when none has."""
    tables = ("steps", "step_stats", "reward_histograms", "grader_failures", "placements", "spans")
    union = " UNION ALL ".join(f"SELECT attempt FROM {{db}}.{t} WHERE run_id = {{run:String}}" for t in tables)
    rows = _rows(store, f"SELECT max(attempt), count() FROM ({union})", run=run_id)
    return int(rows[0][0]) if rows and rows[0][1] else None


def _bucket_labels(bounds: Sequence[float]) -> list[str]:
    return [f"≤{bounds[0]:g}"] + [f"≤{hi:g}" for hi in bounds[1:]] + [f">{bounds[-1]:g}"]


def reward_heatmap(store: Store, run: str, attempt: int) -> str:
    rows = _rows(store, """SELECT step, bounds, bucket_counts FROM {db}.reward_histograms FINAL
        WHERE run_id = {run:String} AND attempt = {attempt:UInt32} AND term = 'total' ORDER BY step""",
                 run=run, attempt=attempt)
    title = "Reward histogram per step (term total)"
    labels = _bucket_labels(list(rows[0][1])) if rows else []
    return charts.heatmap("reward-heatmap", title, _step_axis([r[0] for r in rows]), labels,
                          {int(r[0]): [int(c) for c in r[2]] for r in rows})


def failures_chart(store: Store, run: str, attempt: int) -> str:
    rows = _rows(store, """SELECT window_start_ns, max(window_end_ns - window_start_ns), cause, sum(failures)
        FROM {db}.grader_failures FINAL WHERE run_id = {run:String} AND attempt = {attempt:UInt32}
        GROUP BY window_start_ns, cause ORDER BY window_start_ns, cause""", run=run, attempt=attempt)
    bars: dict[int, dict[str, float]] = {}
    for start, _, cause, n in rows:
        bars.setdefault(int(start), {})[str(cause)] = float(n)
    # a bar fills its window: the axis' slot is the windows' length (all of a run's have one)
    axis = charts.time_axis(list(bars), unit=max((int(r[1]) for r in rows), default=0))
    return charts.bars("failures-by-cause", "Grader failures by cause per window (UTC)", axis, bars)


def clipped_chart(store: Store, run: str, attempt: int) -> str:
    rows = _rows(store, """SELECT step, clipped_ratio FROM {db}.step_stats FINAL
        WHERE run_id = {run:String} AND attempt = {attempt:UInt32} ORDER BY step""", run=run, attempt=attempt)
    series = {"clipped ratio": [(float(s), float(v)) for s, v in rows]} if rows else {}
    return charts.lines("clipped-ratio", "Clipped ratio per step (completions cut at max tokens)",
                        _step_axis([s for s, _ in rows]), series, y_range=(0.0, max([1.0] + [v for _, v in rows])),
                        fmt=fmt_ratio)


def figures_html(figures: Sequence[tuple[str, str, Any]]) -> str:
    """A run's summary figures as a table of (label, value) rows, each row's data-figure its key; a value
    that is None shows as "–". Any per-run summary (more per-step figure families) renders with it."""
    def shown(v: Any) -> str:
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            return "–"
        return f"{v:g}" if isinstance(v, float) else str(v)

    body = "".join(f'<tr data-figure="{esc(key)}"><th>{esc(label)}</th><td class="n">{esc(shown(value))}</td></tr>'
                   for key, label, value in figures)
    return f'<table class="figures">{body}</table>'


def throughput_section(store: Store, run: str, attempt: int) -> str:
    """Tokens, tokens/s and MFU of the run (the saved query step-throughput): its summary, a note when
    steps reported an MFU outside [0, 1], and a chart of each per step."""
    rows = throughput(store, None, run, attempt)
    summary = summarize(rows)
    note = out_of_range_note(summary.mfu_out_of_range)
    axis = _step_axis([r.step for r in rows])
    rate = {"tokens/s": [(float(r.step), r.tokens_per_s) for r in rows if r.tokens_per_s is not None]}
    mfu = {"MFU": [(float(r.step), r.mfu) for r in rows if r.mfu is not None]}
    return (figures_html(summary_figures(summary)) + (f'<p class="mfu-out-of-range">{esc(note)}</p>' if note else "")
            + charts.lines("tokens", "Tokens per step", axis, {"tokens": [(float(r.step), float(r.tokens)) for r in rows]},
                           fmt=fmt_count)
            + charts.lines("throughput", "Tokens/s per step", axis, rate, fmt=fmt_rate)
            + charts.lines("mfu", "MFU per step (model FLOPs utilization of the policy update)", axis, mfu,
                           y_range=(0.0, 1.0), fmt=fmt_ratio))


def terms_section(store: Store, run: str, attempt: int) -> str:
    """Each reward term over the run (as the run page and the text report sum it up) and its mean share per
    step. The page names a run by id alone: the project of the attempt's latest step event."""
    latest = _rows(store, """SELECT project FROM {db}.steps WHERE run_id = {run:String} AND attempt = {attempt:UInt32}
        ORDER BY time_ns DESC LIMIT 1""", run=run, attempt=attempt)
    rows = term_figures.term_rows(store, latest[0][0] if latest else None, run, attempt)
    summaries = term_figures.summarize(rows)
    head = "".join(f"<th>{esc(h)}</th>" for h, _ in term_figures.COLUMNS)
    body = "".join(f'<tr data-term="{esc(t.term)}">' + "".join(f"<td>{esc('–' if v is None else str(v))}</td>"
                                                               for v in term_figures.summary_row(t)) + "</tr>"
                   for t in summaries)
    note = term_figures.cost_note(summaries)
    shares = {t.term: [(float(r["step"]), float(r["share_mean"])) for r in rows if r["term"] == t.term and r["rollouts"]]
              for t in summaries}
    axis = _step_axis([r["step"] for r in rows])
    return (f'<table class="terms"><tr>{head}</tr>{body}</table>' + (f"<p>{esc(note)}</p>" if note else "")
            + charts.lines("term-shares", "Mean share per step (a failed score counts 0)", axis, shares))


def gpu_rows(store: Store, run: str, attempt: int) -> list[tuple]:
    """(label, time_ns, utilisation, power) of the GPUs placed on the run, matched by hw_id
    (never by index), in [first placement, last placement + 60 s]."""
    return _rows(store, """
        SELECT concat(p.host, ' #', toString(p.idx), ' ', p.hw_id) AS label, s.time_ns, s.gpu_utilization, s.power_w
        FROM (SELECT hw_id, time_ns, gpu_utilization, power_w FROM {db}.gpu_samples FINAL) AS s
        INNER JOIN (
            SELECT assumeNotNull(hw_id) AS hw_id, any(host) AS host, any(`index`) AS idx,
                   min(time_ns) AS lo, max(time_ns) + 60000000000 AS hi
            FROM {db}.placements FINAL
            WHERE run_id = {run:String} AND attempt = {attempt:UInt32} AND hw_id IS NOT NULL AND hw_id != ''
            GROUP BY hw_id) AS p ON s.hw_id = p.hw_id
        WHERE s.time_ns BETWEEN p.lo AND p.hi
        ORDER BY label, s.time_ns""", run=run, attempt=attempt)


def gpu_charts(store: Store, run: str, attempt: int) -> tuple[str, str]:
    """GPU utilisation (stored as a fraction, 0..1: an axis from 0 to 1 labelled in %, as the run page draws it)
    and power per GPU, by time."""
    util: dict[str, list[tuple[float, float]]] = {}
    power: dict[str, list[tuple[float, float]]] = {}
    for label, t, u, p in gpu_rows(store, run, attempt):
        util.setdefault(label, []).append((float(t), float(u)))
        power.setdefault(label, []).append((float(t), float(p)))
    axis = charts.time_axis([t for pts in util.values() for t, _ in pts])
    top = max([1.0] + [u for pts in util.values() for _, u in pts])
    return (charts.lines("gpu-utilization", "GPU utilisation per GPU (UTC)", axis, util, y_range=(0.0, top),
                         fmt=fmt_ratio),
            charts.lines("gpu-power", "GPU power per GPU, W (UTC)", axis, power, unit=" W"))


def alerts_chart(store: Store, run: str, attempt: int) -> str:
    rows = _rows(store, """SELECT time_ns, rule, state, summary FROM {db}.alerts FINAL
        WHERE (run_id = {run:String} AND attempt = {attempt:UInt32})
           OR key IN (SELECT assumeNotNull(hw_id) FROM {db}.placements FINAL
                      WHERE run_id = {run:String} AND attempt = {attempt:UInt32} AND hw_id IS NOT NULL)
        ORDER BY time_ns, rule, state""", run=run, attempt=attempt)
    events = [(float(t), str(rule), str(state), f"{clock(t)} {rule} {state}: {summary}") for t, rule, state, summary in rows]
    return charts.alert_lanes("alerts-timeline", "Alerts (FIRING / RESOLVED), UTC", charts.time_axis([e[0] for e in events]),
                              events)


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; background: #fafafa; }}
section {{ background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 8px 16px; margin: 16px 0;
  max-width: 1040px; }}
h2 {{ font-size: 17px; margin: 8px 0; }}
svg.chart {{ display: block; width: 100%; max-width: 900px; background: #fff; margin: 6px 0; }}
{css}</style></head>
<body><h1>{title}</h1><p>{subtitle}</p>
{sections}
</body></html>
"""


def render(store: Store, run_id: str, attempt: int | None = None, step: int | None = None,
           sample: str | None = None) -> str:
    """The whole page as a string. ``attempt`` None: the latest attempt that has data (or 0).
    ``step``/``sample``: whose trajectories the page shows (default: see rlpulse.sinks.views.trajectories.select)."""
    note = ""
    if attempt is None:
        found = latest_attempt(store, run_id)
        attempt, note = (found, "") if found is not None else (0, f" No rows name run {run_id}.")
    util, power = gpu_charts(store, run_id, attempt)
    charts = [
        ("Reward distribution per step", reward_heatmap(store, run_id, attempt)),
        ("Grader failures by cause", failures_chart(store, run_id, attempt)),
        ("Clipped ratio per step", clipped_chart(store, run_id, attempt)),
        ("Reward terms", terms_section(store, run_id, attempt)),
        ("Throughput and efficiency per step", throughput_section(store, run_id, attempt)),
        ("GPU utilisation", util),
        ("GPU power", power),
        ("Alerts", alerts_chart(store, run_id, attempt)),
    ]
    sections = "\n".join(f"<section><h2>{esc(h)}</h2>\n{svg}\n</section>" for h, svg in charts)
    sections += "\n" + trajectory_html.render_section(store, run_id, attempt, step, sample)
    generated = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return PAGE.format(title=esc(f"rlpulse report: run {run_id}, attempt {attempt}"), sections=sections,
                       css=trajectory_html.CSS,
                       subtitle=esc(f"Read from {store.url} at {generated}. Times are UTC.{note}"))


def write_report(store: Store, run_id: str, path: str | Path, attempt: int | None = None, step: int | None = None,
                 sample: str | None = None) -> Path:
    page = render(store, run_id, attempt, step, sample)  # before opening the file: a bad --step leaves none
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
