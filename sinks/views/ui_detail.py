"""A step's page (its samples, each with its N trajectories side by side) and a trajectory's page
(dialogue, tool calls, graders, span tree) of ``rlpulse ui``.

Sorting and filtering happen on the step's rollouts once read (at most ``ROLLOUT_CAP``, one
aggregate query), and every choice is a URL parameter: ``sort`` (sample, reward-desc, reward-asc,
spread-desc), ``variance`` (zero: the samples whose rollouts all scored the same reward, which
carry no signal for group-relative methods; nonzero), ``failed`` (any, or a grader term),
``min_reward``/``max_reward`` (on a sample's mean reward), ``sample`` (one sample), ``page``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rlpulse.base.env import SINK_CONTENT_MAX_CHARS, SPAN_CAP, TRACE_CONTENT
from rlpulse.sinks.views import ui_data as data
from rlpulse.sinks.views import ui_spans as spans
from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views.html_escape import esc
from rlpulse.sinks.views.rewards import final_reward_of, find_reward_spans
from rlpulse.sinks.views.trajectories import NO_SAMPLE, build_tree, grader_call_ids
from rlpulse.sinks.views.trajectory_html import TOOL_KEYS, duration, tree_html
from rlpulse.sinks.views.ui_html import block, href, num, table, text
from rlpulse.sinks.views.ui_pages import NotFound

GROUPS_PER_PAGE = 20
SORTS = ("sample", "reward-desc", "reward-asc", "spread-desc")
VARIANCES = ("", "zero", "nonzero")
CUT_CHARS = "rlpulse.content.cut_chars"  # the tracer's count of content characters its cap cut on a span


@dataclass
class StepView:
    project: str
    run: str
    attempt: int
    step: int
    sort: str = "sample"
    variance: str = ""
    failed: str = ""
    min_reward: float | None = None
    max_reward: float | None = None
    sample: str | None = None
    page: int = 1

    def params(self, page: int | None = None, **change: Any) -> list[tuple[str, Any]]:
        at = self.page if page is None else page
        out = {"project": self.project, "run": self.run, "attempt": self.attempt, "step": self.step,
               "sort": None if self.sort == "sample" else self.sort, "variance": self.variance or None,
               "failed": self.failed or None, "min_reward": self.min_reward, "max_reward": self.max_reward,
               "sample": self.sample, "page": at if at > 1 else None}
        out.update(change)
        return list(out.items())


def _keep(g: data.Group, v: StepView) -> bool:
    if v.sample is not None and (g.sample or NO_SAMPLE) != v.sample:
        return False
    if (v.variance == "zero" and not g.zero_variance) or (v.variance == "nonzero" and g.zero_variance):
        return False
    if v.failed and not any(r.failed and (v.failed == "any" or v.failed in r.failed) for r in g.rollouts):
        return False
    mean = g.mean
    if v.min_reward is not None and (mean is None or mean < v.min_reward):
        return False
    return not (v.max_reward is not None and (mean is None or mean > v.max_reward))


def _order(groups: list[data.Group], sort: str) -> list[data.Group]:
    if sort == "reward-desc":
        return sorted(groups, key=lambda g: (g.mean is None, -(g.mean or 0.0)))
    if sort == "reward-asc":
        return sorted(groups, key=lambda g: (g.mean is None, g.mean or 0.0))
    if sort == "spread-desc":
        return sorted(groups, key=lambda g: -g.spread)
    return groups


def step_page(store: Store, v: StepView) -> str:
    rollouts = data.step_rollouts(store, v.project, v.run, v.attempt, v.step)
    stats = data.step_stats(store, v.project, v.run, v.attempt, v.step)
    if not rollouts and stats is None:
        raise NotFound(f"no rollouts of run {v.run!r} attempt {v.attempt} at step {v.step}")
    all_groups = data.groups(rollouts)
    terms = sorted({t for r in rollouts for t, _, _ in r.graders})
    figures = [("rollouts", stats.rollouts if stats else None), ("clipped", stats.clipped if stats else None),
               ("clipped ratio", stats.clipped_ratio if stats else None), ("reward mean", stats.reward_mean if stats else None),
               ("reward std", stats.reward_std if stats else None), ("samples", stats.samples if stats else None),
               ("samples same reward", stats.samples_same_reward if stats else None),
               ("rollouts read", len(rollouts)), ("zero-variance samples read", sum(g.zero_variance for g in all_groups)),
               ("with a failed grader", sum(1 for r in rollouts if r.failed))]
    head = '<div class="figures">' + "".join(
        f'<div class="figure" data-figure="{esc(k)}"><div class="label">{esc(k)}</div><div class="value">{num(x)}</div></div>'
        for k, x in figures) + "</div>"
    shown = _order([g for g in all_groups if _keep(g, v)], v.sort)
    pages = max(1, -(-len(shown) // GROUPS_PER_PAGE))
    v.page = min(max(v.page, 1), pages)
    blocks = [_group(v, g) for g in shown[(v.page - 1) * GROUPS_PER_PAGE: v.page * GROUPS_PER_PAGE]]
    pager = ""
    if pages > 1:
        prev = f'<a rel="prev" href="{href("/step", v.params(v.page - 1))}">‹ previous</a>' if v.page > 1 else ""
        nxt = f'<a rel="next" href="{href("/step", v.params(v.page + 1))}">next ›</a>' if v.page < pages else ""
        pager = f'<div class="pager">{prev}<span>page {v.page} of {pages}</span>{nxt}</div>'
    count = f'<p class="muted shown" data-groups="{len(shown)}">{len(shown)} of {len(all_groups)} samples match.</p>'
    return head + _step_form(v, terms) + count + pager + "".join(blocks) + pager


def _step_form(v: StepView, terms: list[str]) -> str:
    def options(name: str, values: list[tuple[str, str]], chosen: str) -> str:
        opts = "".join(f'<option value="{text(val)}"{" selected" if val == chosen else ""}>{text(label)}</option>'
                       for val, label in values)
        return f'<select name="{name}">{opts}</select>'

    hidden = "".join(f'<input type="hidden" name="{k}" value="{text(x)}">' for k, x in
                     (("project", v.project), ("run", v.run), ("attempt", v.attempt), ("step", v.step)))
    sample = f'<input type="hidden" name="sample" value="{text(v.sample)}">' if v.sample is not None else ""
    sorts = [("sample", "sample id"), ("reward-desc", "mean reward, high first"), ("reward-asc", "mean reward, low first"),
             ("spread-desc", "reward spread, widest first")]
    variances = [("", "all samples"), ("zero", "zero variance only"), ("nonzero", "some variance only")]
    failed = [("", "any outcome"), ("any", "a grader failed")] + [(t, f"grader {t} failed") for t in terms]
    reward = "".join(f'<label>{label} <input type="number" step="any" name="{n}" value="{num(x) if x is not None else ""}">'
                     "</label>" for n, label, x in (("min_reward", "mean reward ≥", v.min_reward),
                                                    ("max_reward", "≤", v.max_reward)))
    return (f'<form class="filters" method="get" action="/step">{hidden}{sample}<label>sort {options("sort", sorts, v.sort)}'
            f'</label>{options("variance", variances, v.variance)}{options("failed", failed, v.failed)}{reward}'
            "<button>show</button></form>")


def _group(v: StepView, g: data.Group) -> str:
    label = g.sample or NO_SAMPLE
    rollouts = g.rollouts if v.sort == "sample" else sorted(
        g.rollouts, key=lambda r: (r.reward is None, -(r.reward or 0.0) if v.sort != "reward-asc" else r.reward or 0.0))
    cards = []
    for r in rollouts:
        link = href("/trajectory", [("project", v.project), ("run", v.run), ("attempt", v.attempt), ("rollout", r.key)])
        failed = (f'<div class="failed graders-failed">failed: {text(", ".join(r.failed))}</div>' if r.failed
                  else '<div class="muted graders-failed">no grader failed</div>')
        scores = ", ".join(f"{t} {o}" + (f" {num(s, 3)}" if s is not None else "") for t, o, s in r.graders)
        cards.append(
            f'<a class="card status-{esc(r.status)}" data-rollout="{text(r.key)}" data-reward="{num(r.reward, 6)}" '
            f'href="{link}"><div class="rollout-id">{text(r.key)}</div><div class="reward">{num(r.reward)}</div>'
            f'<div class="status">{esc(r.status)}{" · clipped" if r.clipped else ""}'
            f'{" · " + text(r.finish_reason) if r.finish_reason else ""}</div>'
            f'<div class="muted">{num(r.completion_tokens)} completion tokens · {r.spans} spans</div>{failed}'
            f'<div class="muted graders">{text(scores)}</div>'
            + (f'<div class="prompt" title="the task">{text(r.prompt)}</div>' if r.prompt else "")
            + (f'<div class="completion" title="the policy\'s last reply">{text(r.completion)}</div>' if r.completion else "")
            + ('<div class="muted capped">content not kept (span cap)</div>' if r.capped else "") + "</a>")
    badges = ('<span class="badge zero">zero variance</span>' if g.zero_variance else "") + (
        '<span class="badge">content not kept</span>' if any(r.capped for r in g.rollouts) else "") + (
        '<span class="badge fail">grader failed</span>' if any(r.failed for r in g.rollouts) else "")
    only = href("/step", v.params(1, sample=label))
    return (f'<section class="group" data-sample="{text(label)}" data-zero-variance="{str(g.zero_variance).lower()}">'
            f'<h3>sample <a href="{only}">{text(label)}</a> · {len(g.rollouts)} trajectories · mean reward {num(g.mean)} · '
            f'spread {num(g.spread)}{badges}</h3><div class="cards">{"".join(cards)}</div></section>')


# -- a trajectory --------------------------------------------------------------------------------

def _json(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return None


def _content(content: Any) -> str:
    if isinstance(content, list):  # OpenAI's content parts
        return "\n".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def _message(m: Any) -> str:
    if not isinstance(m, dict):
        return f'<div class="msg"><pre>{block(json.dumps(m))}</pre></div>'
    role = str(m.get("role", "?"))
    parts = [f'<div class="role">{text(role)}' + (f' · call {text(m["tool_call_id"])}' if m.get("tool_call_id") else "")
             + "</div>"]
    body = _content(m.get("content"))
    if body:
        parts.append(f"<pre>{block(body)}</pre>")
    for call in m.get("tool_calls") or []:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        parts.append(f'<div class="tool-call">tool call {text(call.get("id", "") if isinstance(call, dict) else "")}: '
                     f'{text(fn.get("name", ""))}({block(fn.get("arguments", ""))})</div>')
    return f'<div class="msg role-{esc(role if role.isalpha() else "other")}" data-role="{text(role)}">{"".join(parts)}</div>'


def _dialogue(spans: list[Any]) -> str:
    """The conversation of the trajectory's last policy call that recorded content: what it sent, then its reply.
    An agent loop resends the whole conversation, so that call holds every earlier turn, tool calls and results.
    A judge's calls (under a REWARD entry or GRADER span) are not the policy's dialogue: counted, not drawn."""
    judged = grader_call_ids(spans)
    calls = [s for s in spans if s.kind == "LLM" and s.attributes.get("gen_ai.input.messages") and s.span_id not in judged]
    judges = (f'<p class="muted judge-calls">{len(judged)} call(s) made by the reward function (a judge) are not part '
              "of the dialogue; the span tree below shows them.</p>") if judged else ""
    if not calls:
        return judges + (f'<p class="muted no-content">No message content was recorded for this trajectory ({TRACE_CONTENT}=1 '
                "turns it on in the job; the span tree below shows its calls).</p>")
    last = calls[-1]
    sent, got = _json(last.attributes["gen_ai.input.messages"]), _json(last.attributes.get("gen_ai.output.messages", "[]"))
    if not isinstance(sent, list):
        return f'<pre class="raw">{block(last.attributes["gen_ai.input.messages"])}</pre>'
    cut = sum(int(s.attributes.get(CUT_CHARS, "0") or 0) for s in spans if str(s.attributes.get(CUT_CHARS, "0")).isdigit())
    note = judges + (f'<p class="muted">The content cap cut {cut} characters of this trajectory.</p>' if cut else "")
    return note + '<div class="dialogue">' + "".join(_message(m) for m in sent + (got if isinstance(got, list) else [])) \
        + "</div>"


def _rewards(spans: list[Any]) -> str:
    """Every reward of the trajectory in start order (seed 003's find_reward_spans), the final one marked."""
    found = find_reward_spans(spans)
    if not any(r.source == "annotation" for r in found):
        return ""  # the one reward is in the figures above
    final = final_reward_of(found)
    body = "".join(f'<tr class="reward" data-source="{esc(r.source)}"{" data-final" if r is final else ""}>'
                   f"<td>{text(r.source)}</td><td>{text(r.name)}</td><td class=\"n\">{num(r.value)}</td>"
                   f"<td>{'final' if r is final else ''}</td></tr>" for r in found)
    return "<h2>Rewards</h2>" + table(("source", "name", "reward", ""), body, "rewards")


def trajectory_page(store: Store, project: str, run: str, attempt: int, rollout: str) -> tuple[str, int | None, str | None]:
    """The body, and the trajectory's step and sample (for the page's crumbs)."""
    d = spans.trajectory(store, project, run, attempt, rollout)
    if not d.spans:
        raise NotFound(f"no spans of rollout {rollout!r} in run {run!r} attempt {attempt}")
    r = d.rollout
    reward = spans.reward_of(d)
    figures = [("reward", num(reward)), ("status", r.status if r else "no ROLLOUT span"),
               ("message", r.status_message if r else ""), ("step", num(d.step)), ("sample", d.sample or NO_SAMPLE),
               ("completion tokens", num(r.typed.get("completion_tokens")) if r else "–"),
               ("clipped", num(bool(r.typed.get("clipped"))) if r else "–"), ("spans", str(d.total)),
               ("duration", duration(r.end_ns - r.start_ns) if r else "–")]
    head = '<div class="figures">' + "".join(
        f'<div class="figure" data-figure="{esc(k)}"><div class="label">{esc(k)}</div><div class="value">{text(x) or "–"}'
        "</div></div>" for k, x in figures if x != "") + "</div>"
    metrics = "".join(f"<tr><td>{text(next(s.kind for s in d.spans if s.span_id == sid))}</td><td>{text(k)}</td>"
                      f'<td class="n">{num(x)}</td></tr>' for sid, m in d.metrics.items() for k, x in sorted(m.items()))
    tools = "".join(
        f'<tr class="tool" data-span-id="{text(s.span_id)}"><td>{text(spans.first(s.attributes, *TOOL_KEYS) or s.name)}</td>'
        f'<td class="status-{esc(s.status)}">{esc(s.status)}{" · " + text(s.status_message) if s.status_message else ""}</td>'
        f'<td class="n">{esc(duration(s.end_ns - s.start_ns))}</td>'
        f'<td><pre class="arguments">{block(s.attributes.get("gen_ai.tool.call.arguments", "–"))}</pre></td>'
        f'<td><pre class="result">{block(s.attributes.get("gen_ai.tool.call.result", "–"))}</pre></td></tr>'
        for s in d.spans if s.kind == "TOOL")
    graders = "".join(
        f'<tr class="grader" data-term="{text(s.typed.get("term", ""))}" data-outcome="{text(s.typed.get("outcome", ""))}">'
        f'<td>{text(s.typed.get("term", s.name))}</td>'
        f'<td class="outcome{" failed" if s.typed.get("outcome") not in (None, "ok") else ""}">'
        f'{text(s.typed.get("outcome", "–"))}</td><td class="n score">{num(s.typed.get("score"))}</td>'
        f'<td class="n">{esc(duration(s.end_ns - s.start_ns))}</td><td>{text(s.status_message)}</td></tr>'
        for s in d.spans if s.kind == "GRADER")
    tree_rows = "".join(
        f'<tr class="tree-row" data-depth="{int(t["depth"])}"><td class="indent-{min(int(t["depth"]), 5)}">{text(t["name"])}'
        f'</td><td>{text(t["kind"])}</td><td class="status-{esc(t["status"])}">{text(t["status"])}</td>'
        f'<td class="n duration-ms">{num(t["duration_ms"], 3)}</td><td>{text(t["term"] or "")}</td>'
        f'<td>{text(t["outcome"] or "")}</td></tr>' for t in d.tree)
    tree = build_tree(d.spans, total=d.total)
    more = f'<p class="muted">{tree.not_shown} more spans not shown.</p>' if tree.not_shown else ""
    kept = ""
    if d.capped:
        kept += (f'<p class="muted content-capped">The sink stored {d.capped} span(s) of this trajectory without their '
                 f"content: it came past the cap of full trajectories per step ({SPAN_CAP}). Its span tree, reward, "
                 "scores and outcomes are whole, and every figure counts it.</p>")
    if d.cut_chars:
        kept += (f'<p class="muted content-cut">The sink cut {d.cut_chars} characters of attribute values '
                 f"({SINK_CONTENT_MAX_CHARS}, and the content of capped spans).</p>")
    body = (head + kept + "<h2>Dialogue</h2>" + _dialogue(d.spans)
            + _rewards(d.spans)
            + "<h2>Tool calls</h2>" + (table(("tool", "status", "duration", "arguments", "result"), tools, "tools")
                                       if tools else '<p class="muted">No tool calls.</p>')
            + "<h2>Graders</h2>" + (table(("term", "outcome", "score", "duration", "message"), graders, "graders")
                                    if graders else '<p class="muted">No grader spans.</p>')
            + (f"<h2>Metrics</h2>{table(('span', 'name', 'value'), metrics, 'metrics')}" if metrics else "")
            + "<h2>Span tree</h2>" + table(("span", "kind", "status", "duration ms", "term", "outcome"), tree_rows, "tree")
            + f'<h2>Spans with their attributes</h2><div class="span-tree">{tree_html(tree.roots)}</div>{more}')
    return body, d.step, d.sample
