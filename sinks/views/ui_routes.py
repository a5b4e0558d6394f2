"""The URLs of ``rlpulse ui``: each page's path and its query-string parameters, parsed and checked.

========================  =====================================================================
``/``                     runs; ``project``, ``active=1``
``/run``                  a run; ``project``, ``run``, ``attempt`` (default: the latest),
                          ``from``/``to`` (step range of the charts), ``metric`` (repeatable), ``page``
``/step``                 a step's samples; ``project``, ``run``, ``attempt``, ``step``, ``sort``,
                          ``variance``, ``failed``, ``min_reward``, ``max_reward``, ``sample``, ``page``
``/trajectory``           a trajectory; ``project``, ``run``, ``attempt``, ``rollout``
``/compare``              runs overlaid (``rlpulse.sinks.views.ui_compare``); ``run=PROJECT/RUN[/ATTEMPT]``
                          (repeatable; each part percent-encoded), ``x=step|time``, ``smooth`` (EMA weight, 0 to
                          below 1), ``from``/``to``, ``metric`` (repeatable), ``config=all`` (every key, not only
                          those that differ)
``/search``               a run's trajectories (``rlpulse.sinks.views.ui_search``); ``project``, ``run``,
                          ``attempt``, ``min_reward``/``max_reward``, ``status``, ``failed``, ``clipped``,
                          ``from``/``to``, ``q`` (text in the dialogue), ``page``
any page                  ``refresh=N``: the browser reloads it every N seconds (a live view, no script)
========================  =====================================================================

A value that does not parse (a step that is not a number, an unknown sort) is answered 400 with
what was expected; a parameter the page does not know is ignored.
"""

from __future__ import annotations

from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views.trajectories import NO_SAMPLE
from rlpulse.sinks.views.ui_detail import SORTS, VARIANCES, StepView, step_page, trajectory_page
from rlpulse.sinks.views.ui_html import href
from rlpulse.sinks.views.ui_compare import compare_page
from rlpulse.sinks.views.ui_search import search_page
from rlpulse.sinks.views.ui_pages import NotFound, RunView, run_page
from rlpulse.sinks.views.ui_params import (INT_MAX, MAX_VALUE, REFRESH_MIN, BadParameter, Page, Query, choice, decimal,
                                          integer, one)
from rlpulse.sinks.views.ui_runs import runs_page

__all__ = ["REFRESH_MIN", "BadParameter", "Page", "Query", "integer", "route"]

def route(store: Store, path: str, query: Query, now_ns: int) -> Page:
    """The page at ``path`` for ``query``: NotFound for an unknown path or rows that do not exist."""
    runs = ("Runs", href("/"))
    if path not in ("/", "/run", "/step", "/trajectory", "/compare", "/search"):
        raise NotFound(f"no page {path}")
    if path == "/compare":
        return compare_page(store, query, now_ns)
    if path == "/search":
        return search_page(store, query)
    if path == "/":
        project = one(query, "project") or None
        refresh = one(query, "refresh") or ""
        return "Runs", [("Runs", None)], runs_page(store, now_ns, project, one(query, "active") == "1", refresh)
    project, run = one(query, "project") or "", one(query, "run", required=True) or ""
    if path == "/run":
        metrics = [m for m in query.get("metric", []) if m and len(m) <= MAX_VALUE]
        run_view = RunView(project, run, integer(query, "attempt"), integer(query, "from", low=-INT_MAX),
                       integer(query, "to", low=-INT_MAX), metrics, integer(query, "page", low=1) or 1)
        body = run_page(store, run_view, now_ns)
        return f"Run {run} (attempt {run_view.attempt})", [runs, (f"{project}/{run}/{run_view.attempt}", None)], body
    attempt = integer(query, "attempt", required=True)
    assert attempt is not None
    run_link = (f"{project}/{run}/{attempt}", href("/run", [("project", project), ("run", run), ("attempt", attempt)]))
    if path == "/step":
        step = integer(query, "step", required=True, low=-INT_MAX)
        assert step is not None
        view = StepView(project, run, attempt, step, choice(query, "sort", SORTS), choice(query, "variance", VARIANCES),
                        one(query, "failed") or "", decimal(query, "min_reward"), decimal(query, "max_reward"),
                        one(query, "sample"), integer(query, "page", low=1) or 1)
        body = step_page(store, view)
        crumbs = [runs, run_link, (f"step {step}", None if view.sample is None else
                                   href("/step", [("project", project), ("run", run), ("attempt", attempt), ("step", step)]))]
        if view.sample is not None:
            crumbs.append((f"sample {view.sample}", None))
        return f"Step {step} of {run}", crumbs, body
    if path == "/trajectory":
        rollout = one(query, "rollout", required=True) or ""
        body, step, sample = trajectory_page(store, project, run, attempt, rollout)
        crumbs = [runs, run_link]
        if step is not None:
            at = [("project", project), ("run", run), ("attempt", attempt), ("step", step)]
            crumbs += [(f"step {step}", href("/step", at)),
                       (f"sample {sample or NO_SAMPLE}", href("/step", at + [("sample", sample or NO_SAMPLE)]))]
        return f"Trajectory {rollout}", crumbs + [(f"trajectory {rollout}", None)], body
    raise AssertionError(path)
