"""What the search page of ``rlpulse ui`` finds in a run's trajectories, read from ClickHouse: rows, no HTML.

A trajectory is a ROLLOUT span and the spans sharing its key, as the step page reads them
(``rlpulse.sinks.views.ui_data.step_rollouts``): its ``rollout_id``, or ``trace <trace_id>`` for a ROLLOUT span
without one. Its reward is the ROLLOUT span's, else its REWARD entry span's; status, clipped, completion tokens,
step and sample are the ROLLOUT span's. A filter left empty keeps every trajectory:

* ``min_reward`` / ``max_reward``: the reward within [min, max] (a trajectory with no reward never matches);
* ``status``: the ROLLOUT span's status, OK or ERROR;
* ``failed``: a GRADER span of that term (``any``: of any term) whose outcome is set and not ``ok``;
* ``clipped``: 1, the ROLLOUT span says clipped; 0, it does not (false or not recorded);
* ``lo`` / ``hi``: the ROLLOUT span's step within [lo, hi];
* ``q``: text in the dialogue of any of the trajectory's LLM spans (the judge's calls too): the content of the
  messages of their ``gen_ai.input.messages`` and ``gen_ai.output.messages`` attributes (:data:`DIALOGUE`, not
  the JSON around it), case-insensitive.

Why it answers a run of 512,000 trajectories within a second: every query names the run's whole key, the
prefix of the spans table's sort key (project, run_id, attempt, ...), and filters ``kind`` in PREWHERE, so it
reads that run's ROLLOUT (and REWARD) spans alone; a failed term or a text narrows them with
``key IN (subquery)`` over the run's GRADER or LLM spans, so a text search reads at most the run's LLM spans
(never the other kinds, never another run's); the count and the page are counted and cut in ClickHouse
(``LIMIT ... OFFSET``) and only the page's rows (50) come to Python, with their failed terms and previews read
for those keys alone. Duplicates of a span (a replayed offset range) are one trajectory: rows are grouped by key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlpulse.schemas.enums import SPAN_KINDS, enum_symbols
from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views.trajectories import SAMPLE_SQL
from rlpulse.sinks.views.ui_data import rows

PER_PAGE = 50
Q_MAX = 200  # characters of a text search (the needle is a ClickHouse parameter: never pasted into SQL)
PREVIEW = 160  # characters of a row's preview
STATUSES: tuple[str, ...] = tuple(s for s in enum_symbols("Span", "status") if s != "UNSET")  # OK, ERROR
ANY_TERM = "any"  # failed=any: a grader of any term failed (as on the step page)
ROLLOUT, REWARD, LLM, GRADER = SPAN_KINDS[0], SPAN_KINDS[1], SPAN_KINDS[2], SPAN_KINDS[4]

KEY = "if(rollout_id != '', rollout_id, concat('trace ', trace_id))"  # a trajectory's key, as the step page's
RUN = "project = {p:String} AND run_id = {r:String} AND attempt = {a:UInt32}"
FAILED = "ifNull(outcome, '') NOT IN ('', 'ok')"  # a GRADER span that failed (Rollout.failed's rule)
MESSAGES = ("gen_ai.input.messages", "gen_ai.output.messages")
# The dialogue's text of an LLM span: each message's content (a string, or its text parts) one per line, the
# prompt's then the reply's. The text search and the preview read this, never the raw JSON, so a word of the
# JSON's structure ("role", "content", "user") matches nothing and a quote or a newline matches as typed.
_CONTENT = ("arrayStringConcat(arrayMap(m -> if(JSONType(m, 'content') = 'Array', arrayStringConcat(arrayMap("
            "x -> JSONExtractString(x, 'text'), JSONExtractArrayRaw(m, 'content')), ' '), JSONExtractString(m, 'content')), "
            "JSONExtractArrayRaw(attributes['{m}'])), '\\n')")
DIALOGUE = f"concat({_CONTENT.format(m=MESSAGES[0])}, '\\n', {_CONTENT.format(m=MESSAGES[1])})"


@dataclass
class Search:
    """One search: the run and every filter (None or '' when not set), and the page (from 1)."""

    project: str
    run: str
    attempt: int
    min_reward: float | None = None
    max_reward: float | None = None
    status: str = ""
    failed: str = ""
    clipped: bool | None = None
    lo: int | None = None
    hi: int | None = None
    q: str = ""
    page: int = 1


@dataclass
class Hit:
    key: str
    step: int | None
    sample: str | None
    reward: float | None
    status: str
    clipped: bool
    completion_tokens: int | None
    failed: list[str] = field(default_factory=list)  # the terms of its GRADER spans that failed
    preview: str | None = None  # the text around the first match (q), else the task (its first LLM call's user message)


@dataclass
class Found:
    total: int  # trajectories matching, over all pages
    page: int  # the page shown (the last one when the URL asked past it)
    pages: int
    hits: list[Hit]


def where(s: Search) -> tuple[str, str, dict[str, Any]]:
    """The conditions of ``s``'s filters: on the run's ROLLOUT spans (their own fields, and key IN subqueries for
    a failed term or a text), on the reward once the REWARD entry's has filled a ROLLOUT span's missing one,
    and their parameters. Pure: tested as a unit."""
    params: dict[str, Any] = {"p": s.project, "r": s.run, "a": s.attempt}
    spans: list[str] = []
    reward: list[str] = []
    for cond, name, value, into in (("step >= {lo_s:Int64}", "lo_s", s.lo, spans),
                                    ("step <= {hi_s:Int64}", "hi_s", s.hi, spans),
                                    ("status = {status:String}", "status", s.status or None, spans),
                                    ("rw >= {lo_r:Float64}", "lo_r", s.min_reward, reward),
                                    ("rw <= {hi_r:Float64}", "hi_r", s.max_reward, reward)):
        if value is not None:
            into.append(cond)
            params[name] = value
    if s.clipped is not None:
        spans.append(("" if s.clipped else "NOT ") + "ifNull(clipped, false)")
    if s.failed:
        term = "" if s.failed == ANY_TERM else " AND term = {term:String}"
        spans.append(f"key IN (SELECT {KEY} FROM {{db}}.spans PREWHERE kind = '{GRADER}' WHERE {RUN} AND {FAILED}{term})")
        if s.failed != ANY_TERM:
            params["term"] = s.failed
    if s.q:
        found = f"positionCaseInsensitiveUTF8({DIALOGUE}, {{q:String}}) > 0"
        spans.append(f"key IN (SELECT {KEY} FROM {{db}}.spans PREWHERE kind = '{LLM}' WHERE {RUN} AND {found})")
        params["q"] = s.q
    return "".join(f" AND {c}" for c in spans), " AND ".join(reward) or "true", params


def matching(s: Search) -> tuple[str, dict[str, Any]]:
    """The SELECT of the run's trajectories matching ``s``, one row per trajectory key (FINAL: a span stored twice
    is one; two ROLLOUT spans of one key are one, the later's figures): key, st, smp, rw, sts, clp, tokens."""
    narrow, reward, params = where(s)
    return f"""
        SELECT key, st, smp, if(rw0 IS NULL, entry.rw1, rw0) AS rw, sts, clp, tokens FROM (
            -- one row per trajectory: two ROLLOUT spans of one key (a retried rollout, a span sent again under a
            -- new sequence id) are one, the later (LIMIT 1 BY: a third of the cost of argMax over a tuple per key)
            SELECT {KEY} AS key, step AS st, {SAMPLE_SQL} AS smp, reward AS rw0, status AS sts, clipped AS clp,
                   completion_tokens AS tokens
            FROM {{db}}.spans FINAL PREWHERE kind = '{ROLLOUT}' WHERE {RUN}{narrow}
            ORDER BY key, sequence_id DESC LIMIT 1 BY key) AS rollout
        LEFT ANY JOIN (
            SELECT {KEY} AS key, any(reward) AS rw1 FROM {{db}}.spans PREWHERE kind = '{REWARD}'
            WHERE {RUN} AND reward IS NOT NULL GROUP BY key) AS entry USING key
        WHERE {reward}""", params


def search(store: Store, s: Search) -> Found:
    """The page ``s.page`` of the trajectories matching ``s`` (sorted by step, then key), and how many match."""
    sql, params = matching(s)

    def page_of(page: int) -> list[tuple]:
        # the page and the count in one query (count() OVER (), before the LIMIT): the matching trajectories
        # are found once, not once for the count and again for the page (0.16 s, not 0.33, at 512,000)
        return rows(store, f"SELECT *, count() OVER () FROM ({sql}) ORDER BY st, key "
                    f"LIMIT {PER_PAGE} OFFSET {(page - 1) * PER_PAGE}", **params)

    page = max(s.page, 1)
    found = page_of(page)
    if found:
        total = int(found[0][-1])
    else:  # no match, or a page past the last (a URL kept from before): the count, then the last page
        total = int(rows(store, f"SELECT count() FROM ({sql})", **params)[0][0])
        page = min(page, max(1, -(-total // PER_PAGE)))
        found = page_of(page) if total else []
    pages = max(1, -(-total // PER_PAGE))
    found = [r[:-1] for r in found]
    hits = [Hit(str(key), None if st is None else int(st), None if smp is None else str(smp),
                None if reward is None else float(reward), str(status or "UNSET"), bool(clipped),
                None if tokens is None else int(tokens)) for key, st, smp, reward, status, clipped, tokens in found]
    if hits:
        _details(store, s, hits)
    return Found(total, page, pages, hits)


def _details(store: Store, s: Search, hits: list[Hit]) -> None:
    """The page's failed terms and previews, read for its keys alone (the run's GRADER and LLM spans, no others)."""
    keys = [h.key for h in hits]
    run = {"p": s.project, "r": s.run, "a": s.attempt, "keys": keys}
    failed = {str(k): sorted(str(t) for t in terms) for k, terms in rows(store, f"""
        SELECT {KEY} AS key, groupUniqArray(ifNull(term, '')) FROM {{db}}.spans PREWHERE kind = '{GRADER}'
        WHERE {RUN} AND key IN {{keys:Array(String)}} AND {FAILED} GROUP BY key""", **run)}
    said = DIALOGUE
    if s.q:  # the text around the first match, in the first LLM span that matches
        at = "positionCaseInsensitiveUTF8(txt, {q:String})"
        start = f"greatest(1, toInt64({at}) - {PREVIEW // 3})"  # a third of the preview before the match: its context
        pick = (f"argMinIf(concat(if({start} > 1, '…', ''), substringUTF8(txt, {start}, {PREVIEW})), sequence_id, "
                f"{at} > 0)")
        run["q"] = s.q
    else:  # the task: the first user message of the trajectory's first LLM call (the policy's: a judge comes later)
        task = (f"JSONExtractString(arrayFirst(m -> JSONExtractString(m, 'role') = 'user', "
                f"JSONExtractArrayRaw(attributes['{MESSAGES[0]}'])), 'content')")
        pick = f"argMin(substringUTF8({task}, 1, {PREVIEW}), sequence_id)"
        said = "''"
    previews = dict(rows(store, f"""
        SELECT key, {pick} FROM (SELECT {KEY} AS key, sequence_id, attributes, {said} AS txt FROM {{db}}.spans
                                 PREWHERE kind = '{LLM}' WHERE {RUN} AND key IN {{keys:Array(String)}})
        GROUP BY key""", **run))
    for h in hits:
        h.failed = failed.get(h.key, [])
        h.preview = str(previews[h.key]) if previews.get(h.key) else None


def run_exists(store: Store, project: str, run: str, attempt: int) -> bool:
    """The run has steps or spans under that attempt (the sort keys' prefixes: two short reads)."""
    p = {"p": project, "r": run, "a": attempt}
    return bool(rows(store, f"SELECT count() > 0 FROM (SELECT 1 FROM {{db}}.steps WHERE {RUN} LIMIT 1)", **p)[0][0]
                or rows(store, f"SELECT count() > 0 FROM (SELECT 1 FROM {{db}}.spans WHERE {RUN} LIMIT 1)", **p)[0][0])


def terms(store: Store, project: str, run: str, attempt: int) -> list[str]:
    """The run's grader terms (the form's choices of ``failed``)."""
    return [str(t) for (t,) in rows(store, f"""SELECT DISTINCT ifNull(term, '') AS t FROM {{db}}.spans
        PREWHERE kind = '{GRADER}' WHERE {RUN} AND t != '' ORDER BY t LIMIT 200""", p=project, r=run, a=attempt)]
