"""A self-contained HTML page of one run's figures (``rlpulse report RUN --html out.html``).

Every chart is inline SVG drawn here in Python: no scripts, fonts or CDNs, so the page opens
on a machine without network. Tables are ReplacingMergeTree, so every read uses FINAL.
"""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

from rlpulse.sinks.views import trajectory_html
from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views.html_escape import esc  # one escaping function for the whole page
from rlpulse.sinks.views.step_figures import out_of_range_note, summarize, summary_figures, throughput
from rlpulse.sinks.views import term_figures

W, H, HEAT_H = 1000, 260, 400  # chart sizes; the heatmap is taller (15 bucket rows)
LEFT, RIGHT, TOP, BOTTOM = 70, 190, 40, 50  # margins; the legend lives in the right one
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
STATE_COLOURS = {"FIRING": "#d62728", "RESOLVED": "#2ca02c"}
NS = 1_000_000_000


def clock(ns: float) -> str:
    return dt.datetime.fromtimestamp(ns / NS, dt.timezone.utc).strftime("%H:%M:%S")


def ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    """Evenly spaced values from lo to hi (time axes)."""
    if hi <= lo:
        return [lo]
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round values (1, 2, 2.5 or 5 times a power of ten) covering [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / (n - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _frame(name: str, title: str, body: str, x_label: str = "", y_label: str = "", h: int = H) -> str:
    """An <svg data-chart=name> with its title, axis labels and the chart body."""
    return (
        f'<svg data-chart="{esc(name)}" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" '
        f'viewBox="0 0 {W} {h}" font-family="sans-serif" font-size="12">'
        f'<rect x="0" y="0" width="{W}" height="{h}" fill="#ffffff"/>'
        f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15" font-weight="bold">{esc(title)}</text>'
        f'<text x="{LEFT + (W - LEFT - RIGHT) / 2}" y="{h - 8}" text-anchor="middle">{esc(x_label)}</text>'
        f'<text x="16" y="{TOP + (h - TOP - BOTTOM) / 2}" text-anchor="middle" '
        f'transform="rotate(-90 16 {TOP + (h - TOP - BOTTOM) / 2})">{esc(y_label)}</text>'
        f"{body}</svg>"
    )


def _no_data(name: str, title: str) -> str:
    note = (f'<text class="no-data" x="{W / 2}" y="{H / 2}" text-anchor="middle" font-size="16" '
            f'fill="#888888">no data</text>')
    return _frame(name, title, note)


def _axes(x_ticks: Sequence[tuple[float, str]], y_ticks: Sequence[tuple[float, str]], h: int = H) -> str:
    """Axis lines plus tick labels; tick positions are already in pixels."""
    x0, y0 = LEFT, h - BOTTOM
    parts = [f'<line x1="{x0}" y1="{TOP}" x2="{x0}" y2="{y0}" stroke="#333"/>',
             f'<line x1="{x0}" y1="{y0}" x2="{W - RIGHT}" y2="{y0}" stroke="#333"/>']
    for px, label in x_ticks:
        parts.append(f'<line x1="{px:.1f}" y1="{y0}" x2="{px:.1f}" y2="{y0 + 4}" stroke="#333"/>'
                     f'<text x="{px:.1f}" y="{y0 + 17}" text-anchor="middle">{esc(label)}</text>')
    for py, label in y_ticks:
        parts.append(f'<line x1="{x0}" y1="{py:.1f}" x2="{W - RIGHT}" y2="{py:.1f}" stroke="#eeeeee"/>'
                     f'<text x="{x0 - 6}" y="{py + 4:.1f}" text-anchor="end">{esc(label)}</text>')
    return "".join(parts)


def _legend(entries: Sequence[tuple[str, str]]) -> str:
    x = W - RIGHT + 15
    return "".join(
        f'<rect x="{x}" y="{TOP + 18 * i}" width="12" height="12" fill="{colour}"/>'
        f'<text x="{x + 18}" y="{TOP + 18 * i + 10}">{esc(label[:24])}</text>'
        for i, (label, colour) in enumerate(entries)
    )


def _scale(lo: float, hi: float, p0: float, p1: float) -> Callable[[float], float]:
    span = (hi - lo) or 1.0
    return lambda v: p0 + (v - lo) / span * (p1 - p0)


def heatmap_svg(name: str, title: str, steps: Sequence[int], labels: Sequence[str],
                counts: Sequence[Sequence[int]]) -> str:
    """Steps across, buckets up; one <rect class="cell"> per non-empty (step, bucket), darker = more."""
    if not steps:
        return _no_data(name, title)
    top = max((c for row in counts for c in row), default=0) or 1
    h = HEAT_H
    cw, ch = (W - LEFT - RIGHT) / len(steps), (h - TOP - BOTTOM) / len(labels)
    cells = []
    for i, (step, row) in enumerate(zip(steps, counts)):
        for b, n in enumerate(row):
            if n:
                t = n / top
                fill = f"rgb({int(235 - 227 * t)},{int(245 - 197 * t)},{int(255 - 148 * t)})"
                cells.append(f'<rect class="cell" x="{LEFT + i * cw:.1f}" y="{h - BOTTOM - (b + 1) * ch:.1f}" '
                             f'width="{cw:.1f}" height="{ch:.1f}" fill="{fill}" stroke="#ffffff" stroke-width="0.5">'
                             f"<title>step {step}, reward {esc(labels[b])}: {n}</title></rect>")
    every = max(1, len(steps) // 12)
    x_ticks = [(LEFT + (i + 0.5) * cw, str(s)) for i, s in enumerate(steps) if i % every == 0]
    y_ticks = [(h - BOTTOM - (b + 0.5) * ch, lab) for b, lab in enumerate(labels)]
    scale = (f'<text x="{W - RIGHT + 15}" y="{TOP + 10}">rollouts per cell</text>'
             f'<rect x="{W - RIGHT + 15}" y="{TOP + 18}" width="12" height="12" fill="rgb(235,245,255)"/>'
             f'<text x="{W - RIGHT + 33}" y="{TOP + 28}">few</text>'
             f'<rect x="{W - RIGHT + 15}" y="{TOP + 36}" width="12" height="12" fill="rgb(8,48,107)"/>'
             f'<text x="{W - RIGHT + 33}" y="{TOP + 46}">{top} (most)</text>')
    return _frame(name, title, _axes(x_ticks, y_ticks, h) + "".join(cells) + scale, "step", "reward bucket", h)


def line_chart_svg(name: str, title: str, series: dict[str, list[tuple[float, float]]], x_label: str,
                   y_label: str, x_format: Callable[[float], str] = lambda v: f"{v:g}",
                   y_range: tuple[float, float] | None = None) -> str:
    """One <polyline class="series"> per series (a point per (x, y)), with a legend."""
    points = [p for pts in series.values() for p in pts]
    if not points:
        return _no_data(name, title)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    y_lo, y_hi = y_range or (min(0.0, min(ys)), max(ys) or 1.0)
    sx = _scale(min(xs), max(xs), LEFT + 10, W - RIGHT - 10)
    sy = _scale(y_lo, y_hi, H - BOTTOM, TOP)
    body = []
    for i, (label, pts) in enumerate(sorted(series.items())):
        colour = PALETTE[i % len(PALETTE)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in sorted(pts))
        body.append(f'<polyline class="series" data-series="{esc(label)}" points="{coords}" fill="none" '
                    f'stroke="{colour}" stroke-width="2"/>')
        body.extend(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{colour}"/>' for x, y in pts)
    uniq = sorted(set(xs))
    x_ticks = [(sx(v), x_format(v)) for v in (uniq if len(uniq) <= 12 else ticks(min(xs), max(xs)))]
    y_ticks = [(sy(v), f"{v:g}") for v in nice_ticks(y_lo, y_hi)]
    legend = _legend([(label, PALETTE[i % len(PALETTE)]) for i, label in enumerate(sorted(series))])
    return _frame(name, title, _axes(x_ticks, y_ticks) + "".join(body) + legend, x_label, y_label)


def stacked_bars_svg(name: str, title: str, bars: dict[float, dict[str, float]], x_label: str, y_label: str,
                     x_format: Callable[[float], str] = lambda v: f"{v:g}") -> str:
    """One bar per x, one <rect class="segment"> per non-zero (x, category), stacked."""
    if not bars:
        return _no_data(name, title)
    xs = sorted(bars)
    cats = sorted({c for parts in bars.values() for c in parts})
    colours = {c: PALETTE[i % len(PALETTE)] for i, c in enumerate(cats)}
    top = max(sum(parts.values()) for parts in bars.values()) or 1
    sy = _scale(0, top, H - BOTTOM, TOP)
    slot = (W - LEFT - RIGHT) / len(xs)
    body = []
    for i, x in enumerate(xs):
        base = 0.0
        for cat in cats:
            v = bars[x].get(cat, 0)
            if v:
                body.append(f'<rect class="segment" x="{LEFT + i * slot + slot * 0.15:.1f}" y="{sy(base + v):.1f}" '
                            f'width="{slot * 0.7:.1f}" height="{sy(base) - sy(base + v):.1f}" fill="{colours[cat]}">'
                            f"<title>{esc(x_format(x))} {esc(cat)}: {v:g}</title></rect>")
                base += v
    every = max(1, len(xs) // 10)
    x_ticks = [(LEFT + (i + 0.5) * slot, x_format(x)) for i, x in enumerate(xs) if i % every == 0]
    y_ticks = [(sy(v), f"{v:g}") for v in nice_ticks(0, top)]
    return _frame(name, title, _axes(x_ticks, y_ticks) + "".join(body) + _legend(list(colours.items())),
                  x_label, y_label)


def timeline_svg(name: str, title: str, events: Sequence[tuple[int, str, str, str]]) -> str:
    """events: (time_ns, rule, state, summary). One lane per rule, one marker per event:
    a red circle for FIRING, a green square for RESOLVED."""
    if not events:
        return _no_data(name, title)
    rules = sorted({e[1] for e in events})
    times = [e[0] for e in events]
    lo, hi = min(times), max(times)
    if hi == lo:
        lo, hi = lo - 30 * NS, hi + 30 * NS
    sx = _scale(lo, hi, LEFT + 100, W - RIGHT - 10)
    lane = (H - TOP - BOTTOM) / len(rules)
    body = []
    for r, rule in enumerate(rules):
        y = TOP + (r + 0.5) * lane
        body.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{W - RIGHT}" y2="{y:.1f}" stroke="#dddddd"/>'
                    f'<text x="{LEFT + 4}" y="{y - 11:.1f}" font-weight="bold">{esc(rule[:28])}</text>')
    for t, rule, state, summary in events:
        x, y = sx(t), TOP + (rules.index(rule) + 0.5) * lane
        colour = STATE_COLOURS.get(state, "#7f7f7f")
        tip = f"<title>{esc(clock(t))} {esc(rule)} {esc(state)}: {esc(summary)}</title>"
        if state == "RESOLVED":
            body.append(f'<rect class="marker" data-state="{esc(state)}" x="{x - 6:.1f}" y="{y - 6:.1f}" '
                        f'width="12" height="12" fill="{colour}">{tip}</rect>')
        else:
            body.append(f'<circle class="marker" data-state="{esc(state)}" cx="{x:.1f}" cy="{y:.1f}" r="7" '
                        f'fill="{colour}">{tip}</circle>')
    x_ticks = [(sx(v), clock(v)) for v in ticks(lo, hi, 5)]
    legend = _legend([("FIRING", STATE_COLOURS["FIRING"]), ("RESOLVED", STATE_COLOURS["RESOLVED"])])
    return _frame(name, title, _axes(x_ticks, []) + "".join(body) + legend, "time (UTC)", "rule")


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
    if not rows:
        return heatmap_svg("reward-heatmap", title, [], [], [])
    labels = _bucket_labels(list(rows[0][1]))
    return heatmap_svg("reward-heatmap", title, [r[0] for r in rows], labels, [list(r[2]) for r in rows])


def failures_chart(store: Store, run: str, attempt: int) -> str:
    rows = _rows(store, """SELECT window_start_ns, cause, sum(failures) FROM {db}.grader_failures FINAL
        WHERE run_id = {run:String} AND attempt = {attempt:UInt32}
        GROUP BY window_start_ns, cause ORDER BY window_start_ns, cause""", run=run, attempt=attempt)
    bars: dict[float, dict[str, float]] = {}
    for start, cause, n in rows:
        bars.setdefault(start, {})[cause] = n
    return stacked_bars_svg("failures-by-cause", "Grader failures by cause per window", bars,
                            "window start (UTC)", "failures", x_format=clock)


def clipped_chart(store: Store, run: str, attempt: int) -> str:
    rows = _rows(store, """SELECT step, clipped_ratio FROM {db}.step_stats FINAL
        WHERE run_id = {run:String} AND attempt = {attempt:UInt32} ORDER BY step""", run=run, attempt=attempt)
    series = {"clipped ratio": [(float(s), float(v)) for s, v in rows]} if rows else {}
    return line_chart_svg("clipped-ratio", "Clipped ratio per step (completions cut at max tokens)", series,
                          "step", "clipped / rollouts", y_range=(0.0, max([1.0] + [v for _, v in rows])))


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
    rate = {"tokens/s": [(float(r.step), r.tokens_per_s) for r in rows if r.tokens_per_s is not None]}
    mfu = {"MFU": [(float(r.step), r.mfu) for r in rows if r.mfu is not None]}
    return (figures_html(summary_figures(summary)) + (f'<p class="mfu-out-of-range">{esc(note)}</p>' if note else "")
            + line_chart_svg("throughput", "Tokens/s per step", rate if rate["tokens/s"] else {}, "step", "tokens/s")
            + line_chart_svg("mfu", "MFU per step (model FLOPs utilization of the policy update)",
                             mfu if mfu["MFU"] else {}, "step", "MFU", y_range=(0.0, 1.0)))


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
    return (f'<table class="terms"><tr>{head}</tr>{body}</table>' + (f"<p>{esc(note)}</p>" if note else "")
            + line_chart_svg("term-shares", "Mean share per step (a failed score counts 0)", shares, "step", "share"))


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
    util: dict[str, list[tuple[float, float]]] = {}
    power: dict[str, list[tuple[float, float]]] = {}
    for label, t, u, p in gpu_rows(store, run, attempt):
        util.setdefault(label, []).append((t, u))
        power.setdefault(label, []).append((t, p))
    top_util = max([100.0] + [u for pts in util.values() for _, u in pts])
    return (line_chart_svg("gpu-utilization", "GPU utilisation per GPU", util, "time (UTC)", "utilisation %",
                           x_format=clock, y_range=(0.0, top_util)),
            line_chart_svg("gpu-power", "GPU power per GPU", power, "time (UTC)", "power (W)", x_format=clock))


def alerts_chart(store: Store, run: str, attempt: int) -> str:
    rows = _rows(store, """SELECT time_ns, rule, state, summary FROM {db}.alerts FINAL
        WHERE (run_id = {run:String} AND attempt = {attempt:UInt32})
           OR key IN (SELECT assumeNotNull(hw_id) FROM {db}.placements FINAL
                      WHERE run_id = {run:String} AND attempt = {attempt:UInt32} AND hw_id IS NOT NULL)
        ORDER BY time_ns, rule, state""", run=run, attempt=attempt)
    return timeline_svg("alerts-timeline", "Alerts (FIRING / RESOLVED)", rows)


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; background: #fafafa; }}
section {{ background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 8px 16px; margin: 16px 0;
  max-width: 1040px; }}
h2 {{ font-size: 17px; margin: 8px 0; }}
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
