"""``rlpulse ui``'s server against the findings of issue 33: slow clients cannot hold every slot from the
owner, the token never reaches the log, a redirect stays on the page's own origin, and a Host the server
does not answer to (DNS rebinding) is refused before anything else (rlpulse.sinks.views.ui_server)."""

from __future__ import annotations

import http.client
import logging
import socket
import time

import pytest

from rlpulse.sinks.views.ui_server import MAX_CONNECTIONS, UiServer
from tests.slowloris import Drip
from tests.unit.sinks.views.test_ui_server import TOKEN, _Client, _Store, auth, get

pytestmark = pytest.mark.full


@pytest.fixture
def ui():
    client = _Client()
    with UiServer(lambda: _Store(client), "chdb:///nowhere", port=0, token=TOKEN) as server:
        yield server


def timed_get(server: UiServer, path: str, headers: dict[str, str]) -> tuple[int, float]:
    started = time.monotonic()
    status, _, _ = get(server, path, headers)
    return status, time.monotonic() - started


def test_slow_clients_on_every_slot_leave_the_owner_served(ui: UiServer) -> None:
    """Finding 1: 16 connections (and more, into the reserve) sending one header byte every 2 s. The owner's
    request with its token is answered at once; an anonymous one over the cap gets 503; each slow
    connection is closed by the arrival deadline (10 s for the whole request), however it drips."""
    with Drip(ui.address, MAX_CONNECTIONS + 12, every=2.0) as slow:
        time.sleep(3)  # every one accepted, each well into its request
        for headers in (auth(ui), {"Authorization": f"token {TOKEN}"}):
            status, took = timed_get(ui, "/ui.css", headers)
            assert status == 200 and took < 2, (status, took)
        status, took = timed_get(ui, f"/ui.css?token={TOKEN}", {})
        assert status == 303 and took < 2, (status, took)
        assert get(ui, "/ui.css")[0] == 503  # no token, over the cap: busy, not served
        deadline = time.monotonic() + 15
        while slow.open_count() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert slow.open_count() == 0, slow.closed_at
        held = [c for c in slow.closed_at if c is not None]
        assert max(held) < 10 + 2.5, held  # the arrival deadline, never the 30 s idle timeout per read


def test_a_connection_that_sends_nothing_is_closed_at_the_idle_timeout_not_before(ui: UiServer) -> None:
    """Keep-alive stays as it was: a silent connection waits for its request (the idle timeout), and a whole
    request that arrives in time is answered, however it was split."""
    with socket.create_connection(ui.address, timeout=20) as s:
        request = f"GET /ui.css HTTP/1.1\r\nHost: 127.0.0.1\r\nCookie: {ui.cookie}={TOKEN}\r\n\r\n".encode()
        time.sleep(3)
        for i in range(0, len(request), 20):
            s.sendall(request[i:i + 20])
            time.sleep(0.05)
        assert s.recv(100).startswith(b"HTTP/1.1 200 ")


def test_too_many_or_too_large_headers_are_431(ui: UiServer) -> None:
    many = {f"X-H{i}": "v" for i in range(80)}
    assert get(ui, "/ui.css", {**auth(ui), **many})[0] == 431
    assert get(ui, "/ui.css", {**auth(ui), "X-Big": "b" * 40_000})[0] == 431
    assert get(ui, "/ui.css", auth(ui))[0] == 200


def test_the_token_never_reaches_the_verbose_log(ui: UiServer, caplog: pytest.LogCaptureFixture) -> None:
    """Finding 2: the request line (``?token=...``) is logged with the token masked, in whichever spelling."""
    caplog.set_level(logging.DEBUG, logger="rlpulse.sinks.views.ui_server")
    for path in (f"/run?project=p&token={TOKEN}&run=r", f"/?%74oken={TOKEN}", f"/?token={TOKEN[:5]}%{ord(TOKEN[5]):02X}"
                 f"{TOKEN[6:]}", "/" + TOKEN):
        get(ui, path)
    with socket.create_connection(ui.address, timeout=5) as s:  # a malformed request line, logged as an error
        s.sendall(f"GET /?token={TOKEN} junk HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        assert s.recv(100).startswith(b"HTTP/1.1 400 ")
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "GET /run?project=p&token=***&run=r" in text, text
    assert TOKEN not in text and TOKEN[6:] not in text, text


@pytest.mark.parametrize("path, expected", [
    ("/\\evil.example/", "/"), ("//evil.example/", "/evil.example/"), ("/\\/evil.example", "/"),
    ("/%09/evil.example", "/%09/evil.example"),
    ("/run", "/run"), ("/run/\\x", "/run/\\x"),
])
def test_the_redirect_after_the_token_stays_on_this_origin(ui: UiServer, path: str, expected: str) -> None:
    """Finding 4: ``GET /\\evil.example/?token=x`` was answered ``Location: /\\evil.example/``, which a browser
    reads as ``//evil.example/``. Only a path that starts with one ``/`` (not ``//`` or ``/\\``) is kept."""
    status, headers, _ = get(ui, f"{path}?token={TOKEN}", auth(ui))
    assert status == 303 and headers["location"] == expected, (status, headers)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:1234", "127.0.0.1.evil.example", "localhost.evil.example",
                                  "127.0.0.1@evil.example", "10.0.0.1"])
def test_a_foreign_host_header_is_refused_before_anything_else(ui: UiServer, host: str) -> None:
    """Finding 5 (DNS rebinding): a page of evil.example whose name now points at 127.0.0.1 reaches the port, but
    its requests name evil.example: 403 before the token is even looked at, and nothing set."""
    for path, headers in (("/ui.css", auth(ui)), (f"/?token={TOKEN}", {})):
        status, got, body = get(ui, path, {"Host": host, **headers})
        assert status == 403 and "set-cookie" not in got and "Host" in body, (host, status, body)


def test_the_names_of_this_machine_are_answered(ui: UiServer) -> None:
    port = ui.address[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"LOCALHOST:{port}", f"[::1]:{port}",
                 f"127.0.0.2:{port}"):
        assert get(ui, "/ui.css", {"Host": host, **auth(ui)})[0] == 200, host
    conn = http.client.HTTPConnection(*ui.address, timeout=5)  # two Host headers: refused
    conn.putrequest("GET", "/ui.css", skip_host=True)
    conn.putheader("Host", "127.0.0.1")
    conn.putheader("Host", "evil.example")
    conn.putheader("Cookie", f"{ui.cookie}={TOKEN}")
    conn.endheaders()
    assert conn.getresponse().status == 403
    conn.close()


def test_an_allowlist_for_a_server_bound_elsewhere() -> None:
    client = _Client()
    with UiServer(lambda: _Store(client), "x", port=0, token=TOKEN, allowed_hosts=("ui.lab.example",)) as server:
        assert get(server, "/ui.css", {"Host": "ui.lab.example:8421", **auth(server)})[0] == 200
        assert get(server, "/ui.css", {"Host": "other.lab.example", **auth(server)})[0] == 403
