"""How ``rlpulse watch`` lays a snapshot out on the terminal's width, the way htop and nvidia-smi do.

Each table has essential columns, always shown, and optional ones, added in priority order while
they fit; a heading is never cut. A name too long for its column is cut in the middle, keeping
its start and its distinctive end (``demo-20261…-run1``); a GPU id keeps its end, as nvidia-smi's
short bus ids. Numbers have a fixed number of decimals per column and are right-aligned.

The frame lays itself out when rich draws it, on the width rich gives it (``console.width`` at
the top level), so the live view follows a resized terminal and a test can draw one snapshot at
several widths.

Run table: RUN STATE STEP STEPS/MIN REWARD CLIPPED FAIL always; then, as width allows, ALERTS,
TOK/S (the latest step's tokens/s), LAST, ATT, GPUS and PROJECT (shown in that order: RUN ATT STATE ...
FAIL TOK/S GPUS ALERTS LAST PROJECT).
The run column holds the run id; the project is a column when it fits whole, else a section row
heads each project's runs (grouped in the order of their most urgent run); with a single project
the header names it instead. GPU table: RUN GPU UTIL POWER MEM; then SAMPLE (age) and HOST
(its project is in the run table). Open alerts: RULE KEY SEVERITY FOR; then SUMMARY (cut at its end).
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.table import Table
from rich.text import Text

from rlpulse.base.terminal import terminal_safe
from rlpulse.sinks.views.watch_data import NS, RunLine, WatchSnapshot

STATE_STYLES = {"RUNNING": "green", "STALLED": "bold yellow", "SILENT": "bold red", "ENDED": "dim", "FINISHED": "dim",
                "FAILED": "bold red", "CANCELLED": "yellow"}


def state_text(run: RunLine) -> Text:
    """RUNNING, STALLED, SILENT; an ended run as its RUN_END status (ENDED when its SDK sent none)."""
    shown = run.end_status.upper() if run.state == "ENDED" and run.end_status else run.state
    return Text(shown, style=STATE_STYLES.get(shown, "dim"))
GAP = 2  # between two columns: box=None, padding (0, 1), no padding at the table's edges


def age(ns: int) -> str:
    """A duration as ``4s``, ``2m05s``, ``1h03m``."""
    s = max(0, int(ns // NS))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def cut_middle(text: str, width: int) -> str:
    """``text`` in ``width`` characters: its start, "…", its end. The end is cut at a separator
    (- _ / . : @): the longest such end in half the room, else the last part whole when 3 characters
    of start are left; runs of one project differ at their end (``demo-20261203-150728-run1``)."""
    if len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    room = width - 1
    ends = [len(text) - m.start() for m in re.finditer(r"[-_/.:@]", text)]
    halves = [n for n in ends if n <= room // 2]
    tail = max(halves) if halves else min(ends) if ends and min(ends) <= room - 3 else room // 2
    return text[:room - tail] + "…" + (text[-tail:] if tail else "")


def cut_start(text: str, width: int) -> str:
    """The end of ``text`` in ``width`` characters: a GPU UUID differs in its last characters."""
    return text if len(text) <= width else "…" + text[len(text) - width + 1:] if width > 1 else "…"[:width]


def cut_end(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…" if width > 1 else "…"[:width]


CUTS = {"middle": cut_middle, "start": cut_start, "end": cut_end}


@dataclass
class Col:
    name: str
    cells: list[Text]
    right: bool = False
    priority: int = 0  # 0: essential, always shown; optional ones are added lowest number first
    cut: str | None = None  # a key of CUTS: the column may be narrower than its cells
    floor: int = 0  # a cut column's width while the optional columns are placed (it grows after)
    width: int = field(default=0, init=False)

    @property
    def natural(self) -> int:
        return max([len(self.name)] + [len(c.plain) for c in self.cells])

    def cell(self, i: int) -> Text:
        text = self.cells[i]
        if len(text.plain) <= self.width or not self.cut:
            return text
        return Text(CUTS[self.cut](text.plain, self.width), style=text.style)


def _span(cols: list[Col]) -> int:
    return sum(c.width for c in cols) + GAP * max(0, len(cols) - 1)


def layout(cols: list[Col], width: int) -> list[Col]:
    """The columns shown in ``width`` characters (in their order), each with its width set."""
    for c in cols:
        c.width = min(c.natural, max(len(c.name), c.floor)) if c.cut else c.natural
    shown = [c for c in cols if not c.priority]
    for c in sorted((c for c in cols if c.priority), key=lambda c: c.priority):
        if _span(shown + [c]) <= width:
            shown.append(c)
    shown.sort(key=cols.index)
    spare = width - _span(shown)
    for c in shown:  # the room left widens the cut columns, first ones first
        if c.cut and spare != 0:
            # narrower than the essential columns: cut columns shrink, down to their heading
            delta = min(spare, c.natural - c.width) if spare > 0 else -min(-spare, c.width - len(c.name))
            c.width += delta
            spare -= delta
    return shown


def grid(shown: list[Col], rows: list[int | Text], styles: list[str | None], title: str | None = None) -> Table:
    """A table of the shown columns: ``rows`` are indexes into their cells, or a section heading
    (a Text put in the first column, cut to it)."""
    table = Table(box=None, header_style="bold", pad_edge=False, title=title, title_justify="left",
                  title_style="bold")
    for c in shown:
        table.add_column(c.name, justify="right" if c.right else "left", no_wrap=True, width=c.width,
                         min_width=len(c.name))
    for row in rows:
        if isinstance(row, Text):
            head = Text(cut_middle(row.plain, shown[0].width), style=row.style)
            table.add_row(head, *([""] * (len(shown) - 1)))
        else:
            table.add_row(*(c.cell(row) for c in shown), style=styles[row])
    return table


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _texts(values) -> list[Text]:
    return [v if isinstance(v, Text) else Text(v) for v in values]


def _projects(snap: WatchSnapshot) -> list[str]:
    return list(dict.fromkeys(r.project for r in snap.runs))


def runs_table(snap: WatchSnapshot, width: int) -> Table:
    runs = snap.runs
    several = len(_projects(snap)) > 1
    cols = [
        Col("RUN", _texts(r.run_id for r in runs), cut="middle", floor=32),
        Col("ATT", _texts(str(r.attempt) for r in runs), right=True, priority=4),
        Col("STATE", [state_text(r) for r in runs]),
        Col("STEP", _texts("-" if r.step is None else str(r.step) for r in runs), right=True),
        Col("STEPS/MIN", _texts(_num(r.steps_per_min, ".1f") for r in runs), right=True),
        Col("REWARD", _texts(_num(r.reward_mean, ".3f") for r in runs), right=True),
        Col("CLIPPED", _texts(_num(r.clipped_ratio, ".1%") for r in runs), right=True),
        Col("FAIL", _texts(_num(r.failure_rate, ".1%") for r in runs), right=True),
        Col("TOK/S", _texts(_num(r.tokens_per_s, ".0f") for r in runs), right=True, priority=2),
        Col("GPUS", _texts(str(len(r.gpus)) for r in runs), right=True, priority=5),
        Col("ALERTS", [Text(str(len(r.alerts)), style="bold red" if r.alerts else "") for r in runs], right=True,
            priority=1),
        Col("LAST", _texts(age(snap.now_ns - r.last_ns) for r in runs), right=True, priority=3),
    ]
    # the trainer scalars the user chose: as essential as the figures beside them (after FAIL and TOK/S)
    cols[9:9] = [Col(terminal_safe(name).upper(), _texts(_num(r.metrics.get(name), ".4g") for r in runs), right=True, cut="end")
                 for name in snap.metric_names]
    if several:
        cols.append(Col("PROJECT", _texts(r.project for r in runs), priority=6))  # whole, or section rows
    shown = layout(cols, width)
    styles = ["dim" if r.state == "ENDED" else None for r in runs]
    rows: list[int | Text] = list(range(len(runs)))
    if several and shown[-1].name != "PROJECT":  # no room for the column: a heading per project
        rows = []
        for project in _projects(snap):
            rows.append(Text(project, style="bold underline"))
            rows += [i for i, r in enumerate(runs) if r.project == project]
    return grid(shown, rows, styles)


def gpus_table(snap: WatchSnapshot, width: int) -> Table | None:
    pairs = [(r, g) for r in snap.runs for g in r.gpus]
    if not pairs:
        return None

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v * 100:.0f}%"

    cols = [
        Col("RUN", _texts(r.run_id for r, _ in pairs), cut="middle", floor=32),
        Col("GPU", _texts(g.hw_id for _, g in pairs), cut="start", floor=13),
        Col("HOST", _texts(g.host + ("" if g.index is None else f" #{g.index}") for _, g in pairs), priority=2,
            cut="middle", floor=16),
        Col("UTIL", _texts(pct(g.utilization if g.sample_ns is not None else None) for _, g in pairs), right=True),
        Col("POWER", _texts("-" if g.sample_ns is None or g.power_w is None else f"{g.power_w:.0f} W"
                            for _, g in pairs), right=True),
        Col("MEM", _texts(pct(g.memory if g.sample_ns is not None else None) for _, g in pairs), right=True),
        Col("SAMPLE", _texts("no sample" if g.sample_ns is None else f"{age(snap.now_ns - g.sample_ns)} ago"
                             for _, g in pairs), right=True, priority=1),
    ]
    styles = ["dim" if r.state == "ENDED" else None for r, _ in pairs]
    return grid(layout(cols, width), list(range(len(pairs))), styles, title="GPUs")


def alerts_table(snap: WatchSnapshot, width: int) -> Table | None:
    unique = {(a.rule, a.key): a for r in snap.runs for a in r.alerts}  # a GPU's alert can be on two runs
    alerts = sorted(unique.values(), key=lambda a: (a.since_ns, a.rule, a.key))
    if not alerts:
        return None
    cols = [
        Col("RULE", [Text(a.rule, style="red") for a in alerts], cut="middle", floor=24),
        Col("KEY", _texts(a.key for a in alerts), cut="middle", floor=24),
        Col("SEVERITY", _texts(a.severity for a in alerts)),
        Col("FOR", _texts(age(snap.now_ns - a.since_ns) for a in alerts), right=True),
        Col("SUMMARY", _texts(a.summary for a in alerts), priority=1, cut="end", floor=30),
    ]
    return grid(layout(cols, width), list(range(len(alerts))), [None] * len(alerts), title="Open alerts")


def header(snap: WatchSnapshot, note: str = "") -> Text:
    """Three short lines (a long URL wraps on its own line): the clock, the store, the counts."""
    clock = time.strftime("%H:%M:%S UTC", time.gmtime(snap.now_ns / NS))
    counts: dict[str, int] = {}
    for r in snap.runs:
        counts[r.state] = counts.get(r.state, 0) + 1
    summary = ", ".join(f"{n} {s.lower()}" for s, n in counts.items())
    via = f" (through the sink's read endpoint {snap.endpoint})" if snap.endpoint else ""
    text = Text("rlpulse watch", style="bold")
    text.append(f"  {clock}")
    if note:
        text.append(f"  {note}", style="dim")
    text.append(f"\n{snap.url}{via}  database {snap.database}")
    text.append(f"\n{len(snap.runs)} runs" + (f" ({summary})" if summary else ""), style="bold")
    projects = _projects(snap)
    project = snap.project or (projects[0] if len(projects) == 1 else None)
    if project:
        text.append(f"  project {project}")
    return text


def neutralised(value: Any) -> Any:
    """``value`` (a snapshot, its runs, GPUs and alerts) with every string made terminal-safe.

    Run ids, projects, hosts, GPU ids, alert keys and summaries come from topics anyone can write
    to. rich prints a Text's characters as they are (it drops only a few C0 controls), so an escape
    sequence in a run id would drive the terminal, and a newline would break the table's rows.
    Done once on the whole snapshot before the layout: every column, heading and width sees the
    escaped text, and a column added later is covered without thinking of it."""
    if isinstance(value, str):
        return terminal_safe(value)
    if isinstance(value, list):
        return [neutralised(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: neutralised(getattr(value, f.name))
                                             for f in dataclasses.fields(value) if f.init})
    return value


class Frame:
    """One frame of the view, laid out on the width rich draws it in."""

    def __init__(self, snap: WatchSnapshot, note: str = "", error: str | None = None):
        # The error quotes an exception about the store, which may carry a value read from it.
        self.snap, self.note = neutralised(snap), note
        self.error = None if error is None else terminal_safe(error)

    def parts(self, width: int) -> list[RenderableType]:
        snap = self.snap
        parts: list[RenderableType] = [header(snap, self.note)]
        if self.error:
            parts.append(Text(self.error, style="bold red"))
        if not snap.runs:
            if snap.any_runs:
                scope = "" if snap.show_all else \
                    f" in the last {age(int(snap.recent_s * NS))}; `rlpulse watch --all` shows every run"
                parts.append(Text(f"no active runs in {snap.database}{scope}", style="yellow"))
            else:
                parts.append(Text(f"no runs yet in {snap.database} — start a job or `rlpulse demo`", style="yellow"))
            return parts
        parts.append(runs_table(snap, width))
        for table in (gpus_table(snap, width), alerts_table(snap, width)):
            if table is not None:
                parts += [Text(), table]
        return parts

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Group(*self.parts(options.max_width))


def render(snap: WatchSnapshot, note: str = "", error: str | None = None) -> RenderableType:
    """The frame: a header, one line per run, then the runs' GPUs and open alerts."""
    return Frame(snap, note, error)
