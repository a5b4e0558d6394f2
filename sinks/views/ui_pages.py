"""A run's page of ``rlpulse ui`` (the runs page: ``ui_runs``; a step's and a trajectory's: ``ui_detail``).

Each function takes the store and the page's parameters (already parsed from the URL by
``rlpulse.sinks.views.ui_server``) and returns the page's body; every link carries the parameters of the
view it opens, so any page is a URL that can be shared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlpulse.sinks.views import ui_charts as charts
from rlpulse.sinks.views import ui_data as data
from rlpulse.sinks.views import run_metrics_data as metrics_data
from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views.html_escape import esc
from rlpulse.sinks.views.step_figures import gpu_time, out_of_range_note, summarize, summary_figures
from rlpulse.sinks.views import term_figures
from rlpulse.sinks.views.ui_html import (fmt_count, fmt_duration, fmt_number, fmt_rate, fmt_ratio, href, num, table, text,
                                         when)
from rlpulse.sinks.views.ui_params import run_param
from rlpulse.base.errors import Error

STEPS_PER_PAGE = 50


class NotFound(Error, ValueError):
    """A run, step or trajectory the store has no rows of (answered 404)."""


# -- a run ---------------------------------------------------------------------------------------

@dataclass
class RunView:
    project: str
    run: str
    attempt: int | None
    lo: int | None = None  # step range of the charts
    hi: int | None = None
    metrics: list[str] = field(default_factory=list)
    page: int = 1

    def params(self, page: int | None = None) -> list[tuple[str, object]]:
        """This view's URL parameters (another page of its steps table with ``page``)."""
        at = self.page if page is None else page
        out: list[tuple[str, object]] = [("project", self.project), ("run", self.run), ("attempt", self.attempt),
                                          ("from", self.lo), ("to", self.hi)]
        return out + [("metric", m) for m in self.metrics] + [("page", at if at > 1 else None)]


def run_page(store: Store, view: RunView, now_ns: int) -> str:
    attempt = view.attempt if view.attempt is not None else data.latest_attempt(store, view.project, view.run)
    if attempt is None:
        raise NotFound(f"no run {view.run!r} in project {view.project!r}")
    view.attempt = attempt
    d = data.run_data(store, view.project, view.run, attempt, view.metrics)
    chosen = list(d.metrics)
    if not d.steps and d.status is None:
        raise NotFound(f"no rows of run {view.run!r} attempt {attempt} in project {view.project!r}")
    steps = [s for s in d.steps if (view.lo is None or s >= view.lo) and (view.hi is None or s <= view.hi)]
    axis = charts.Axis(float(steps[0]), float(steps[-1])) if steps else charts.Axis(0.0, 1.0)
    inside = set(steps)
    status = d.status or {}
    # (label, value, how it is written): each number by its kind (ui_html.fmt_*)
    figures: list[tuple[str, Any, Callable[[Any], str]]] = [
        ("status", status.get("status"), str), ("steps done", status.get("steps"), fmt_count),
        ("last event", when(int(status["last_event"].timestamp() * 1e9)) if status.get("last_event") else None, str),
        ("steps with figures", len(d.steps), fmt_count)]
    summary = summarize(list(d.throughput.values()))  # as the reports sum it up (rlpulse.sinks.views.step_figures)
    if d.throughput:
        kinds = {"tokens": fmt_count, "median-tokens-per-s": fmt_rate, "mean-mfu": fmt_ratio}
        figures += [(label, value, kinds.get(key, fmt_number)) for key, label, value in summary_figures(summary)
                    if key != "mfu-out-of-range"]
    # seed 001's GPU time, from placements and samples: none without a placement that names a GPU
    placed = data.any_row(store, "placements", "project = {p:String} AND run_id = {r:String} AND hw_id IS NOT NULL "
                          "AND hw_id != ''", p=view.project, r=view.run)
    for g in gpu_time(store, view.project, view.run) if placed else []:
        if g.attempt == attempt:
            figures += [("GPUs", g.gpus, fmt_count), ("GPU hours", g.gpu_hours, fmt_number),
                        ("energy kWh", g.energy_kwh, fmt_number)]
    head = '<div class="figures">' + "".join(
        f'<div class="figure" data-figure="{esc(k)}"><div class="label">{esc(k)}</div>'
        f'<div class="value">{text("–" if v is None else fmt(v))}</div></div>' for k, v, fmt in figures) + "</div>"
    note = out_of_range_note(summary.mfu_out_of_range)
    if note:
        head += f'<p class="muted mfu-out-of-range" data-steps="{summary.mfu_out_of_range}">{esc(note)}</p>'
    return (head + _run_links(d) + _run_form(view, d.metric_names, chosen) + _run_charts(d, axis, inside, chosen)
            + _terms_table(d) + _steps_table(d, view))


def _run_links(d: data.RunData) -> str:
    """Where to go from a run: its trajectories searched (/search), the run beside others (/compare)."""
    search = href("/search", [("project", d.project), ("run", d.run), ("attempt", d.attempt)])
    compare = href("/compare", [("run", run_param((d.project, d.run, d.attempt)))])  # a '/' in an id stays in it
    return (f'<p class="run-links"><a class="search-run" href="{search}">Search this run\'s trajectories</a>'
            f'<a class="compare-run" href="{compare}">Compare this run with others</a></p>')


# How the terms table writes each column of term_figures.COLUMNS (the rest: fmt_number)
TERM_FORMATS: dict[str, Callable[[Any], str]] = {
    "steps": fmt_count, "graded": fmt_count, "failures": fmt_count, "duration_p90_s": fmt_duration,
    "judge_input_tokens": fmt_count, "judge_output_tokens": fmt_count}


def _terms_table(d: data.RunData) -> str:
    """Each reward term over the run (term_figures.summarize: what the reports show), '' without terms."""
    summaries = term_figures.summarize(d.terms)
    if not summaries:
        return ""
    css = [attr.replace("_", "-") for _, attr in term_figures.COLUMNS]
    kinds = [TERM_FORMATS.get(attr, fmt_number) for _, attr in term_figures.COLUMNS]
    body = "".join(f'<tr class="term" data-term="{esc(s.term)}">'
                   + "".join(f'<td class="{c}">{text(v) if isinstance(v, str) else text(fmt(v))}</td>'
                             for c, fmt, v in zip(css, kinds, term_figures.summary_row(s))) + "</tr>" for s in summaries)
    note = term_figures.cost_note(summaries)
    return ("<h2>Reward terms</h2>" + table([h for h, _ in term_figures.COLUMNS], body, "terms")
            + (f'<p class="muted">{esc(note)}</p>' if note else ""))


def _run_form(view: RunView, names: Sequence[str], chosen: Sequence[str]) -> str:
    hidden = "".join(f'<input type="hidden" name="{k}" value="{text(v)}">'
                     for k, v in (("project", view.project), ("run", view.run), ("attempt", view.attempt)))
    boxes = "".join(f'<label><input type="checkbox" name="metric" value="{text(n)}"{" checked" if n in chosen else ""}>'
                    f"{text(n)}</label>" for n in names[:200])
    return (f'<form class="filters" method="get" action="/run">{hidden}'
            f'<label>steps from <input type="number" name="from" value="{num(view.lo) if view.lo is not None else ""}">'
            f'</label><label>to <input type="number" name="to" value="{num(view.hi) if view.hi is not None else ""}"></label>'
            + (f'<span class="muted">trainer metrics (up to {data.METRIC_CHARTS}):</span>{boxes}' if names else "")
            + "<button>show</button></form>")


def _run_charts(d: data.RunData, axis: charts.Axis, inside: set[int], chosen: Sequence[str]) -> str:
    """Every per-step chart of the run, two to a row on a wide screen (ui_html's ``.charts`` grid). A chart with
    nothing to draw is left out, and one muted line names those: an empty frame per figure made the page a
    long column of panels saying so."""
    def keep(step: object) -> bool:
        return int(step) in inside  # type: ignore[call-overload]

    shown: list[tuple[str, str]] = []  # (what the note calls it, its svg)

    def add(label: str, svg: str) -> None:
        shown.append((label, svg))

    stats = [d.stats[s] for s in sorted(d.stats) if keep(s)]
    pct = [r for r in d.percentiles if keep(r["step"]) and r["p50"] is not None]
    add("reward", charts.lines(
        "reward", "Reward per step: mean (band: ± std) and p10 / p50 / p90 from the histogram", axis,
        {"mean": [(s.step, s.reward_mean) for s in stats],
         **{q: [(r["step"], float(r[q])) for r in pct] for q in ("p10", "p50", "p90")}},
        bands={"mean ± std": [(s.step, s.reward_mean - s.reward_std, s.reward_mean + s.reward_std) for s in stats]}))
    labels = [f"≤{d.heat_bounds[0]:g}"] + [f"≤{b:g}" for b in d.heat_bounds[1:]] + [f">{d.heat_bounds[-1]:g}"] \
        if d.heat_bounds else []
    add("reward histogram", charts.heatmap("reward-heatmap", "Reward histogram per step (term total)", axis, labels,
                                           {s: c for s, c in d.heat.items() if keep(s)}))
    add("clipped ratio", charts.lines(
        "clipped-ratio", "Clipped ratio per step (completions cut at max tokens)", axis,
        {"clipped ratio": [(r["step"], float(r["clipped_ratio"])) for r in d.trend if keep(r["step"])]},
        y_range=(0.0, 1.0), fmt=fmt_ratio))
    per_step: dict[int, dict[str, float]] = {}
    for r in d.failures:
        if keep(r["step"]):
            per_step.setdefault(int(r["step"]), {})[f"{r['term']}: {r['cause']}"] = float(r["failures"])
    add("grader failures", charts.bars("failures", "Grader failures per step by term and cause", axis, per_step))
    terms = sorted({str(r["term"]) for r in d.terms})
    term_rows = [r for r in d.terms if keep(r["step"])]

    def per_term(key: str, has: str, tags: str = "") -> dict[str, list[tuple[float, float]]]:
        return {f"{t}{tags}": [(r["step"], float(r[key])) for r in term_rows if r["term"] == t and r[has]] for t in terms}

    add("term shares", charts.lines("term-shares", "Reward terms per step: mean share (a failed score counts 0)", axis,
                                    per_term("share_mean", "rollouts")))
    add("grader durations", charts.lines(
        "grader-durations", "Grader calls per step: duration p50 / p90 per term, failed calls included", axis,
        {**per_term("duration_p50_s", "graded", " p50"), **per_term("duration_p90_s", "graded", " p90")},
        fmt=fmt_duration))
    judged = [t for t in terms if any(r["judge_input_tokens"] or r["judge_output_tokens"] for r in term_rows
                                      if r["term"] == t)]  # a term no judge answered (a format check) has no tokens
    add("judge tokens", charts.lines(
        "judge-tokens", "Judge tokens per step and term: input / output", axis,
        {f"{t} {io}": [(r["step"], float(r[f"judge_{key}_tokens"])) for r in term_rows if r["term"] == t and r["graded"]]
         for t in judged for io, key in (("in", "input"), ("out", "output"))}, fmt=fmt_count))
    add("completion length", charts.lines(
        "completion-length", "Completion length per step (tokens): p50 / p90 / p99", axis,
        {q: [(s, v[i]) for s, v in sorted(d.lengths.items()) if keep(s)] for i, q in enumerate(("p50", "p90", "p99"))},
        fmt=fmt_count))
    rate = [d.throughput[s] for s in sorted(d.throughput) if keep(s)]
    add("tokens", charts.lines("tokens", "Tokens per step (trained on)", axis,
                               {"tokens": [(r.step, float(r.tokens)) for r in rate]}, fmt=fmt_count))
    add("tokens/s", charts.lines("throughput", "Throughput per step: tokens/s of the step", axis,
                                 {"tokens/s": [(r.step, r.tokens_per_s) for r in rate if r.tokens_per_s is not None]},
                                 fmt=fmt_rate))
    add("MFU", charts.lines("mfu", "MFU per step: model FLOPs utilization of the policy update (0..1)", axis,
                            {"MFU": [(r.step, r.mfu) for r in rate if r.mfu is not None]}, y_range=(0.0, 1.0), fmt=fmt_ratio))
    for (kind, name), pts in metrics_data.by_name([m for m in d.entry_metrics if keep(m.step)]).items():
        what = "Rollout" if kind == "ROLLOUT" else "Reward" if kind == "REWARD" else kind
        add(f"{what.lower()} metric {name}", charts.lines(
            f"{kind.lower()}-metric-{name}", f"{what} metric {name} per step: mean (band: ± std), min / max", axis,
            {"mean": [(m.step, m.mean) for m in pts], "min": [(m.step, m.min) for m in pts],
             "max": [(m.step, m.max) for m in pts]},
            bands={"mean ± std": [(m.step, m.mean - m.std, m.mean + m.std) for m in pts]}))
    for i, name in enumerate(chosen):
        add(f"trainer metric {name}", charts.lines(f"metric-{i}", f"Trainer metric {name}", axis,
                                                   {name: [(s, v) for s, v in d.metrics.get(name, []) if keep(s)]}))
    eng = [r for r in d.engine if keep(r["step"])]

    def engine(*keys: str) -> dict[str, list[tuple[float, float]]]:
        return {k: [(r["step"], float(r[k])) for r in eng if r.get(k) is not None] for k in keys}

    add("engines", charts.lines("engine", "Rollout engines per step: KV-cache usage max, awake share, prefix-cache "
                                "hit rate", axis, engine("kv_cache_usage_max", "awake_share", "prefix_cache_hit_rate"),
                                y_range=(0.0, 1.0), fmt=fmt_ratio))
    add("engine tokens/s", charts.lines("engine-rate", "Rollout engines per step: generation tokens/s", axis,
                                        {"generation tokens/s": engine("generation_tokens_per_s")["generation_tokens_per_s"]},
                                        fmt=fmt_rate))
    add("engine latency", charts.lines("engine-latency", "Rollout engines per step: request queue time and inter-token "
                                       "latency, mean", axis, engine("queue_time_mean_s", "itl_mean_s"), fmt=fmt_duration))
    util = {label: [(data.step_at(d.marks, t), u) for t, u, _ in pts] for label, pts in d.gpus.items()}
    power = {label: [(data.step_at(d.marks, t), p) for t, _, p in pts] for label, pts in d.gpus.items()}
    top = max([1.0] + [u for pts in util.values() for _, u in pts])  # stored 0..1, as the report draws it
    add("GPU utilisation", charts.lines("gpu-utilization", "GPU utilisation per GPU, placed on the step axis", axis, util,
                                        y_range=(0.0, top), fmt=fmt_ratio))
    add("GPU power", charts.lines("gpu-power", "GPU power per GPU (W), placed on the step axis", axis, power, unit=" W"))
    add("alerts", charts.alert_lanes("alerts", "Alerts of the run and its GPUs, placed on the step axis", axis,
                                     [(data.step_at(d.marks, t), rule, state, f"{when(t)} {rule} {state}: {summary}")
                                      for t, rule, state, summary in d.alerts]))
    empty = [label for label, svg in shown if charts.is_empty(svg)]
    note = (f'<p class="muted not-drawn" data-charts="{text(",".join(empty))}">Nothing recorded in these steps for: '
            f'{text(", ".join(empty))}.</p>' if empty else "")
    left_out = metrics_data.names_left_out(d.entry_metrics)
    if left_out:
        note += (f'<p class="muted">{left_out} more rollout / reward metric names are not drawn (at most '
                 f"{metrics_data.NAMES_PER_KIND} per kind).</p>")
    return ('<h2>Per step</h2><div class="charts">' + "".join(svg for _, svg in shown if not charts.is_empty(svg))
            + "</div>" + note)


@dataclass(frozen=True)
class StepColumn:
    """One column of a run's steps table: its heading, its cells' class (what a test or the browser finds
    a figure by), the figure at a step (None shows "–") and how it is written (a ``ui_html.fmt_*`` by its
    kind). A new per-step figure is one more entry of :func:`step_columns`, its values read into
    :class:`rlpulse.sinks.views.ui_data.RunData`."""

    head: str
    css: str
    value: Callable[[int], Any]
    fmt: Callable[[Any], str] = fmt_number


def step_columns(d: data.RunData) -> list[StepColumn]:
    """The steps table's columns after the step, in order."""
    trend = {int(r["step"]): r for r in d.trend}
    pct = {int(r["step"]): r for r in d.percentiles}
    fails: dict[int, int] = {}
    for r in d.failures:
        fails[int(r["step"])] = fails.get(int(r["step"]), 0) + int(r["failures"])

    def of(rows: dict[int, dict[str, Any]], key: str) -> Callable[[int], Any]:
        return lambda s: rows.get(s, {}).get(key)

    def stat(name: str) -> Callable[[int], Any]:
        return lambda s: getattr(d.stats[s], name) if s in d.stats else None

    def rate(name: str) -> Callable[[int], Any]:
        return lambda s: getattr(d.throughput[s], name) if s in d.throughput else None

    count, ratio = fmt_count, fmt_ratio
    return [
        StepColumn("rollouts", "rollouts", of(trend, "rollouts"), count),
        StepColumn("clipped", "clipped", of(trend, "clipped"), count),
        StepColumn("clipped ratio", "clipped-ratio", of(trend, "clipped_ratio"), ratio),
        StepColumn("change", "change", of(trend, "change"), ratio),  # of the clipped ratio: percentage points
        StepColumn("reward mean", "reward-mean", stat("reward_mean")), StepColumn("reward std", "reward-std", stat("reward_std")),
        *(StepColumn(q, q, of(pct, q)) for q in ("p10", "p50", "p90")),
        StepColumn("samples", "samples", stat("samples"), count),
        StepColumn("same reward", "same-reward", stat("samples_same_reward"), count),
        StepColumn("zero-std fraction", "zero-std", stat("zero_std_fraction"), ratio),
        StepColumn("grader failures", "failures", lambda s: fails.get(s, 0), count),
        StepColumn("staleness max", "staleness", stat("staleness_max"), count),
        StepColumn("tokens", "tokens", rate("tokens"), count),
        StepColumn("tokens/s", "tokens-per-s", rate("tokens_per_s"), fmt_rate),
        StepColumn("MFU", "mfu", rate("mfu"), ratio),
    ]


def _steps_table(d: data.RunData, view: RunView) -> str:
    steps = sorted((s for s in d.steps if (view.lo is None or s >= view.lo) and (view.hi is None or s <= view.hi)),
                   reverse=True)
    pages = max(1, -(-len(steps) // STEPS_PER_PAGE))
    view.page = min(max(view.page, 1), pages)
    shown = steps[(view.page - 1) * STEPS_PER_PAGE: view.page * STEPS_PER_PAGE]
    columns = step_columns(d)
    body = []
    for s in shown:
        link = href("/step", [("project", d.project), ("run", d.run), ("attempt", d.attempt), ("step", s)])
        body.append(f'<tr class="step" data-step="{s}"><td><a href="{link}">{s}</a></td>'
                    + "".join(f'<td class="n {c.css}">{text(c.fmt(c.value(s)))}</td>' for c in columns) + "</tr>")
    pager = _pager("/run", view.params, view.page, pages)
    return f"<h2>Steps ({len(steps)})</h2>" + pager + table(["step"] + [c.head for c in columns], "".join(body), "steps") + pager


def _pager(path: str, params: Callable[[int], list[tuple[str, object]]], page: int, pages: int) -> str:
    if pages <= 1:
        return ""
    prev = f'<a rel="prev" href="{href(path, params(page - 1))}">‹ newer</a>' if page > 1 else ""
    nxt = f'<a rel="next" href="{href(path, params(page + 1))}">older ›</a>' if page < pages else ""
    return f'<div class="pager">{prev}<span>page {page} of {pages}</span>{nxt}</div>'
