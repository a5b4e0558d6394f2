"""Drawing the trajectories of one sample at one step: the report page's "Trajectories" section.

``render_section`` returns it (native ``<details>``: no script); what it shows is read by
``rlpulse.sinks.views.trajectories.select``. Every text from the store goes through ``esc``.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views.html_escape import esc  # one escaping function for the whole page
from rlpulse.sinks.views.trajectories import (SAMPLE_LIST_CAP, SPAN_CAP, SpanRow, Trajectory, counted, sample_label,
                                        select)

OPEN_DEPTH = 3  # tree levels open when the page loads; deeper ones are a click away
LLM_MODEL_KEYS = ("gen_ai.response.model", "gen_ai.request.model", "llm.model_name", "model")
LLM_IN_KEYS = ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens", "llm.token_count.prompt",
               "llm.usage.prompt_tokens", "input_tokens", "prompt_tokens")
LLM_OUT_KEYS = ("gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens", "llm.token_count.completion",
                "llm.usage.completion_tokens", "output_tokens", "completion_tokens")
TOOL_KEYS = ("gen_ai.tool.name", "tool.name", "tool")
ATTRIBUTE_ROWS_CAP, ATTRIBUTE_VALUE_CAP = 50, 300


def duration(ns: int) -> str:
    if ns < 0:
        return "ends before it starts"
    ms = ns / 1e6
    return f"{ms:.1f} ms" if round(ms, 1) < 1000 else f"{ms / 1000:.2f} s"


def _first(attrs: dict[str, str], keys: Sequence[str]) -> str | None:
    return next((attrs[k] for k in keys if attrs.get(k, "") != ""), None)


def key_attributes(span: SpanRow) -> list[str]:
    """What a reader looks for first in a span of this kind."""
    t, a, out = span.typed, span.attributes, []
    if span.kind == "GRADER" or "term" in t:
        out += [f"term {t['term']}"] if "term" in t else []
        out += [f"outcome {t['outcome']}"] if "outcome" in t else []
        out += [f"score {t['score']:g}"] if "score" in t else []
        if "judge_input_tokens" in t or "judge_output_tokens" in t:
            out.append(f"judge tokens {t.get('judge_input_tokens', '?')} in / {t.get('judge_output_tokens', '?')} out")
    if span.kind == "LLM":
        model, tin, tout = _first(a, LLM_MODEL_KEYS), _first(a, LLM_IN_KEYS), _first(a, LLM_OUT_KEYS)
        out += [f"model {model}"] if model else []
        if tin or tout:
            out.append(f"tokens {tin or '?'} in / {tout or '?'} out")
    if span.kind == "TOOL":
        tool = _first(a, TOOL_KEYS)
        out += [f"tool {tool}"] if tool else []
    if "reward" in t:
        out.append(f"reward {t['reward']:g}")
    if "completion_tokens" in t:
        out.append(f"completion tokens {t['completion_tokens']}"
                   + (f" / {t['max_tokens']}" if "max_tokens" in t else ""))
    if t.get("clipped"):
        out.append("clipped")
    if span.status_message:
        out.append(f"message {span.status_message}")
    return out


def _line(span: SpanRow) -> str:
    keys = " · ".join(key_attributes(span))
    orphan = (f' <span class="orphan">parent {esc(span.parent_span_id)} not found</span>'
              if span.orphan else "")
    return (f'<span class="kind">{esc(span.kind)}</span> <span class="name">{esc(span.name)}</span> '
            f'<span class="dur">{esc(duration(span.end_ns - span.start_ns))}</span> '
            f'<span class="status status-{esc(span.status)}">{esc(span.status)}</span>'
            + (f' <span class="keys">{esc(keys)}</span>' if keys else "") + orphan)


def _attribute_table(span: SpanRow) -> str:
    items = sorted(span.attributes.items())
    if not items:
        return ""
    rows = "".join(f"<tr><td>{esc(k)}</td><td>{esc(v[:ATTRIBUTE_VALUE_CAP])}"
                   f"{'…' if len(v) > ATTRIBUTE_VALUE_CAP else ''}</td></tr>" for k, v in items[:ATTRIBUTE_ROWS_CAP])
    extra = len(items) - ATTRIBUTE_ROWS_CAP
    more = f"<tr><td colspan=2>{extra} more</td></tr>" if extra > 0 else ""
    return f'<table class="attributes">{rows}{more}</table>'


def tree_html(roots: Sequence[SpanRow]) -> str:
    """Nested <details class="span"> (a span with children or attributes) or <div class="span leaf">;
    iterative, so a deep chain cannot hit Python's recursion limit."""
    parts: list[str] = []
    stack: list[tuple[SpanRow, int] | str] = [(r, 0) for r in reversed(roots)]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            parts.append(item)
            continue
        span, depth = item
        data = (f'data-kind="{esc(span.kind)}" data-span-id="{esc(span.span_id)}" data-status="{esc(span.status)}"'
                + (' data-orphan="true"' if span.orphan else ""))
        table = _attribute_table(span)
        if not span.children and not table:
            parts.append(f'<div class="span leaf" {data}>{_line(span)}</div>')
            continue
        parts.append(f'<details class="span" {data}{" open" if depth < OPEN_DEPTH else ""}>'
                     f"<summary>{_line(span)}</summary>{table}")
        stack.append("</details>")
        stack.extend((c, depth + 1) for c in reversed(span.children))
    return "".join(parts)


def _status(rollout: SpanRow) -> str:
    return rollout.status + (", clipped" if rollout.typed.get("clipped") else "")


def _reward(t: Trajectory) -> str:
    return "none" if t.reward is None else f"{t.reward:g}"


def render_section(store: Store, run: str, attempt: int, step: int | None = None, sample: str | None = None,
                   cap: int = SPAN_CAP) -> str:
    """The "Trajectories" <section> of the report page."""
    sel = select(store, run, attempt, step, sample, cap)
    head = f'<section id="trajectories"><h2>Trajectories</h2><p class="choice">{esc(sel.note)}</p>'
    if sel.step is None:
        return head + "</section>"
    others = [f"{sample_label(s)} ({n})" for s, n in sel.samples if s != sel.sample]
    listed = ", ".join(others[:SAMPLE_LIST_CAP]) + (f", and {len(others) - SAMPLE_LIST_CAP} more"
                                                     if len(others) > SAMPLE_LIST_CAP else "")
    other = (f'<p class="other-samples">Other samples of step {sel.step} (rollouts): {esc(listed)}</p>'
             if others else "")
    rows = "".join(
        f'<tr class="trajectory-row" data-rollout="{esc(t.key)}"><td>{esc(t.key)}</td><td class="reward">'
        f'{esc(_reward(t))}</td><td class="status">{esc(_status(t.rollout))}</td>'
        f'<td>{esc(t.rollout.typed.get("completion_tokens", ""))}</td><td>{t.tree.shown + t.tree.not_shown}</td></tr>'
        for t in sel.trajectories)
    table = ('<table class="trajectories"><tr><th>rollout</th><th>reward</th><th>status</th>'
             f"<th>completion tokens</th><th>spans</th></tr>{rows}</table>")
    blocks = []
    for t in sel.trajectories:
        notes = []
        if t.tree.orphans:
            notes.append(f"{t.tree.orphans} span(s) whose parent is missing are shown under the rollout")
        if t.tree.not_shown:
            notes.append(f"{t.tree.not_shown} more not shown (the first {t.tree.shown} in tree order are)")
        note = "".join(f'<p class="tree-note">{esc(n)}</p>' for n in notes)
        summary = (f"rollout {t.key} · reward {_reward(t)} · {_status(t.rollout)}"
                   + (f" · {t.rollout.typed['completion_tokens']} completion tokens"
                      if "completion_tokens" in t.rollout.typed else ""))
        blocks.append(f'<details class="trajectory" data-rollout="{esc(t.key)}" open><summary>{esc(summary)}'
                      f"</summary>{note}{tree_html(t.tree.roots)}</details>")
    more = (f'<p class="tree-note">{sel.more_trajectories} more trajectories of this sample not shown</p>'
            if sel.more_trajectories else "")
    count = counted(len(sel.trajectories), "trajectory", "trajectories")
    title = f"<h3>Step {sel.step}, sample {esc(sample_label(sel.sample))}: {count}</h3>"
    return head + other + title + table + more + "".join(blocks) + "</section>"


CSS = """
details.span, div.span { margin-left: 18px; font-size: 13px; line-height: 1.6; }
div.span.leaf { padding-left: 14px; }
details.trajectory { border-top: 1px solid #eee; padding: 4px 0; }
details.trajectory > summary { font-weight: bold; }
.kind { display: inline-block; min-width: 64px; font-family: monospace; color: #555; }
.dur { color: #1f77b4; } .keys { color: #666; } .orphan { color: #d62728; font-style: italic; }
.status-ERROR { color: #d62728; font-weight: bold; } .status-OK { color: #2ca02c; }
table.trajectories td, table.trajectories th { padding: 2px 10px; text-align: left; }
table.attributes { margin-left: 36px; font-size: 12px; color: #555; }
"""
