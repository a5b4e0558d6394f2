"""Issue 33, finding 3: bidi overrides, isolates and marks, zero-width and other invisible format characters
(and a terminal escape) in every text field of a trajectory's spans and of its run's steps, seeded into a real
chDB store, never reach a page raw: every page of ``rlpulse ui`` that shows them, read over HTTP, and
``rlpulse report --html``, show each as a visible escape (``\\u202e``). Every field goes through the one
escaping function (``rlpulse.sinks.views.html_escape.esc``)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from urllib.parse import quote

import pytest

from rlpulse.sinks.store.clickhouse import migrate, open_reader, open_store
from rlpulse.sinks.views import html_report
from rlpulse.sinks.views.ui_server import UiServer

pytestmark = [pytest.mark.integration, pytest.mark.full]

# The bidi controls (embeddings, overrides, isolates, marks), zero-width and invisible format characters
INVISIBLE = ("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"
             "\u200b\u200c\u200d\u2060\u2061\u2062\u2063\u2064\ufeff\u00ad\u180e\u034f"[:-1] + "\U000e0041\x1b\x07")
H = "<b>x" + INVISIBLE  # tagged too: the escaping as a whole, not only the invisibles
PROJECT, RUN, ROLLOUT, SAMPLE = "p" + H, "run" + H, "roll" + H, "sample" + H
MS = 1_000_000


def _span(t0: int, sid: str, parent: str | None, kind: str, seq: int, **extra: object) -> dict:
    row = {"project": PROJECT, "run_id": RUN, "attempt": 1, "stage": "st" + H, "writer_id": "w" + H,
           "trace_id": "tr" + H, "span_id": sid + H, "parent_span_id": None if parent is None else parent + H,
           "name": "name" + H, "kind": kind, "start_time_ns": t0 + seq * MS, "end_time_ns": t0 + (seq + 5) * MS,
           "status": "OK", "status_message": "msg" + H, "rollout_id": ROLLOUT, "attempt_id": "at" + H,
           "sequence_id": seq, "step": 0, "attributes": {"key" + H: "value" + H, "tool.name": "tool" + H},
           "sample_id": SAMPLE}
    row.update(extra)
    return row


def _seed(url: str) -> None:
    t0 = time.time_ns() - 600 * 10**9
    messages = json.dumps([{"role": "user", "content": "ask" + H},
                           {"role": "assistant" + H, "content": [{"type": "text", "text": "part" + H}],
                            "tool_calls": [{"id": "call" + H, "function": {"name": "fn" + H,
                                                                          "arguments": json.dumps({"a": H})}}]},
                           {"role": "tool", "tool_call_id": "call" + H, "content": "result" + H}])
    out = json.dumps([{"role": "assistant", "content": "reply" + H}])
    rows = [
        _span(t0, "R", None, "ROLLOUT", 1, reward=0.5, completion_tokens=10, max_tokens=100, clipped=False,
              status="ERROR", finish_reason="stop" + H),
        _span(t0, "L", "R", "LLM", 2, attributes={"gen_ai.input.messages": messages, "gen_ai.output.messages": out,
                                                   "gen_ai.request.model": "model" + H, "key" + H: "value" + H}),
        _span(t0, "T", "L", "TOOL", 3, attributes={"tool.name": "tool" + H, "gen_ai.tool.call.arguments": "args" + H,
                                                    "gen_ai.tool.call.result": "res" + H}),
        _span(t0, "G", "R", "GRADER", 4, term="term" + H, outcome="out" + H, score=0.1, status="ERROR"),
        _span(t0, "W", "R", "REWARD", 5, reward=0.7, attributes={"rlpulse.reward.name": "rname" + H}),
        _span(t0, "K", "R", "kind" + H, 6, status="status" + H),
        _span(t0, "O", "missing", "LLM", 7),  # an orphan: its parent's id is shown
    ]
    with open_store(url, owner="test") as store:
        migrate(store)
        columns = sorted({c for r in rows for c in r})
        store.client.insert(f"{store.database}.spans", [[r.get(c) for c in columns] for r in rows], column_names=columns)
        step_columns = ["project", "run_id", "attempt", "stage", "time_ns", "type", "trainer", "step", "step_count", "tokens",
                        "duration_s", "throughput", "writer_id", "sequence_id", "metrics"]
        store.client.insert(f"{store.database}.steps", [
            [PROJECT, RUN, 1, "st" + H, t0 + 10 * MS, "STEP", "tr" + H, 0, 1, 100, 1.0, 100.0, "w" + H, 1, {"loss" + H: 1.0}]],
            column_names=step_columns)


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"chdb://{tmp_path_factory.mktemp('invisible') / 'store'}"
    _seed(url)
    return url


def fetch(server: UiServer, path: str) -> tuple[int, str]:
    request = urllib.request.Request(server.url.rstrip("/") + path, headers={"Authorization": f"token {server.token}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def raw_in(page: str) -> list[str]:
    return [f"U+{ord(c):04X}" for c in INVISIBLE if c in page]


def test_no_invisible_character_reaches_a_page_raw(store_url: str) -> None:
    at = f"project={quote(PROJECT)}&run={quote(RUN)}&attempt=1"
    compared = quote(quote(PROJECT, safe="") + "/" + quote(RUN, safe="") + "/1", safe="")
    pages = {"runs": "/", "run": f"/run?{at}", "step": f"/step?{at}&step=0",
             "sample": f"/step?{at}&step=0&sample={quote(SAMPLE)}", "trajectory": f"/trajectory?{at}&rollout={quote(ROLLOUT)}",
             "search": f"/search?{at}", "search_text": f"/search?{at}&q=ask", "compare": f"/compare?run={compared}"}
    with UiServer(lambda: open_reader(store_url, owner="test"), store_url) as server:
        for name, path in pages.items():
            status, body = fetch(server, path)
            assert status == 200, (name, body[:500])
            assert not raw_in(body), (name, raw_in(body))
            assert "<b>x" not in body, name
            if name in ("step", "trajectory", "search"):
                assert "\\u202e" in body and "\\u200b" in body, name  # shown, visibly
        _, body = fetch(server, pages["trajectory"])
    # every field of the trajectory page is on it, escaped: name, attributes, status, kind, ids, content
    for field in ("name", "key", "value", "msg", "kind", "status", "tool", "args", "res", "term", "out", "ask", "part",
                  "call", "fn", "result", "reply", "model", "roll"):
        assert f"{field}&lt;b&gt;x\\u202a\\u202b" in body, field
    assert "\\U000e0041\\x1b\\x07" in body


def test_nor_the_report_page(store_url: str) -> None:
    with open_store(store_url, owner="test") as store:
        page = html_report.render(store, RUN, 1, 0, SAMPLE)
    assert not raw_in(page), raw_in(page)
    for field in ("name", "key", "value", "msg", "roll", "model"):
        assert f"{field}&lt;b&gt;x\\u202a" in page, field
