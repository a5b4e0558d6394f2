"""The compare page's charts: N runs' lines overlaid on one axis, steps or minutes since each run's first step.

Drawn as inline SVG on ``rlpulse.sinks.views.ui_charts``' frame and step axis, so a compare chart reads like a
run page's (no script, nothing loaded: the page's Content-Security-Policy forbids both). Eight runs stay apart
printed in grey or seen by a colour-blind reader: run i has its own colour AND its own dash pattern
(``COLOURS[i]``, ``DASHES[i]``), and every legend draws both.

Values show on hover without a script, through SVG ``<title>``s: every point of a line of at most
``DOTS_UP_TO`` points is a circle with its own title, and a transparent strip per step (binned into at most
``COLUMNS`` strips on a long axis) lists every run's value there. Each circle carries ``data-step``, ``data-x``
(the step, or minutes), ``data-value`` (what is drawn: smoothed when the page asks), ``data-raw`` (as read) and,
for a band, ``data-lo`` / ``data-hi``: exact figures for a test or a scraper, not rounded text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlpulse.sinks.views.ui_charts import BOTTOM, DOTS_UP_TO, H, LEFT, RIGHT, TOP, W, Axis, frame, nice_ticks, no_data
from rlpulse.sinks.views.ui_html import fmt_duration, fmt_number
from rlpulse.sinks.views.ui_html import text as esc  # store values (run ids): HTML-escaped, controls visible

__all__ = ["COLOURS", "DASHES", "Axis", "Point", "Series", "TimeAxis", "ema", "no_data", "overlay", "style", "swatch"]

# Okabe & Ito's colour-blind-safe eight, their yellow (unreadable on white) swapped for Paul Tol's olive
COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9", "#000000", "#999933")
# solid, long dash, dots, dash-dot, even dash, dash-dot-dot, sparse dots, dash-dot-dot-dot: told apart in grey
DASHES = ("", "9 4", "2 3", "9 3 2 3", "5 5", "14 3 2 3 2 3", "1 7", "6 2 1 2 1 2 1 6")
COLUMNS = 128  # hover strips per chart at most: a 1,000-step axis gets one per 8 steps, not a page of 1,000
PLOT = W - LEFT - RIGHT


def style(index: int) -> tuple[str, str]:
    """Run ``index``'s colour and dash pattern (runs are numbered in the URL's order, from 0)."""
    if not 0 <= index < len(COLOURS):
        raise ValueError(f"at most {len(COLOURS)} runs are told apart, got run number {index + 1}")
    return COLOURS[index], DASHES[index]


def swatch(index: int, width: int = 36) -> str:
    """A short line in run ``index``'s colour and dash, for a legend in HTML."""
    colour, dash = style(index)
    return (f'<svg class="swatch" data-dash="{dash or "solid"}" viewBox="0 0 {width} 10" width="{width}" height="10" '
            f'aria-hidden="true"><line x1="0" y1="5" x2="{width}" y2="5" stroke="{colour}" stroke-width="2.5"'
            + (f' stroke-dasharray="{dash}"' if dash else "") + "/></svg>")


def ema(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing, weight in [0, 1): an exponential moving average debiased at the start, so the
    first value stays as read and early points are not pulled towards 0; weight 0 gives the values back."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"the smoothing weight must be from 0 to below 1, got {weight!r}")
    if weight == 0.0:
        return [float(v) for v in values]
    out, last, decay = [], 0.0, 1.0
    for v in values:
        last = last * weight + (1.0 - weight) * v
        decay *= weight  # weight ** i, kept as it goes
        out.append(last / (1.0 - decay))
    return out


@dataclass(frozen=True)
class TimeAxis(Axis):
    """Minutes since each run's first step: continuous (``Axis`` gives each whole step a slot)."""

    def x(self, step: float) -> float:
        return LEFT + (step - self.lo) / ((self.hi - self.lo) or 1.0) * PLOT

    def slot(self) -> float:
        return PLOT / ((self.hi - self.lo) or 1.0)


@dataclass
class Point:
    step: int
    x: float  # on the axis: the step, or minutes since the run's first step
    value: float
    lo: float | None = None  # a band around the value (p10 .. p90), drawn when given
    hi: float | None = None


@dataclass
class Series:
    index: int  # the run's place in the URL: its colour and dash
    run: str  # the run as data-run says it (the page's key for it)
    label: str  # the run, as the legend names it
    points: list[Point]


def _where(p: Point, timed: bool) -> str:
    return f"step {p.step}" + (f", {fmt_duration(p.x * 60)} after its first step" if timed else "")


_PLAIN = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#x27;"})


def _plain(value: str) -> str:
    """Our own text (formatted numbers, fixed words) HTML-escaped; store text goes through ``esc``."""
    return value.translate(_PLAIN)


def _tip(p: Point, shown: float, fmt: Callable[[float], str], timed: bool, band: tuple[str, str], smoothed: bool) -> str:
    """What follows a run's label in its hover text: where, the value (smoothed too), the band; no store text."""
    extra = f" (smoothed: {fmt(shown)})" if smoothed else ""
    spread = f"; {band[0]} {fmt(p.lo)}, {band[1]} {fmt(p.hi)}" if p.lo is not None and p.hi is not None else ""
    return _plain(f" at {_where(p, timed)}: {fmt(p.value)}{extra}{spread}")


@dataclass
class _Line:
    """A series as drawn: its points in axis order, their pixels across, and what is drawn (smoothed)."""

    series: Series
    points: list[Point]
    px: list[float]
    values: list[float]
    los: list[float] | None
    his: list[float] | None


def overlay(name: str, title: str, axis: Axis, series: Sequence[Series], fmt: Callable[[float], str] = fmt_number,
            smooth: float = 0.0, y_range: tuple[float, float] | None = None, band: tuple[str, str] = ("p10", "p90"),
            ) -> str:
    """One <svg data-chart=name>: a line per run (``<polyline class="series" data-run>``, in its colour and dash),
    a shaded band per run whose points carry lo/hi, hover titles; "" when no run has a point (the page hides
    empty charts). ``smooth``: the EMA weight applied to what is drawn; ``fmt``: how values read (by kind)."""
    drawn = [s for s in series if s.points]
    if not drawn:
        return ""
    timed = isinstance(axis, TimeAxis)
    # both axes are linear: two calls give the map, and 8 runs x 1,000 steps x 14 charts stay well under a second
    x0 = axis.x(0.0)
    kx = axis.x(1.0) - x0
    lines = []
    for s in drawn:
        pts = sorted(s.points, key=lambda p: (p.x, p.step))
        banded = all(p.lo is not None and p.hi is not None for p in pts)
        lines.append(_Line(s, pts, [x0 + kx * p.x for p in pts], ema([p.value for p in pts], smooth),
                           ema([p.lo for p in pts], smooth) if banded else None,  # type: ignore[misc]
                           ema([p.hi for p in pts], smooth) if banded else None))  # type: ignore[misc]
    values = [v for ln in lines for vs in (ln.values, ln.los or (), ln.his or ()) for v in vs]
    lo, hi = y_range or (min(values), max(values))
    if y_range is None and hi - lo < 1e-12:  # one value: a band around it, not a division by zero
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    ky = (H - TOP - BOTTOM) / (hi - lo)
    y0 = H - BOTTOM + lo * ky  # y(v) = y0 - ky * v

    def coords(px: Sequence[float], vs: Sequence[float]) -> str:
        return " ".join(f"{a:.1f},{y0 - ky * v:.1f}" for a, v in zip(px, vs))

    body = []
    for ln in lines:
        if ln.los is not None and ln.his is not None:
            body.append(f'<polygon class="band" data-run="{esc(ln.series.run)}" points="{coords(ln.px, ln.his)} '
                        f'{coords(ln.px[::-1], ln.los[::-1])}" fill="{style(ln.series.index)[0]}" fill-opacity="0.07" '
                        'stroke="none"/>')
    for ln in lines:
        colour, dash = style(ln.series.index)
        body.append(f'<polyline class="series" data-run="{esc(ln.series.run)}" data-index="{ln.series.index}" '
                    f'data-points="{len(ln.points)}" points="{coords(ln.px, ln.values)}" fill="none" stroke="{colour}" '
                    'stroke-width="1.6"' + (f' stroke-dasharray="{dash}"' if dash else "") + "/>")
    body.append(_columns(lines, fmt, timed, band, smooth > 0))
    for ln in lines:
        if len(ln.points) > DOTS_UP_TO:
            continue  # a dense line reads better without dots; its strips still say each value
        s, colour = ln.series, style(ln.series.index)[0]
        for p, px, v in zip(ln.points, ln.px, ln.values):
            spread = f' data-lo="{p.lo!r}" data-hi="{p.hi!r}"' if p.lo is not None and p.hi is not None else ""
            body.append(f'<circle class="point" data-run="{esc(s.run)}" data-step="{p.step}" data-x="{p.x!r}" '
                        f'data-value="{v!r}" data-raw="{p.value!r}"{spread} cx="{px:.1f}" cy="{y0 - ky * v:.1f}" '
                        f'r="2.4" fill="{colour}"><title>{esc(s.label)}{_tip(p, v, fmt, timed, band, smooth > 0)}'
                        '</title></circle>')
    body.append(_legend(drawn))
    body.append(f'<text class="x-label" x="{W - RIGHT}" y="{H - 2}" text-anchor="end" fill="#57606a">'
                f'{"minutes since the run’s first step" if timed else "step"}</text>')
    if timed:  # frame draws the whole-number ticks; a short run's axis needs the fractional ones too
        body.extend(f'<line x1="{axis.x(t):.1f}" y1="{H - BOTTOM}" x2="{axis.x(t):.1f}" y2="{H - BOTTOM + 4}" '
                    f'stroke="#333"/><text x="{axis.x(t):.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{t:g}</text>'
                    for t in nice_ticks(axis.lo, axis.hi, 8) if not float(t).is_integer())
    ticks = [(y0 - ky * v, fmt(v)) for v in nice_ticks(lo, hi, 5)]
    shown = title + (f" (EMA {smooth:g})" if smooth > 0 else "")
    return frame(name, shown, axis, "".join(body), y_ticks=ticks)


def _columns(lines: list[_Line], fmt: Callable[[float], str], timed: bool, band: tuple[str, str], smoothed: bool) -> str:
    """Transparent strips across the plot, each titled with every run's value there (the last point of each
    run that falls in it), so hovering anywhere over a step reads all the runs at once."""
    bins: dict[int, dict[int, tuple[Series, Point, float]]] = {}
    scale = COLUMNS / PLOT
    for ln in lines:
        for p, px, v in zip(ln.points, ln.px, ln.values):
            b = min(COLUMNS - 1, max(0, int((px - LEFT) * scale)))
            bins.setdefault(b, {})[ln.series.index] = (ln.series, p, v)
    order = sorted(bins)
    centres = [LEFT + (b + 0.5) / scale for b in order]
    edges = [LEFT] + [(a + c) / 2 for a, c in zip(centres, centres[1:])] + [W - RIGHT]
    out = []
    # Each run's label (a store value) is escaped once, not once per strip: the rest of a tip is the formatters'
    # digits, signs and units and the fixed words around them, which need no escaping (8 runs x 128 strips x 14
    # charts escaped whole took a quarter of the page's time).
    labels = {ln.series.index: esc(ln.series.label) for ln in lines}
    for i, b in enumerate(order):
        found = [bins[b][k] for k in sorted(bins[b])]
        steps = sorted({p.step for _, p, _ in found})
        head = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}–{steps[-1]}"
        said = "\n".join(labels[s.index] + _tip(p, v, fmt, timed, band, smoothed) for s, p, v in found)
        out.append(f'<rect class="hover" x="{edges[i]:.1f}" y="{TOP}" width="{max(edges[i + 1] - edges[i], 1.0):.1f}" '
                   f'height="{H - TOP - BOTTOM}" fill="#000" fill-opacity="0"><title>{esc(head)}\n{said}</title></rect>')
    return "".join(out)


def _legend(drawn: Sequence[Series]) -> str:
    """Each run's line sample (colour and dash) and name, in the right margin where ui_charts puts its keys."""
    out = []
    for i, s in enumerate(drawn):
        colour, dash = style(s.index)
        py = TOP + 16 * i
        out.append(f'<g class="key" data-run="{esc(s.run)}"><line x1="{W - RIGHT + 10}" y1="{py + 5}" '
                   f'x2="{W - RIGHT + 36}" y2="{py + 5}" stroke="{colour}" stroke-width="2"'
                   + (f' stroke-dasharray="{dash}"' if dash else "")
                   + f'/><text x="{W - RIGHT + 40}" y="{py + 9}">{esc(s.label[:20])}</text></g>')
    return "".join(out)
