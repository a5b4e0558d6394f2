"""Charts of a run's page in ``rlpulse ui``: inline SVG drawn here, on one shared step axis.

Server-side SVG needs no script and loads nothing (the page's Content-Security-Policy forbids
both), and every chart of a run spans the same steps at the same pixels, so a reward drop lines
up with the clipped ratio, the failures, the GPU dip and the alert above it. Times (GPU samples,
alerts) are placed on that axis between the STEP events around them (``rlpulse.sinks.views.ui_data.step_at``).
The static report keeps its own charts (``rlpulse.sinks.views.html_report``): one per figure, each on its own axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlpulse.sinks.views.ui_html import text as esc  # store values: HTML-escaped, controls visible
from rlpulse.sinks.views.html_report import PALETTE, STATE_COLOURS, nice_ticks

W, H = 1000, 200
LEFT, RIGHT, TOP, BOTTOM = 64, 170, 30, 30
DOTS_UP_TO = 150  # points per series drawn as dots too; a denser line reads better without
HEAT_BINS = 250  # a heatmap of more steps merges consecutive steps into this many columns (counts summed)


@dataclass(frozen=True)
class Axis:
    lo: float
    hi: float

    def x(self, step: float) -> float:
        """The pixel of a step: the middle of its slot (a bar or heatmap column fills the slot)."""
        return LEFT + (step - self.lo + 0.5) * self.slot()

    def slot(self) -> float:
        """Pixels of one step."""
        return (W - LEFT - RIGHT) / ((self.hi - self.lo) + 1)


def _y(lo: float, hi: float, h: int):
    span = (hi - lo) or 1.0
    return lambda v: h - BOTTOM - (v - lo) / span * (h - TOP - BOTTOM)


def frame(name: str, title: str, axis: Axis, body: str, h: int = H, y_ticks: Sequence[tuple[float, str]] = (),
          legend: Sequence[tuple[str, str]] = ()) -> str:
    """An <svg data-chart=name>: title, step axis, y ticks (pixels, label), legend, body."""
    x_ticks = "".join(f'<line x1="{axis.x(s):.1f}" y1="{h - BOTTOM}" x2="{axis.x(s):.1f}" y2="{h - BOTTOM + 4}" '
                      f'stroke="#333"/><text x="{axis.x(s):.1f}" y="{h - BOTTOM + 16}" text-anchor="middle">{s:g}</text>'
                      for s in nice_ticks(axis.lo, axis.hi, 8) if float(s).is_integer())
    grid = "".join(f'<line x1="{LEFT}" y1="{py:.1f}" x2="{W - RIGHT}" y2="{py:.1f}" stroke="#eee"/>'
                   f'<text x="{LEFT - 6}" y="{py + 4:.1f}" text-anchor="end">{esc(label)}</text>' for py, label in y_ticks)
    keys = "".join(f'<rect x="{W - RIGHT + 14}" y="{TOP + 16 * i}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="{W - RIGHT + 29}" y="{TOP + 16 * i + 9}">{esc(label[:22])}</text>'
                   for i, (label, colour) in enumerate(legend[:12]))
    return (f'<svg class="chart" data-chart="{esc(name)}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {h}" '
            f'font-family="sans-serif" font-size="11" role="img" aria-label="{esc(title)}">'
            f'<text x="{LEFT}" y="18" font-size="13" font-weight="bold">{esc(title)}</text>{grid}'
            f'<line x1="{LEFT}" y1="{h - BOTTOM}" x2="{W - RIGHT}" y2="{h - BOTTOM}" stroke="#333"/>'
            f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{h - BOTTOM}" stroke="#333"/>{x_ticks}{body}{keys}</svg>')


def no_data(name: str, title: str, axis: Axis, why: str = "no data") -> str:
    """A short frame saying so (no axis to read)."""
    return (f'<svg class="chart empty" data-chart="{esc(name)}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} 44" '
            f'font-family="sans-serif" font-size="11"><text x="{LEFT}" y="18" font-size="13" font-weight="bold">{esc(title)}'
            f'</text><text class="no-data" x="{LEFT}" y="36" fill="#888">{esc(why)}</text></svg>')


def lines(name: str, title: str, axis: Axis, series: dict[str, list[tuple[float, float]]],
          bands: dict[str, list[tuple[float, float, float]]] | None = None, y_range: tuple[float, float] | None = None,
          unit: str = "") -> str:
    """One <polyline class="series" data-series> per series, a shaded band (lo..hi) per band."""
    bands = bands or {}
    values = [y for pts in series.values() for _, y in pts] + [v for b in bands.values() for _, lo, hi in b for v in (lo, hi)]
    if not values:
        return no_data(name, title, axis)
    lo, hi = y_range or (min(0.0, min(values)), max(values) if max(values) > min(0.0, min(values)) else 1.0)
    y = _y(lo, hi, H)
    body, legend = [], []
    for i, (label, pts) in enumerate(bands.items()):
        colour = PALETTE[i % len(PALETTE)]
        upper = " ".join(f"{axis.x(s):.1f},{y(b):.1f}" for s, _, b in pts)
        lower = " ".join(f"{axis.x(s):.1f},{y(a):.1f}" for s, a, _ in reversed(pts))
        body.append(f'<polygon class="band" data-series="{esc(label)}" points="{upper} {lower}" fill="{colour}" '
                    f'fill-opacity="0.15" stroke="none"/>')
    for i, (label, line) in enumerate(series.items()):
        colour = PALETTE[i % len(PALETTE)]
        legend.append((label, colour))
        coords = " ".join(f"{axis.x(s):.1f},{y(v):.1f}" for s, v in line)
        body.append(f'<polyline class="series" data-series="{esc(label)}" data-points="{len(line)}" points="{coords}" '
                    f'fill="none" stroke="{colour}" stroke-width="1.5"/>')
        if len(line) <= DOTS_UP_TO:
            body.extend(f'<circle cx="{axis.x(s):.1f}" cy="{y(v):.1f}" r="2.2" fill="{colour}">'
                        f"<title>{esc(label)} at step {s:g}: {v:g}{esc(unit)}</title></circle>" for s, v in line)
    ticks = [(y(v), f"{v:g}") for v in nice_ticks(lo, hi, 5)]
    return frame(name, title, axis, "".join(body), y_ticks=ticks, legend=legend)


def bars(name: str, title: str, axis: Axis, per_step: dict[int, dict[str, float]]) -> str:
    """A stacked bar per step, one <rect class="segment"> per non-zero category, at the step's place; more than
    HEAT_BINS steps are added up in HEAT_BINS bars of consecutive steps, said in the title."""
    if not per_step:
        return no_data(name, title, axis)
    cats = sorted({c for parts in per_step.values() for c in parts})
    colours = {c: PALETTE[i % len(PALETTE)] for i, c in enumerate(cats)}
    steps = sorted(per_step)
    size = max(1, -(-len(steps) // HEAT_BINS))
    columns = [(chunk[0], chunk[-1], {c: sum(per_step[s].get(c, 0) for s in chunk) for c in cats})
               for chunk in (steps[i:i + size] for i in range(0, len(steps), size))]
    top = max(sum(parts.values()) for _, _, parts in columns) or 1
    y = _y(0, top, H)
    body = []
    for first, last, parts in columns:
        x0, x1 = axis.x(first) - axis.slot() * 0.4, axis.x(last) + axis.slot() * 0.4
        width = max(x1 - x0, 1.0)
        where = f"step {first}" if first == last else f"steps {first}-{last}"
        base = 0.0
        for cat in cats:
            v = parts.get(cat, 0)
            if v:
                body.append(f'<rect class="segment" x="{x0:.1f}" y="{y(base + v):.1f}" width="{width:.1f}" '
                            f'height="{y(base) - y(base + v):.1f}" fill="{colours[cat]}"><title>{where} {esc(cat)}: {v:g}'
                            "</title></rect>")
                base += v
    ticks = [(y(v), f"{v:g}") for v in nice_ticks(0, top, 5)]
    shown = title + (f" (every {size} steps added up)" if size > 1 else "")
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
        x0, x1 = axis.x(first) - axis.slot() / 2, axis.x(last) + axis.slot() / 2
        for b, n in enumerate(counts):
            if n:
                t = n / top
                fill = f"rgb({int(235 - 227 * t)},{int(245 - 197 * t)},{int(255 - 148 * t)})"
                where = f"step {first}" if first == last else f"steps {first}-{last}"
                cells.append(f'<rect class="cell" x="{x0:.1f}" y="{h - BOTTOM - (b + 1) * ch:.1f}" width="{x1 - x0:.1f}" '
                             f'height="{ch:.1f}" fill="{fill}"><title>{where}, reward {esc(labels[b])}: {n}</title></rect>')
    ticks = [(h - BOTTOM - (b + 0.5) * ch, lab) for b, lab in enumerate(labels) if b % 2 == 0 or len(labels) < 9]
    shown = title + (f" (every {size} steps merged)" if size > 1 else "")
    legend = [("few rollouts", "rgb(235,245,255)"), (f"{top} (most)", "rgb(8,48,107)")]
    return frame(name, shown, axis, "".join(cells), h=h, y_ticks=ticks, legend=legend)


def alert_lanes(name: str, title: str, axis: Axis, events: Sequence[tuple[float, str, str, str]]) -> str:
    """events: (step position, rule, state, tip). A lane per rule; a red circle fires, a green square resolves."""
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
