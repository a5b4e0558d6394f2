"""The search page of ``rlpulse ui``: a run's trajectories found by reward, status, failed term, clipped, steps and text.

Every filter is a URL parameter (a view is a link to share): ``project``, ``run``, ``attempt`` (default: the
latest), ``min_reward`` / ``max_reward``, ``status`` (OK or ERROR), ``failed`` (``any``, or a grader term),
``clipped`` (1 or 0), ``from`` / ``to`` (steps), ``q`` (text in the dialogue, at most ``Q_MAX`` characters) and
``page``. Hits come ``PER_PAGE`` to a page, by step then trajectory, each linking to its trajectory page; the
pager's links keep every filter. What matches is ``rlpulse.sinks.views.search_data``'s to say.
"""

from __future__ import annotations

import re

from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views import search_data as sd
from rlpulse.sinks.views.trajectories import NO_SAMPLE
from rlpulse.sinks.views.ui_data import has_tables, latest_attempt
from rlpulse.sinks.views.ui_html import fmt_count, fmt_number, href, table, text
from rlpulse.sinks.views.ui_pages import NotFound
from rlpulse.sinks.views.ui_params import INT_MAX, BadParameter, Page, Query, choice, decimal, integer, one

CLIPPED = {"": None, "1": True, "0": False}


def parse(query: Query) -> sd.Search:
    """The search the URL asks for (``attempt`` 0 when the URL names none: the latest, found by the page)."""
    q = one(query, "q") or ""
    if len(q) > sd.Q_MAX:
        raise BadParameter(f"q: at most {sd.Q_MAX} characters of text to search for, got {len(q)}")
    s = sd.Search(one(query, "project") or "", one(query, "run", required=True) or "", integer(query, "attempt", low=1) or 0,
                  decimal(query, "min_reward"), decimal(query, "max_reward"), choice(query, "status", ("",) + sd.STATUSES),
                  one(query, "failed") or "", CLIPPED[choice(query, "clipped", tuple(CLIPPED))],
                  integer(query, "from", low=-INT_MAX), integer(query, "to", low=-INT_MAX), q,
                  integer(query, "page", low=1) or 1)
    if s.min_reward is not None and s.max_reward is not None and s.min_reward > s.max_reward:
        raise BadParameter(f"min_reward ({s.min_reward:g}) is above max_reward ({s.max_reward:g}): nothing could match")
    if s.lo is not None and s.hi is not None and s.lo > s.hi:
        raise BadParameter(f"from ({s.lo}) is after to ({s.hi}): nothing could match")
    return s


def decimal_param(x: float | None) -> str | None:
    """A reward bound as a URL or a form writes it back: exact (repr), a whole number without ".0"."""
    if x is None:
        return None
    shown = repr(x)
    return shown[:-2] if shown.endswith(".0") else shown


def params(s: sd.Search, page: int | None = None) -> list[tuple[str, object]]:
    """The search's URL parameters (another page of it with ``page``): what the pager and the form keep."""
    at = s.page if page is None else page
    clipped = None if s.clipped is None else "1" if s.clipped else "0"
    return [("project", s.project), ("run", s.run), ("attempt", s.attempt), ("min_reward", decimal_param(s.min_reward)),
            ("max_reward", decimal_param(s.max_reward)), ("status", s.status), ("failed", s.failed), ("clipped", clipped),
            ("from", s.lo), ("to", s.hi), ("q", s.q), ("page", at if at > 1 else None)]


def search_page(store: Store, query: Query) -> Page:
    s = parse(query)
    if not has_tables(store):
        raise NotFound("the store has no rlpulse tables yet: nothing has reached it")
    if not s.attempt:
        s.attempt = latest_attempt(store, s.project, s.run) or 0
    if not s.attempt or not sd.run_exists(store, s.project, s.run, s.attempt):
        raise NotFound(f"no run {s.run!r} in project {s.project!r}" + (f" attempt {s.attempt}" if s.attempt else ""))
    found = sd.search(store, s)
    s.page = found.page
    at = [("project", s.project), ("run", s.run), ("attempt", s.attempt)]
    crumbs: list[tuple[str, str | None]] = [("Runs", href("/")), (f"{s.project}/{s.run}/{s.attempt}", href("/run", at)),
                                            ("search", None)]
    total = (f'<p class="total" data-total="{found.total}">{fmt_count(found.total)} '
             f'trajector{"y matches" if found.total == 1 else "ies match"}'
             + (f"; page {found.page} of {found.pages}, {sd.PER_PAGE} a page" if found.pages > 1 else "") + ".</p>")
    pager = _pager(s, found.page, found.pages)
    hits = _hits(s, found.hits) if found.hits else '<p class="muted no-hits">No trajectory of this run matches.</p>'
    body = _form(s, sd.terms(store, s.project, s.run, s.attempt)) + total + pager + hits + pager
    return f"Search {s.run} (attempt {s.attempt})", crumbs, body


def _form(s: sd.Search, terms: list[str]) -> str:
    def select(name: str, values: list[tuple[str, str]], chosen: str) -> str:
        opts = "".join(f'<option value="{text(v)}"{" selected" if v == chosen else ""}>{text(label)}</option>'
                       for v, label in values)
        return f'<select name="{name}">{opts}</select>'

    def number(name: str, value: float | int | None, step: str) -> str:
        return (f'<input type="number" name="{name}" step="{step}" '
                f'value="{"" if value is None else text(decimal_param(float(value)))}">')

    hidden = "".join(f'<input type="hidden" name="{k}" value="{text(v)}">'
                     for k, v in (("project", s.project), ("run", s.run), ("attempt", s.attempt)))
    failed = [("", "any outcome"), (sd.ANY_TERM, "a grader failed")] + [(t, f"grader {t} failed") for t in terms]
    if s.failed and s.failed not in [v for v, _ in failed]:  # a term the URL names that this run has not: kept
        failed.append((s.failed, f"grader {s.failed} failed"))
    clipped = "" if s.clipped is None else "1" if s.clipped else "0"
    return (f'<form class="filters search" method="get" action="/search">{hidden}'
            f'<label>text in the dialogue <input type="search" name="q" maxlength="{sd.Q_MAX}" value="{text(s.q)}"></label>'
            f'<label>reward ≥ {number("min_reward", s.min_reward, "any")}</label>'
            f'<label>≤ {number("max_reward", s.max_reward, "any")}</label>'
            f'<label>status {select("status", [("", "any")] + [(x, x) for x in sd.STATUSES], s.status)}</label>'
            f'{select("failed", failed, s.failed)}'
            f'<label>clipped {select("clipped", [("", "either"), ("1", "clipped"), ("0", "not clipped")], clipped)}</label>'
            f'<label>steps from {number("from", s.lo, "1")}</label><label>to {number("to", s.hi, "1")}</label>'
            "<button>search</button></form>")


def _marked(preview: str, q: str) -> str:
    """The preview on one line, each match of ``q`` in a <mark>; every part escaped with text()."""
    flat = preview.replace("\r", " ").replace("\n", " · ")
    if not q:
        return text(flat)
    parts = re.split(f"({re.escape(q)})", flat, flags=re.IGNORECASE)
    return "".join(f"<mark>{text(p)}</mark>" if i % 2 else text(p) for i, p in enumerate(parts))


def _hits(s: sd.Search, hits: list[sd.Hit]) -> str:
    rows = []
    for h in hits:
        link = href("/trajectory", [("project", s.project), ("run", s.run), ("attempt", s.attempt), ("rollout", h.key)])
        reward = "" if h.reward is None else f' data-reward="{h.reward!r}"'
        rows.append(
            f'<tr class="hit" data-rollout="{text(h.key)}" data-step="{"" if h.step is None else h.step}"{reward}>'
            f'<td class="rollout"><a href="{link}">{text(h.key)}</a></td>'
            f'<td class="n step">{"–" if h.step is None else h.step}</td>'
            f'<td class="sample">{text(h.sample or NO_SAMPLE)}</td><td class="n reward">{fmt_number(h.reward)}</td>'
            f'<td class="status status-{text(h.status)}">{text(h.status)}</td>'
            f'<td class="clipped">{"clipped" if h.clipped else "–"}</td>'
            f'<td class="n tokens">{fmt_count(h.completion_tokens)}</td>'
            f'<td class="failed-terms{" failed" if h.failed else ""}">{text(", ".join(h.failed)) or "–"}</td>'
            f'<td class="preview">{_marked(h.preview, s.q) if h.preview else ""}</td></tr>')
    head = ("trajectory", "step", "sample", "reward", "status", "clipped", "completion tokens", "failed graders",
            "match in the dialogue" if s.q else "task")
    return table(head, "".join(rows), "hits")


def _pager(s: sd.Search, page: int, pages: int) -> str:
    if pages <= 1:
        return ""
    prev = f'<a rel="prev" href="{href("/search", params(s, page - 1))}">‹ previous</a>' if page > 1 else ""
    nxt = f'<a rel="next" href="{href("/search", params(s, page + 1))}">next ›</a>' if page < pages else ""
    return f'<div class="pager">{prev}<span>page {page} of {pages}</span>{nxt}</div>'
