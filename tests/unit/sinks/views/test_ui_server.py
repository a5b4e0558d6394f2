"""``rlpulse ui``'s server without a store: the token before anything else, the headers every answer
carries, URL parameters parsed and refused, and hostile values drawn as text (rlpulse.sinks.views.ui_server)."""

from __future__ import annotations

import http.client
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import pytest

from rlpulse.sinks.views import ui_charts
from rlpulse.sinks.views.ui_data import Group, Rollout, exp_quantile, step_at
from rlpulse.sinks.views.ui_detail import StepView, _group, _message
from rlpulse.sinks.views.ui_html import href, num, page, text
from rlpulse.sinks.views.ui_routes import BadParameter, integer
from rlpulse.sinks.views.ui_server import CSP, UiServer

TOKEN = "unit-test-token-0123456789"
HOSTILE = "<img src=x onerror=alert(1)>\x1b[2J\x07"


@dataclass
class _Answer:
    result_rows: list = field(default_factory=list)
    column_names: list = field(default_factory=list)


class _Client:
    """Answers every query with no rows, and remembers the parameters it was given."""

    def __init__(self) -> None:
        self.params: list[dict[str, Any]] = []

    def query(self, sql: str, parameters: dict[str, Any] | None = None, settings: Any = None) -> _Answer:
        self.params.append(dict(parameters or {}))
        return _Answer()


@dataclass
class _Store:
    client: _Client
    database: str = "rlpulse"
    url: str = "chdb:///nowhere"

    def __enter__(self) -> _Store:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.fixture
def ui():
    client = _Client()
    opened: list[int] = []

    def opener() -> _Store:
        opened.append(1)
        return _Store(client)

    with UiServer(opener, "chdb:///nowhere", port=0, token=TOKEN) as server:
        server.opened, server.client = opened, client  # type: ignore[attr-defined]
        yield server


def get(server: UiServer, path: str, headers: dict[str, str] | None = None, method: str = "GET",
        body: bytes | None = None) -> tuple[int, dict[str, str], str]:
    conn = http.client.HTTPConnection(*server.address, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        answer = conn.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read().decode()
    finally:
        conn.close()


def auth(server: UiServer) -> dict[str, str]:
    return {"Cookie": f"{server.cookie}={TOKEN}"}


def test_binds_loopback_and_prints_a_token_url(ui: UiServer) -> None:
    assert ui.address[0] == "127.0.0.1"
    assert ui.token_url == f"http://127.0.0.1:{ui.address[1]}/?token={TOKEN}"
    assert len(UiServer(lambda: None, "x", port=0).token) >= 40  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize("headers", [{}, {"Cookie": "rlpulse-ui-1=nope"}, {"Authorization": "token wrong"},
                                     {"Authorization": f"Basic {TOKEN}"}])
def test_without_the_token_403_and_no_data(ui: UiServer, headers: dict[str, str]) -> None:
    for path in ("/", "/run?project=p&run=r", "/ui.css", "/nothing", "/?token=wrong"):
        status, got, body = get(ui, path, headers)
        assert status == 403, path
        assert "rlpulse ui" in body and "<" not in body
    assert ui.opened == []  # type: ignore[attr-defined]  # the store was never touched


def test_the_token_in_the_url_becomes_a_cookie_and_leaves_the_url(ui: UiServer) -> None:
    status, headers, _ = get(ui, f"/run?project=p&token={TOKEN}&run=r")
    assert status == 303
    assert headers["location"] == "/run?project=p&run=r"
    assert headers["set-cookie"] == f"{ui.cookie}={TOKEN}; Path=/; HttpOnly; SameSite=Strict"
    status, _, css = get(ui, "/ui.css", auth(ui))
    assert status == 200 and "section.group" in css
    assert get(ui, "/ui.css", {"Authorization": f"token {TOKEN}"})[0] == 200


def test_every_answer_carries_a_strict_policy(ui: UiServer) -> None:
    for path, headers in (("/", {}), ("/ui.css", auth(ui)), ("/nothing", auth(ui))):
        _, got, _ = get(ui, path, headers)
        assert got["content-security-policy"] == CSP
        assert got["x-content-type-options"] == "nosniff" and got["referrer-policy"] == "no-referrer"
    assert "default-src 'self'" in CSP and "script-src 'none'" in CSP


def test_only_reads(ui: UiServer) -> None:
    assert get(ui, "/", method="POST", body=b"x")[0] == 403
    status, headers, _ = get(ui, "/", auth(ui), method="POST", body=b"x")
    assert (status, headers["allow"]) == (405, "GET, HEAD")
    assert get(ui, "/" + "a" * 9000, auth(ui))[0] == 414
    assert get(ui, "/" + "a" * 9000)[0] == 403


@pytest.mark.parametrize("path, why", [
    ("/step?project=p&run=r&attempt=1&step=abc", "step: expected a whole number"),
    ("/step?project=p&run=r&attempt=-1&step=1", "attempt: expected a number from 0"),
    ("/step?project=p&run=r&attempt=1&step=1&sort=evil", "sort: one of"),
    ("/step?project=p&run=r&attempt=1&step=1&min_reward=nan", "min_reward: expected a finite number"),
    ("/trajectory?project=p&run=r&attempt=1", "the URL needs rollout="),
    ("/run?project=p", "the URL needs run="),
    ("/run?project=p&run=r&refresh=1", "refresh: expected a number from 5"),
])
def test_bad_parameters_are_400_with_what_was_expected(ui: UiServer, path: str, why: str) -> None:
    status, _, body = get(ui, path, auth(ui))
    assert status == 400 and why in body.replace("&#x27;", "'")


def test_a_hostile_run_id_comes_back_as_text(ui: UiServer) -> None:
    status, _, body = get(ui, "/run?project=p&run=" + quote(HOSTILE), auth(ui))
    assert status == 404
    assert "<img" not in body and "\x1b" not in body
    assert "&lt;img src=x onerror=alert(1)&gt;\\x1b[2J\\x07" in body
    assert {"p": "p", "r": HOSTILE} in ui.client.params  # type: ignore[attr-defined]  # a parameter, never SQL text


def test_unknown_pages_are_404(ui: UiServer) -> None:
    assert get(ui, "/etc/passwd", auth(ui))[0] == 404


def test_text_href_and_numbers() -> None:
    assert text(HOSTILE) == "&lt;img src=x onerror=alert(1)&gt;\\x1b[2J\\x07"
    assert text('"quoted"') == "&quot;quoted&quot;"
    assert href("/step", [("run", "a&b c"), ("sample", None), ("step", 3)]) == "/step?run=a%26b+c&amp;step=3"
    assert (num(0.123456), num(1.0), num(None), num(3), num(True), num(-0.00001)) == ("0.1235", "1", "–", "3", "yes", "0")
    with pytest.raises(BadParameter):
        integer({"step": ["1e3"]}, "step")


def test_refresh_is_a_meta_tag_not_a_script() -> None:
    assert '<meta http-equiv="refresh" content="30">' in page("t", [], "", "s", 0, refresh=30)
    assert "http-equiv" not in page("t", [], "", "s", 0)


def test_a_hostile_page_title_group_message_and_chart() -> None:
    doc = page(HOSTILE, [(HOSTILE, None)], "", HOSTILE, 0)
    assert "<img" not in doc and "\x1b" not in doc
    rollout = Rollout(HOSTILE, HOSTILE, 0.5, "ERROR", HOSTILE, False, 3, HOSTILE, [(HOSTILE, "timeout", None)], 2)
    card = _group(StepView("p", HOSTILE, 1, 0), Group(HOSTILE, [rollout]))
    message = _message({"role": HOSTILE, "content": HOSTILE, "tool_calls": [{"id": HOSTILE, "function": {
        "name": HOSTILE, "arguments": HOSTILE}}]})
    chart = ui_charts.lines("c", HOSTILE, ui_charts.Axis(0, 1), {HOSTILE: [(0, 1.0), (1, 2.0)]})
    for html in (card, message, chart):
        assert "<img" not in html and "\x1b" not in html and "\x07" not in html, html
    links = re.findall(r'href="([^"]*)"', card)
    assert links and all(link.startswith("/") for link in links)


def test_step_axis_and_length_percentiles() -> None:
    marks = [(100, 0), (200, 1), (400, 2)]
    assert [step_at(marks, t) for t in (50, 100, 150, 300, 400, 900)] == [0.0, 0.0, 0.5, 1.5, 2.0, 2.0]
    # scale 0: bucket i holds (2**i, 2**(i+1)]; 4 values: 0, 3, 5, 9 -> zero, bucket 1, bucket 2, bucket 3
    args = (0, 1, 1, [1, 1, 1], 4, 0.0, 9.0)
    assert [exp_quantile(q, *args) for q in (0.25, 0.5, 0.75, 1.0)] == [0.0, 2 ** 1.5, 2 ** 2.5, 9.0]
