"""The span tree of a trajectory, without a store: rlpulse.sinks.views.trajectories.build_tree and
rlpulse.sinks.views.trajectory_html.tree_html."""

from __future__ import annotations

import re

from rlpulse.sinks.views.trajectories import SpanRow, build_tree
from rlpulse.sinks.views.trajectory_html import duration, key_attributes, tree_html

MS = 1_000_000


def span(sid: str, parent: str | None, start_ms: int, kind: str = "LLM", seq: int = 0, end_ms: int | None = None) -> SpanRow:
    return SpanRow(span_id=sid, parent_span_id=parent, name=f"n-{sid}", kind=kind, start_ns=start_ms * MS,
                   end_ns=(end_ms if end_ms is not None else start_ms + 10) * MS, sequence_id=seq)


def shape(roots: list[SpanRow]) -> list:
    """(span id, children) nested lists, in the order the tree holds them."""
    return [(s.span_id, shape(s.children)) for s in roots]


def test_children_by_parent_ordered_by_start_time_not_arrival() -> None:
    spans = [span("g2", "root", 50, seq=2), span("root", None, 0, "ROLLOUT", seq=9), span("g1", "root", 20, seq=1),
             span("t", "g1", 30, "TOOL", seq=3), span("t2", "g1", 30, "TOOL", seq=4)]  # t, t2: same start, seq decides
    tree = build_tree(spans)
    assert shape(tree.roots) == [("root", [("g1", [("t", []), ("t2", [])]), ("g2", [])])]
    assert (tree.shown, tree.not_shown, tree.orphans) == (5, 0, 0)


def test_orphans_hang_under_their_rollouts_entry_marked() -> None:
    spans = [span("root", None, 0, "ROLLOUT"), span("lost", "never-sent", 5), span("kid", "lost", 6)]
    tree = build_tree(spans)
    assert shape(tree.roots) == [("root", [("lost", [("kid", [])])])]
    lost = tree.roots[0].children[0]
    assert [s.orphan for s in (tree.roots[0], lost, lost.children[0])] == [False, True, False]
    assert tree.orphans == 1
    alone = build_tree([span("lost", "never-sent", 5)])  # no entry arrived either: at the root
    assert shape(alone.roots) == [("lost", [])] and alone.orphans == 1
    page = tree_html(tree.roots)
    assert 'data-span-id="lost" data-status="UNSET" data-orphan="true"' in page
    assert "parent never-sent not found" in page


def test_a_parent_cycle_is_cut_and_every_span_kept() -> None:
    spans = [span("a", "b", 0), span("b", "a", 5), span("c", "b", 7), span("self", "self", 9)]
    tree = build_tree(spans)
    ids = []
    stack = list(tree.roots)
    while stack:
        s = stack.pop()
        ids.append(s.span_id)
        stack.extend(s.children)
    assert sorted(ids) == ["a", "b", "c", "self"]
    assert tree.shown == 4 and tree.orphans == 2  # the cycle's cut span and the self-parent


def test_the_cap_keeps_the_first_spans_in_tree_order_and_counts_the_rest() -> None:
    spans = [span("root", None, 0, "ROLLOUT")] + [span(f"c{i:03}", "root", 1 + i) for i in range(10)]
    spans += [span(f"d{i}", "c000", 500 + i) for i in range(3)]  # late-starting grandchildren of the first child
    tree = build_tree(spans, cap=5, total=20)
    assert shape(tree.roots) == [("root", [("c000", [("d0", []), ("d1", []), ("d2", [])])])]
    assert (tree.shown, tree.not_shown) == (5, 15)  # 20 in the store, of which 14 were read
    tree = build_tree(spans, cap=500)
    assert (tree.shown, tree.not_shown) == (14, 0)


def test_a_deep_chain_renders_without_recursion() -> None:
    chain = [span("s0", None, 0)] + [span(f"s{i}", f"s{i - 1}", i) for i in range(1, 3000)]
    tree = build_tree(chain, cap=3000)
    page = tree_html(tree.roots)
    assert page.count("<details") == page.count("</details>") == 2999 and page.count('class="span leaf"') == 1


def test_key_attributes_and_escaping() -> None:
    grader = span("g", "r", 0, "GRADER")
    grader.typed = {"term": "judge", "outcome": "timeout", "score": 0.0, "judge_input_tokens": 120}
    grader.status, grader.status_message = "ERROR", "timeout"
    assert key_attributes(grader) == ["term judge", "outcome timeout", "score 0", "judge tokens 120 in / ? out",
                                      "message timeout"]
    llm = span("l", "r", 0, "LLM")
    llm.attributes = {"gen_ai.request.model": "qwen", "gen_ai.usage.input_tokens": "10",
                      "gen_ai.usage.output_tokens": "3"}
    assert key_attributes(llm) == ["model qwen", "tokens 10 in / 3 out"]
    tool = span("t", "r", 0, "TOOL")
    tool.name, tool.attributes = "<script>alert(1)</script>", {"tool.name": '"><img src=x>'}
    page = tree_html([tool])
    assert "<script>" not in page and "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "tool &quot;&gt;&lt;img src=x&gt;" in page
    assert re.search(r'<span class="dur">10\.0 ms</span>', page)


def test_durations() -> None:
    assert [duration(n) for n in (0, 1_234_567, 999_999_999, 2_500_000_000, -1)] == [
        "0.0 ms", "1.2 ms", "1.00 s", "2.50 s", "ends before it starts"]
