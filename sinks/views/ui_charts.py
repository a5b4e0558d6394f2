"""The one chart module of rlpulse's HTML views: ``rlpulse ui``'s pages and ``rlpulse report --html``.

Server-side SVG needs no script and loads nothing (the ui's Content-Security-Policy forbids both; the
report opens offline). Both views draw with these functions, so a figure reads the same in each: a
GPU at 0.9 utilisation sits at 90 % of a 0..1 axis labelled in %, in the report as on the run page.

On a run's page every chart spans the same steps at the same pixels (:class:`Axis`), so a reward drop
lines up with the clipped ratio, the failures, the GPU dip and the alert above it; times (GPU samples,
alerts) are placed on that axis between the STEP events around them (``rlpulse.sinks.views.ui_data.step_at``).
The report draws what it has by wall-clock time on a :class:`TimeAxis` (UTC clock ticks).

Values are written with the formatters of their kind (``ui_html.fmt_*``: ratios as %, rates with an SI
prefix, durations in ms/s/min): tick labels and hover text alike. Every point of every series has a
hover value without a script: an SVG ``<title>`` on each dot of a sparse series, and on every chart a
transparent column per x position whose ``<title>`` lists each series' value there (one element per
position, not per point, so 1,000 steps x 8 series stay light).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from rlpulse.sinks.views.ui_html import fmt_count, fmt_number
from rlpulse.sinks.views.ui_html import text as esc  # store values: HTML-escaped, controls visible

W, H = 720, 220  # viewBox; the ui's grid cells are 560 px and more wide, so 11 px text reads at about 11 px
LEFT, RIGHT, TOP, BOTTOM = 58, 150, 30, 28  # margins; the legend lives in the right one
DOTS_UP_TO = 150  # points per series drawn as dots too; a denser line reads better without
HEAT_BINS = 250  # a heatmap of more steps merges consecutive steps into this many columns (counts summed)
HOVER_COLUMNS = 200  # hover columns per chart at most: a denser chart shares one per HOVER_PX, showing its first
# position's values (1,000 steps x 8 series of hover text on each of 20 charts made a 2.7 MB page)
HOVER_PX = (W - LEFT - RIGHT) / HOVER_COLUMNS
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
STATE_COLOURS = {"FIRING": "#d62728", "RESOLVED": "#2ca02c"}
NS = 1_000_000_000

Format = Callable[[float], str]


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round values (1, 2, 2.5 or 5 times a power of ten) covering [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / (n - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    # rounded to the step's decimals: 0.1 * 3 is 0.30000000000000004, and a tick label shows it
    digits = max(0, -math.floor(math.log10(step)) + 2)
    return [round(first + i * step, digits) for i in range(int((hi - first) / step + 1e-9) + 1)]


def nice_top(lo: float, hi: float, n: int = 5) -> float:
    """hi raised to the next of :func:`nice_ticks`' round values, so the axis ends on a labelled tick
    (a line at 505 tokens/s under a top label of 400/s reads as off the chart)."""
    ticks = nice_ticks(lo, hi, n)
    if len(ticks) < 2 or ticks[-1] >= hi:
        return hi
    return ticks[-1] + (ticks[1] - ticks[0])


def clock(ns: float) -> str:
    """A time (ns since the epoch) as the report's axes show it: HH:MM:SS UTC."""
    return dt.datetime.fromtimestamp(ns / NS, dt.timezone.utc).strftime("%H:%M:%S")


# Round clock intervals, seconds: a time axis ticks at multiples of one of them
_CLOCK_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)


@dataclass(frozen=True)
class Axis:
    """A step axis: each step one slot of equal width, a step's point in its middle (a bar or heatmap
    column fills the slot)."""

    lo: float
    hi: float

    def x(self, step: float) -> float:
        """The pixel of a step: the middle of its slot."""
        return LEFT + (step - self.lo + 0.5) * self.slot()

    def slot(self) -> float:
        """Pixels of one step."""
        return (W - LEFT - RIGHT) / ((self.hi - self.lo) + 1)

    def span(self, first: float, last: float) -> tuple[float, float]:
        """The pixels the slots first..last cover."""
        return self.x(first) - self.slot() / 2, self.x(last) + self.slot() / 2

    def ticks(self) -> list[tuple[float, str]]:
        """(pixel, label) of the x ticks: whole steps only."""
        return [(self.x(s), str(int(s))) for s in nice_ticks(self.lo, self.hi, 8) if float(s).is_integer()]

    def where(self, v: float) -> str:
        """A position as hover text says it ("step 12"; a GPU sample between steps "step 12.35")."""
        return f"step {round(v, 2):g}"

    def where_range(self, first: float, last: float) -> str:
        return self.where(first) if first == last else f"steps {first:g}-{last:g}"


@dataclass(frozen=True)
class TimeAxis(Axis):
    """A wall-clock axis, ns since the epoch, ticked at round UTC clock times. ``unit``: one slot's
    length (a window's, for bars of windows keyed by their start); 0 for points at instants."""

    unit: float = 0.0

    def x(self, t: float) -> float:
        return LEFT + (t - self.lo) * self.slot()

    def slot(self) -> float:
        return (W - LEFT - RIGHT) / ((self.hi - self.lo + self.unit) or 1.0)

    def span(self, first: float, last: float) -> tuple[float, float]:
        return self.x(first), self.x(last + self.unit)

    def ticks(self) -> list[tuple[float, str]]:
        lo, hi = self.lo / NS, (self.hi + self.unit) / NS
        step = next((s for s in _CLOCK_STEPS if (hi - lo) / s <= 6), _CLOCK_STEPS[-1])
        first = math.ceil(lo / step) * step
        return [(self.x(t * NS), clock(t * NS)) for t in range(int(first), int(hi) + 1, step)]

    def where(self, v: float) -> str:
        return clock(v)

    def where_range(self, first: float, last: float) -> str:
        return clock(first) if first == last else f"{clock(first)}-{clock(last + self.unit)}"


def time_axis(times: Sequence[float], unit: float = 0.0) -> TimeAxis:
    """The axis over these times; a single instant gets a minute around it."""
    lo, hi = (min(times), max(times)) if times else (0.0, 0.0)
    if hi == lo and not unit:
        lo, hi = lo - 30 * NS, hi + 30 * NS
    return TimeAxis(float(lo), float(hi), float(unit))


def _y(lo: float, hi: float, h: int) -> Callable[[float], float]:
    span = (hi - lo) or 1.0
    return lambda v: h - BOTTOM - (v - lo) / span * (h - TOP - BOTTOM)


def frame(name: str, title: str, axis: Axis, body: str, h: int = H, y_ticks: Sequence[tuple[float, str]] = (),
          legend: Sequence[tuple[str, str]] = ()) -> str:
    """An <svg data-chart=name>: title, x axis, y ticks (pixels, label), legend, body."""
    x_ticks = "".join(f'<line x1="{px:.1f}" y1="{h - BOTTOM}" x2="{px:.1f}" y2="{h - BOTTOM + 4}" stroke="#333"/>'
                      f'<text class="x-tick" x="{px:.1f}" y="{h - BOTTOM + 16}" text-anchor="middle">{esc(label)}</text>'
                      for px, label in axis.ticks())
    grid = "".join(f'<line x1="{LEFT}" y1="{py:.1f}" x2="{W - RIGHT}" y2="{py:.1f}" stroke="#eee"/>'
                   f'<text class="y-tick" x="{LEFT - 6}" y="{py + 4:.1f}" text-anchor="end">{esc(label)}</text>'
                   for py, label in y_ticks)
    keys = "".join(f'<rect x="{W - RIGHT + 12}" y="{TOP + 16 * i}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="{W - RIGHT + 26}" y="{TOP + 16 * i + 9}">{esc(_cut(label, 20))}<title>{esc(label)}</title></text>'
                   for i, (label, colour) in enumerate(legend[:12]))
    return (f'<svg class="chart" data-chart="{esc(name)}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {h}" '
            f'font-family="sans-serif" font-size="11" role="img" aria-label="{esc(title)}">'
            f'<text x="8" y="18" font-size="13" font-weight="bold">{esc(title)}</text>{grid}'
            f'<line x1="{LEFT}" y1="{h - BOTTOM}" x2="{W - RIGHT}" y2="{h - BOTTOM}" stroke="#333"/>'
            f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{h - BOTTOM}" stroke="#333"/>{x_ticks}{body}{keys}</svg>')


def _cut(label: str, n: int) -> str:
    return label if len(label) <= n else label[:n - 1] + "…"


def no_data(name: str, title: str, axis: Axis, why: str = "no data") -> str:
    """A short frame saying so (no axis to read). The run page leaves such charts out (:func:`is_empty`)."""
    return (f'<svg class="chart empty" data-chart="{esc(name)}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} 44" '
            f'font-family="sans-serif" font-size="11"><text x="8" y="18" font-size="13" font-weight="bold">{esc(title)}'
            f'</text><text class="no-data" x="{LEFT}" y="36" fill="#888">{esc(why)}</text></svg>')


def is_empty(svg: str) -> bool:
    """Whether a chart of this module is :func:`no_data`'s frame (nothing to draw)."""
    return svg.startswith('<svg class="chart empty"')


_PLAIN = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#x27;"})


def _plain(value: str) -> str:
    """A formatted number, HTML-escaped (a formatter writes digits and signs; a caller's own might not)."""
    return value.translate(_PLAIN)


def _ticks(lo: float, hi: float, fmt: Format) -> list[float]:
    """The y ticks; a count's whole numbers only (0.25 tokens would be labelled "0")."""
    ticks = nice_ticks(lo, hi, 5)
    return [t for t in ticks if float(t).is_integer()] if fmt is fmt_count else ticks


def _raw(v: float) -> str:
    """A value as a data attribute holds it: exact (repr), a whole number without ".0"."""
    return str(int(v)) if isinstance(v, int) or float(v).is_integer() else repr(float(v))


def hover_positions(pxs: Iterable[float]) -> set[float]:
    """The x positions that get a hover column: of positions closer than HOVER_PX, the first."""
    kept: dict[int, float] = {}
    for px in sorted(pxs):
        kept.setdefault(round(px / HOVER_PX), px)
    return set(kept.values())


def _hover(axis: Axis, h: int, columns: dict[float, list[str]]) -> str:
    """Transparent columns, one per x position (pixel -> its lines of hover text, already escaped), each
    reaching halfway to its neighbours, under the dots (a dot's own title wins where both lie)."""
    if not columns:
        return ""
    merged = {px: columns[px] for px in hover_positions(columns)}
    xs = sorted(merged)
    edges = [LEFT] + [(a + b) / 2 for a, b in zip(xs, xs[1:])] + [W - RIGHT]
    body = "".join(f'<rect x="{edges[i]:.1f}" y="{TOP}" width="{max(edges[i + 1] - edges[i], 0.1):.1f}" '
                   f'height="{h - TOP - BOTTOM}"><title>{" | ".join(merged[px])}</title></rect>'
                   for i, px in enumerate(xs))
    return f'<g class="hover" fill="#000" fill-opacity="0">{body}</g>'


def lines(name: str, title: str, axis: Axis, series: dict[str, list[tuple[float, float]]],
          bands: dict[str, list[tuple[float, float, float]]] | None = None, y_range: tuple[float, float] | None = None,
          unit: str = "", fmt: Format = fmt_number) -> str:
    """One <polyline class="series" data-series> per series, a shaded band (lo..hi) per band. ``fmt`` writes
    the y values (ticks and hover text; ``unit`` is appended to hover values). A series of at most
    DOTS_UP_TO points has a <circle class="point" data-x data-value> per point, its <title> the value."""
    # a NaN or an infinity is no place on the axis (nice_ticks would raise): such points are left out, as a missing step
    series = {k: [(s, v) for s, v in pts if math.isfinite(v)] for k, pts in series.items()}
    bands = {k: [(s, a, b) for s, a, b in pts if math.isfinite(a) and math.isfinite(b)] for k, pts in (bands or {}).items()}
    values = [y for pts in series.values() for _, y in pts] + [v for b in bands.values() for _, lo, hi in b for v in (lo, hi)]
    if not values:
        return no_data(name, title, axis)
    if y_range:
        lo, hi = y_range
    else:
        lo = min(0.0, min(values))
        hi = nice_top(lo, max(values)) if max(values) > lo else 1.0
    y = _y(lo, hi, H)
    body: list[str] = []
    dots: list[str] = []
    legend: list[tuple[str, str]] = []
    columns: dict[float, list[str]] = {}  # pixel -> hover lines: where, then each series' value there

    # Only the positions that get a hover column have their values written (formatting is most of the cost).
    hovered = hover_positions({axis.x(s) for pts in series.values() for s, _ in pts}
                              | {axis.x(s) for b in bands.values() for s, _, _ in b})

    def tip(px: float, s: float, line: str) -> None:
        if px not in columns:
            columns[px] = [_plain(axis.where(s))]
        columns[px].append(line)

    # Hover text is escaped in parts: each label and the unit once, each value (a formatter's digits and
    # signs) with a bare translate, not the store-text escape per point: a 1,000-step page writes 30,000.
    safe_unit = esc(unit)

    for i, (label, pts) in enumerate(bands.items()):
        colour = PALETTE[i % len(PALETTE)]
        xs = [axis.x(s) for s, _, _ in pts]
        upper = " ".join(f"{px:.1f},{y(b):.1f}" for px, (_, _, b) in zip(xs, pts))
        lower = " ".join(f"{px:.1f},{y(a):.1f}" for px, (_, a, _) in zip(reversed(xs), reversed(pts)))
        body.append(f'<polygon class="band" data-series="{esc(label)}" points="{upper} {lower}" fill="{colour}" '
                    f'fill-opacity="0.15" stroke="none"/>')
        name_ = esc(label)
        for px, (s, a, b) in zip(xs, pts):
            if px in hovered:
                tip(px, s, f"{name_}: {_plain(fmt(a))}{safe_unit} to {_plain(fmt(b))}{safe_unit}")
    for i, (label, line) in enumerate(series.items()):
        colour = PALETTE[i % len(PALETTE)]
        legend.append((label, colour))
        name_ = esc(label)
        xs = [axis.x(s) for s, _ in line]
        dotted = len(line) <= DOTS_UP_TO
        shown = [_plain(fmt(v)) if dotted or px in hovered else "" for px, (_, v) in zip(xs, line)]
        coords = " ".join(f"{px:.1f},{y(v):.1f}" for px, (_, v) in zip(xs, line))
        body.append(f'<polyline class="series" data-series="{name_}" data-points="{len(line)}" points="{coords}" '
                    f'fill="none" stroke="{colour}" stroke-width="1.5"/>')
        for px, (s, _), value in zip(xs, line, shown):
            if px in hovered:
                tip(px, s, f"{name_}: {value}{safe_unit}")
        if dotted:
            dots.extend(f'<circle class="point" data-series="{name_}" data-x="{_raw(s)}" data-value="{_raw(v)}" '
                        f'cx="{px:.1f}" cy="{y(v):.1f}" r="2.5" fill="{colour}">'
                        f"<title>{name_} at {esc(axis.where(s))}: {value}{safe_unit}</title></circle>"
                        for px, (s, v), value in zip(xs, line, shown))
    ticks = [(y(v), fmt(v)) for v in _ticks(lo, hi, fmt)]
    return frame(name, title, axis, "".join(body) + _hover(axis, H, columns) + "".join(dots), y_ticks=ticks,
                 legend=legend)


def bars(name: str, title: str, axis: Axis, per_step: dict[int, dict[str, float]], fmt: Format = fmt_count) -> str:
    """A stacked bar per step (or window of a time axis), one <rect class="segment"> per non-zero category, at
    its place; more than HEAT_BINS of them are added up in HEAT_BINS bars of consecutive ones, said in the title."""
    if not per_step:
        return no_data(name, title, axis)
    cats = sorted({c for parts in per_step.values() for c in parts})
    colours = {c: PALETTE[i % len(PALETTE)] for i, c in enumerate(cats)}
    steps = sorted(per_step)
    size = max(1, -(-len(steps) // HEAT_BINS))
    columns = [(chunk[0], chunk[-1], {c: sum(per_step[s].get(c, 0) for s in chunk) for c in cats})
               for chunk in (steps[i:i + size] for i in range(0, len(steps), size))]
    top = nice_top(0, max(sum(parts.values()) for _, _, parts in columns) or 1)
    y = _y(0, top, H)
    body = []
    for first, last, parts in columns:
        x0, x1 = axis.span(first, last)
        one = axis.span(first, first)
        pad = (one[1] - one[0]) * 0.1  # a tenth of one step's (or window's) width each side, as gaps between bars
        x0, width = x0 + pad, max(x1 - x0 - 2 * pad, 1.0)
        where = axis.where_range(first, last)
        base = 0.0
        for cat in cats:
            v = parts.get(cat, 0)
            if v:
                body.append(f'<rect class="segment" data-x="{_raw(first)}" data-series="{esc(cat)}" data-value="{_raw(v)}" '
                            f'x="{x0:.1f}" y="{y(base + v):.1f}" width="{width:.1f}" height="{y(base) - y(base + v):.1f}" '
                            f'fill="{colours[cat]}"><title>{esc(where)} {esc(cat)}: {esc(fmt(v))}</title></rect>')
                base += v
    ticks = [(y(v), fmt(v)) for v in _ticks(0, top, fmt)]
    shown = title + (f" (every {size} bars added up)" if size > 1 else "")
    return frame(name, shown, axis, "".join(body), y_ticks=ticks, legend=list(colours.items()))


def heatmap(name: str, title: str, axis: Axis, labels: Sequence[str], per_step: dict[int, list[int]]) -> str:
    """Steps across, buckets up, darker = more rollouts; more than HEAT_BINS steps are merged into
    HEAT_BINS columns of consecutive steps (their counts added), said in the title."""
    if not per_step or not labels:
        return no_data(name, title, axis)
    steps = sorted(per_step)
    size = max(1, -(-len(steps) // HEAT_BINS))
    columns = []
    for i in range(0, len(steps), size):
        chunk = steps[i:i + size]
        columns.append((chunk[0], chunk[-1], [sum(per_step[s][b] for s in chunk) for b in range(len(labels))]))
    top = max((c for _, _, counts in columns for c in counts), default=0) or 1
    h = 300
    ch = (h - TOP - BOTTOM) / len(labels)
    cells = []
    for first, last, counts in columns:
        x0, x1 = axis.span(first, last)
        where = axis.where_range(first, last)
        for b, n in enumerate(counts):
            if n:
                t = n / top
                fill = f"rgb({int(235 - 227 * t)},{int(245 - 197 * t)},{int(255 - 148 * t)})"
                cells.append(f'<rect class="cell" x="{x0:.1f}" y="{h - BOTTOM - (b + 1) * ch:.1f}" width="{x1 - x0:.1f}" '
                             f'height="{ch:.1f}" fill="{fill}"><title>{esc(where)}, reward {esc(labels[b])}: '
                             f"{esc(fmt_count(n))} rollouts</title></rect>")
    ticks = [(h - BOTTOM - (b + 0.5) * ch, lab) for b, lab in enumerate(labels) if b % 2 == 0 or len(labels) < 9]
    shown = title + (f" (every {size} steps merged)" if size > 1 else "")
    legend = [("few rollouts", "rgb(235,245,255)"), (f"{fmt_count(top)} (most)", "rgb(8,48,107)")]
    return frame(name, shown, axis, "".join(cells), h=h, y_ticks=ticks, legend=legend)


def alert_lanes(name: str, title: str, axis: Axis, events: Sequence[tuple[float, str, str, str]]) -> str:
    """events: (position, rule, state, tip). A lane per rule; a red circle fires, a green square resolves."""
    if not events:
        return no_data(name, title, axis, "no alerts")
    rules = sorted({e[1] for e in events})
    lane = (H - TOP - BOTTOM) / len(rules)
    body = []
    for i, rule in enumerate(rules):
        py = TOP + (i + 0.5) * lane
        body.append(f'<line x1="{LEFT}" y1="{py:.1f}" x2="{W - RIGHT}" y2="{py:.1f}" stroke="#ddd"/>'
                    f'<text x="{LEFT + 4}" y="{py - 8:.1f}" font-weight="bold">{esc(rule[:40])}</text>')
    for pos, rule, state, tip in events:
        x, py = axis.x(pos), TOP + (rules.index(rule) + 0.5) * lane
        colour = STATE_COLOURS.get(state, "#7f7f7f")
        title_tag = f"<title>{esc(tip)}</title>"
        if state == "RESOLVED":
            body.append(f'<rect class="marker" data-state="RESOLVED" x="{x - 5:.1f}" y="{py - 5:.1f}" width="10" '
                        f'height="10" fill="{colour}">{title_tag}</rect>')
        else:
            body.append(f'<circle class="marker" data-state="{esc(state)}" cx="{x:.1f}" cy="{py:.1f}" r="6" '
                        f'fill="{colour}">{title_tag}</circle>')
    legend = [("FIRING", STATE_COLOURS["FIRING"]), ("RESOLVED", STATE_COLOURS["RESOLVED"])]
    return frame(name, title, axis, "".join(body), legend=legend)
