"""The runs page of ``rlpulse ui``: every run's state and latest figures, and the form that picks runs to compare
(a checkbox per run, submitted as ``/compare?run=...``) with a link to search each run's trajectories.

It takes the store and the page's parameters (parsed by ``rlpulse.sinks.views.ui_routes``) and returns the
page's body; every link carries the parameters of the view it opens, so any page is a URL that can be shared.
"""

from __future__ import annotations

from rlpulse.sinks.views import ui_data as data
from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views.html_escape import esc
from rlpulse.sinks.views.ui_html import ago, href, num, table, text
from rlpulse.sinks.views.watch import snapshot
from rlpulse.sinks.views.compare_data import MAX_RUNS
from rlpulse.sinks.views.ui_params import run_param


# -- runs ----------------------------------------------------------------------------------------

def runs_page(store: Store, now_ns: int, project: str | None, active: bool, refresh: str = "") -> str:
    if not data.has_tables(store):
        return '<p class="muted">The store has no rlpulse tables yet: nothing has reached it. Run the pipeline.</p>'
    snap = snapshot(store, now_ns, project, show_all=not active)
    stale = data.staleness(store, [r.key for r in snap.runs]) if snap.runs else {}
    options = "".join(f'<option value="{text(p)}"{" selected" if p == project else ""}>{text(p)}</option>'
                      for p in data.projects(store))
    form = ('<form class="filters" method="get" action="/"><label>project <select name="project">'
            f'<option value="">all</option>{options}</select></label>'
            f'<label><input type="checkbox" name="active" value="1"{" checked" if active else ""}> active only '
            "(reported in the last 10 minutes, or stalled or silent)</label><label>refresh <select name=\"refresh\">"
            + "".join(f'<option value="{v}"{" selected" if v == refresh else ""}>{label}</option>'
                      for v, label in (("", "off"), ("10", "every 10 s"), ("30", "every 30 s"), ("60", "every minute")))
            + "</select></label><button>show</button></form>")
    body = []
    for r in snap.runs:
        state = r.end_status.upper() if r.state == "ENDED" and r.end_status else r.state
        at = [("project", r.project), ("run", r.run_id), ("attempt", r.attempt)]
        link, search = href("/run", at), href("/search", at)
        s_max, s_mean = stale.get(r.key, (None, None))
        rules: dict[str, int] = {}
        for a in r.alerts:  # one rule may be open for several keys (a term each, a GPU each)
            rules[a.rule] = rules.get(a.rule, 0) + 1
        alerts = ", ".join(rule + (f" ×{n}" if n > 1 else "") for rule, n in sorted(rules.items()))
        body.append(
            f'<tr class="run" data-project="{text(r.project)}" data-run="{text(r.run_id)}" data-attempt="{r.attempt}">'
            f'<td class="pick"><input type="checkbox" name="run" value="{text(run_param((r.project, r.run_id, r.attempt)))}" '
            f'aria-label="compare {text(r.project)}/{text(r.run_id)}/{r.attempt}"></td>'
            f'<td class="state state-{esc(state)}">{esc(state)}</td><td>{text(r.project)}</td>'
            f'<td class="run-id"><a href="{link}">{text(r.run_id)}</a></td><td class="n">{r.attempt}</td>'
            f'<td class="n step">{num(r.step)}</td><td class="n steps-done">{r.step_count}</td>'
            f'<td class="n pace">{num(r.steps_per_min, 2)}</td><td class="n reward">{num(r.reward_mean)}</td>'
            f'<td class="n clipped">{num(r.clipped_ratio)}</td><td class="n failure-rate">{num(r.failure_rate)}</td>'
            f'<td class="n staleness">{num(s_max)} / {num(s_mean, 2)}</td>'
            f'<td class="alerts{" failed" if alerts else ""}">{text(alerts) or "–"}</td>'
            f'<td class="last">{esc(ago(r.last_ns, now_ns))}</td>'
            f'<td class="links"><a class="search" href="{search}">search</a></td></tr>')
    head = ("compare", "state", "project", "run", "attempt", "step", "steps done", "steps/min", "reward mean", "clipped ratio",
            "failure rate", "staleness max / mean", "open alerts", "last report", "trajectories")
    if not body:
        what = "active runs" if active else "runs"
        return form + f'<p class="muted">No {what}{" of project " + text(project) if project else ""}.</p>'
    note = ('<p class="muted">Reward mean and clipped ratio: the latest step; failure rate: grader failures over '
            "the last 5 minutes up to now or the run's end; staleness: step - policy version at the latest step.</p>")
    # The runs table is its own GET form: the ticked rows' run= values are the compare page's URL (a form cannot
    # hold the filters form above, so the two stay separate forms).
    pick = (f'<form class="compare-form" method="get" action="/compare">'
            f'<p class="compare-hint"><button>compare the ticked runs</button> <span class="muted">up to {MAX_RUNS} runs, '
            "overlaid on one step axis, with the configuration keys that differ</span></p>"
            + table(head, "".join(body), "runs") + "</form>")
    return form + pick + note
