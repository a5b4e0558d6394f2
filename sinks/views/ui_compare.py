"""The compare page of ``rlpulse ui``: up to eight runs overlaid on one axis, and the configuration keys that differ.

Every choice is a URL parameter, so a view is a link to share:

* ``run=PROJECT/RUN[/ATTEMPT]``, repeated, 1 to ``MAX_RUNS``: each part percent-encoded (an id may hold ``/``);
  without an attempt, the run's latest. The runs page's checkboxes submit these;
* ``x=step`` (default) or ``x=time``: minutes since each run's first STEP event, so runs started hours apart
  still start at 0 (a step that has no STEP event yet has no time, and is left out of that axis);
* ``smooth=W``: TensorBoard's EMA with weight 0 <= W < 1 on every line (0 or absent: none);
* ``from`` / ``to``: the steps shown; ``metric=NAME`` (repeatable): trainer scalars to draw;
* ``config=all``: every configuration key, not only the keys that differ.

The figures come from ``rlpulse.sinks.views.compare_data`` (one query per figure over every run, as the saved
queries compute them); the charts from ``rlpulse.sinks.views.overlay_charts``. A chart no run has a point of is
left out rather than drawn empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views import compare_data as cd
from rlpulse.sinks.views import overlay_charts as oc
from rlpulse.sinks.views.ui_data import has_tables
from rlpulse.sinks.views.ui_html import fmt_count, fmt_number, fmt_rate, fmt_ratio, href, table, text
from rlpulse.sinks.views.ui_pages import NotFound
from rlpulse.sinks.views.ui_params import (INT_MAX, MAX_VALUE, BadParameter, Page, Query, choice, decimal, integer, one,
                                          parse_run, run_param)

MAX_TERMS = 8  # failure-rate charts at most (one per grader term); more are said, not drawn
XS = ("step", "time")


def smoothing(query: Query) -> float:
    """``smooth``: an EMA weight from 0 to below 1 (1 would freeze every line at its first value)."""
    weight = decimal(query, "smooth")
    if weight is None:
        return 0.0
    if not 0.0 <= weight < 1.0:
        raise BadParameter(f"smooth: expected an EMA weight from 0 to below 1 (0.6 smooths as TensorBoard's default), "
                           f"got {one(query, 'smooth')!r}")
    return weight


@dataclass
class CompareView:
    wanted: list[tuple[str, str, int | None]]  # as the URL names them, in its order (no repeats)
    x: str = "step"
    smooth: float = 0.0
    lo: int | None = None
    hi: int | None = None
    metrics: list[str] = field(default_factory=list)
    all_config: bool = False

    def params(self, runs: list[tuple[str, str, int | None]] | None = None, **change: object) -> list[tuple[str, object]]:
        """This view's URL parameters (other runs with ``runs``, a parameter changed with ``change``)."""
        out: dict[str, object] = {"x": None if self.x == "step" else self.x, "smooth": self.smooth or None,
                                  "from": self.lo, "to": self.hi, "config": "all" if self.all_config else None}
        out.update(change)
        return ([("run", run_param(w)) for w in (self.wanted if runs is None else runs)] + list(out.items())
                + [("metric", m) for m in self.metrics])


def parse(query: Query) -> CompareView:
    """The view the URL asks for; BadParameter (400) for a value that does not parse or too many runs."""
    wanted: list[tuple[str, str, int | None]] = []
    for value in query.get("run", []):
        if len(value) > MAX_VALUE:
            raise BadParameter(f"run: at most {MAX_VALUE} characters")
        parsed = parse_run(value)
        if parsed not in wanted:
            wanted.append(parsed)
    if len(wanted) > cd.MAX_RUNS:
        raise BadParameter(f"run: at most {cd.MAX_RUNS} runs can be compared at once (eight colours and dash patterns "
                           f"tell them apart); the URL names {len(wanted)}")
    return CompareView(wanted, choice(query, "x", XS), smoothing(query), integer(query, "from", low=-INT_MAX),
                       integer(query, "to", low=-INT_MAX), [m for m in query.get("metric", []) if m and len(m) <= MAX_VALUE],
                       choice(query, "config", ("", "all")) == "all")


def compare_page(store: Store, query: Query, now_ns: int) -> Page:
    view = parse(query)
    crumbs: list[tuple[str, str | None]] = [("Runs", href("/")), ("compare", None)]
    if not view.wanted:
        return "Compare runs", crumbs, (
            f'<p class="muted no-runs">No runs chosen. Tick up to {cd.MAX_RUNS} runs on the <a href="{href("/")}">runs '
            "page</a> and press “compare”, or name them in the URL: "
            "<code>/compare?run=PROJECT/RUN/ATTEMPT&amp;run=…</code>.</p>")
    if not has_tables(store):
        raise NotFound("the store has no rlpulse tables yet: nothing has reached it")
    keys, missing, named = cd.resolve(store, view.wanted)
    if missing:
        raise NotFound("not in the store: run " + "; run ".join(missing))
    d = cd.compare_data(store, keys, view.lo, view.hi, view.metrics)
    projects = {k[0] for k in keys}
    labels = {k: (f"{k[0]}/" if len(projects) > 1 else "") + f"{k[1]} #{k[2]}" for k in keys}
    body = (_runs_table(view, keys, named, labels, d) + _form(view, d) + _charts(view, keys, labels, d)
            + _config_table(view, keys, labels, d.config))
    return f"Compare {len(keys)} run{'s' if len(keys) > 1 else ''}", crumbs, f'<div class="compare">{body}</div>'


def _runs_table(view: CompareView, keys: list[cd.Key], named: dict[cd.Key, list[tuple[str, str, int | None]]],
                labels: dict[cd.Key, str], d: cd.CompareData) -> str:
    """The legend: each run's line sample (colour and dash), name, links to its page, its search, and this view
    without it (without every entry of the URL that names it)."""
    rows = []
    for i, k in enumerate(keys):
        at = [("project", k[0]), ("run", k[1]), ("attempt", k[2])]
        others = [w for w in view.wanted if w not in named.get(k, [])]
        steps = len(set(d.reward_mean.get(k, {})) | set(d.minutes.get(k, {})))
        config = "" if d.config is None or d.config.get(k) else '<span class="muted">no configuration recorded</span>'
        rows.append(f'<tr class="compared" data-run="{text(run_param(k))}" data-index="{i}"><td>{oc.swatch(i)}</td>'
                    f'<td class="label"><a href="{href("/run", at)}">{text(labels[k])}</a></td><td>{text(k[0])}</td>'
                    f'<td class="run-id">{text(k[1])}</td><td class="n">{k[2]}</td><td class="n steps">{steps}</td>'
                    f"<td>{config}</td><td><a class=\"search\" href=\"{href('/search', at)}\">search</a>"
                    + (f' · <a class="remove" href="{href("/compare", view.params(others))}">remove</a>' if others else "")
                    + "</td></tr>")
    return table(("", "run", "project", "run id", "attempt", "steps shown", "", ""), "".join(rows), "compare-runs")


def _form(view: CompareView, d: cd.CompareData) -> str:
    hidden = "".join(f'<input type="hidden" name="run" value="{text(run_param(w))}">' for w in view.wanted)
    xs = "".join(f'<option value="{x}"{" selected" if x == view.x else ""}>{label}</option>'
                 for x, label in (("step", "step"), ("time", "time (minutes)")))
    names = sorted({n for ns in d.metric_names.values() for n in ns})
    boxes = "".join(f'<label><input type="checkbox" name="metric" value="{text(n)}"{" checked" if n in d.chosen else ""}>'
                    f"{text(n)}</label>" for n in names[:200])

    def number(name: str, value: int | None) -> str:
        return f'<input type="number" name="{name}" value="{"" if value is None else value}">'

    return (f'<form class="filters compare-options" method="get" action="/compare">{hidden}'
            f'<label>x axis <select name="x">{xs}</select></label>'
            f'<label>smoothing (EMA weight, 0 = none) <input type="number" name="smooth" min="0" max="0.99" step="0.05" '
            f'value="{view.smooth:g}"></label>'
            f"<label>steps from {number('from', view.lo)}</label><label>to {number('to', view.hi)}</label>"
            + (f'<span class="muted">trainer scalars (up to {cd.METRIC_CHARTS}):</span>{boxes}' if names else "")
            + f'<label><input type="checkbox" name="config" value="all"{" checked" if view.all_config else ""}> every '
            "configuration key</label><button>show</button></form>")


def _charts(view: CompareView, keys: list[cd.Key], labels: dict[cd.Key, str], d: cd.CompareData) -> str:
    timed = view.x == "time"
    untimed = 0  # points of steps with no STEP event yet: no place on the time axis

    def place(k: cd.Key, step: int) -> float | None:
        return float(step) if not timed else d.minutes.get(k, {}).get(step)

    def lines(per_run: dict[cd.Key, cd.PerStep]) -> list[oc.Series]:
        nonlocal untimed
        out = []
        for i, k in enumerate(keys):
            pts = []
            for step, v in sorted(per_run.get(k, {}).items()):
                at = place(k, step)
                if at is None:
                    untimed += 1
                else:
                    pts.append(oc.Point(step, at, v))
            out.append(oc.Series(i, run_param(k), labels[k], pts))
        return out

    def spreads(per_run: dict[cd.Key, cd.Spread]) -> list[oc.Series]:
        mids = lines({k: {s: q[1] for s, q in v.items()} for k, v in per_run.items()})
        for s, k in zip(mids, keys):
            for p in s.points:
                p.lo, _, p.hi = per_run[k][p.step]
        return mids

    terms = list(d.failure_rate)[:MAX_TERMS]
    figures = [  # (name, title, series, how values read, y range)
        ("reward-mean", "Reward mean per step", lines(d.reward_mean), fmt_number, None),
        ("reward-p50", "Reward p50 per step (band: p10 to p90, from the histogram)", spreads(d.reward), fmt_number, None),
        ("clipped-ratio", "Clipped ratio per step (completions cut at max tokens)", lines(d.clipped_ratio), fmt_ratio,
         (0.0, 1.0)),
        *((f"failure-rate-{t}", f"Grader failure rate per step: term {t}", lines(d.failure_rate[t]), fmt_ratio, (0.0, 1.0))
          for t in terms),
        ("completion-length", "Completion length per step, tokens: p50 (band: p10 to p90)", spreads(d.lengths),
         fmt_count, None),
        ("tokens-per-s", "Throughput per step: tokens/s", lines(d.tokens_per_s), fmt_rate, None),
        ("mfu", "MFU per step: model FLOPs utilization (0..1)", lines(d.mfu), fmt_ratio, (0.0, 1.0)),
        *((f"metric-{n}", f"Trainer scalar {n}", lines(d.metrics.get(n, {})), fmt_number, None) for n in d.chosen),
    ]
    xs = [p.x for _, _, series, _, _ in figures for s in series for p in s.points]
    axis_type = oc.TimeAxis if timed else oc.Axis
    axis = axis_type(min(xs), max(xs)) if xs else oc.Axis(0.0, 1.0)
    drawn = [oc.overlay(name, title, axis, series, fmt, view.smooth, y_range)
             for name, title, series, fmt, y_range in figures]
    drawn = [svg for svg in drawn if svg]
    notes = []
    if len(d.failure_rate) > MAX_TERMS:
        notes.append(f"{len(d.failure_rate) - MAX_TERMS} more grader terms are not drawn (the first {MAX_TERMS} by name are).")
    if timed and untimed:
        notes.append(f"{untimed} points of steps without a STEP event yet have no time and are left out of this axis.")
    if not drawn:
        where = "" if view.lo is None and view.hi is None else " in this step range"
        return oc.no_data("compare", "Per-step figures", axis, f"none of these runs has per-step figures{where}")
    return ("<h2>Per step</h2>" + "".join(f'<p class="muted note">{text(n)}</p>' for n in notes)
            + '<div class="compare-charts">' + "".join(drawn) + "</div>")


def _config_table(view: CompareView, keys: list[cd.Key], labels: dict[cd.Key, str],
                  config: dict[cd.Key, dict[str, str]] | None) -> str:
    """The configuration keys whose values differ (run-config's rows), one column per run; every key with
    ``config=all``. A run that sent no configuration is said so in its column and takes no part in what differs."""
    if config is None:
        return ('<h2>Configuration</h2><p class="muted">The store predates run configurations (its steps table has '
                "no config column: run <code>rlpulse migrate</code>).</p>")
    differ = cd.differing(config)
    sent = [k for k in keys if config.get(k)]
    shown = sorted({key for k in sent for key in config[k]}) if view.all_config else differ
    toggle = href("/compare", view.params(config=None if view.all_config else "all"))
    switch = (f'<a class="config-toggle" href="{toggle}">'
              + ("only the keys that differ" if view.all_config else "every key") + "</a>")
    if not sent:
        return '<h2>Configuration</h2><p class="muted no-config">None of these runs sent a configuration.</p>'
    if len(sent) == 1 and not view.all_config:
        say = f"Only {text(labels[sent[0]])} sent a configuration: there is nothing to compare it with ({switch})."
        return f'<h2>Configuration</h2><p class="muted one-config">{say}</p>'
    head = "<th>key</th>" + "".join(f'<th data-run="{text(run_param(k))}">{oc.swatch(i)} {text(labels[k])}'
                                    + ("" if config.get(k) else ' <span class="muted">(no configuration recorded)</span>')
                                    + "</th>" for i, k in enumerate(keys))
    rows = []
    for key in shown:
        cells = []
        for k in keys:
            settings = config.get(k) or {}
            if not settings:
                cells.append(f'<td class="none" data-run="{text(run_param(k))}">–</td>')
            elif key in settings:
                cells.append(f'<td class="set" data-run="{text(run_param(k))}">{text(settings[key])}</td>')
            else:
                cells.append(f'<td class="unset muted" data-run="{text(run_param(k))}">not set</td>')
        rows.append(f'<tr class="config-key {"differs" if key in differ else "same"}" data-key="{text(key)}">'
                    f'<th>{text(key)}</th>{"".join(cells)}</tr>')
    said = (f"{len(differ)} of {len({key for k in sent for key in config[k]})} keys differ between the runs that sent "
            f"a configuration")
    return (f'<h2>Configuration</h2><p class="muted config-summary" data-differing="{len(differ)}">{said} ({switch}).</p>'
            + (f'<table class="grid config-diff"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
               if rows else ""))
