"""``rlpulse.base.bounded_http``'s helpers: which Host names a server answers (DNS rebinding), and the
masking of credentials in a logged request line (issue 33)."""

from __future__ import annotations

import http.server

import pytest

from rlpulse.base.bounded_http import BoundedHTTPServer, mask_secrets

pytestmark = pytest.mark.full


@pytest.mark.parametrize("bound, extra, allowed, refused", [
    ("127.0.0.1", (), ["127.0.0.1:8421", "127.0.0.1", "localhost:1", "LocalHost", "[::1]:8421", "127.9.9.9", "localhost."],
     ["evil.example", "127.0.0.1.evil.example", "evil.example:8421", "10.0.0.1:8421", "", ":8421", "a b", "127.0.0.1@evil",
      "[::1", "localhost:99999999", "localhost:x", "host/path", "127.0.0.1\\evil"]),
    ("0.0.0.0", ("ui.lab.example",), ["10.0.0.1:8421", "[fe80::1]:8421", "UI.lab.example:8421", "localhost"],
     ["evil.example", "lab.example"]),
])
def test_the_host_names_a_server_answers(bound: str, extra: tuple[str, ...], allowed: list[str],
                                         refused: list[str]) -> None:
    server = BoundedHTTPServer((bound, 0), http.server.BaseHTTPRequestHandler, 1, b"", "t", check_host=True,
                               allowed_hosts=extra)
    try:
        assert server.host_allowed(None)  # no Host: never a browser
        assert [h for h in allowed if not server.host_allowed(h)] == []
        assert [h for h in refused if server.host_allowed(h)] == []
    finally:
        server.server_close()


def test_credentials_in_a_request_line_are_masked() -> None:
    line = '"GET /run?project=p&token=s3cret&run=r HTTP/1.1" 303 -'
    assert mask_secrets(line, ("token",)) == '"GET /run?project=p&token=***&run=r HTTP/1.1" 303 -'
    assert mask_secrets("GET /?%74oken=s3cret&TOKEN=x", ("token",)) == "GET /?%74oken=***&TOKEN=***"
    assert mask_secrets("GET /?query=1&password=pw HTTP/1.1", ("password",)) == "GET /?query=1&password=*** HTTP/1.1"
    assert mask_secrets("Bad request ('GET /s3cr%2Fet/x')", (), ("s3cr/et",)) == "Bad request ('GET /***/x')"
    assert mask_secrets("GET /?tokens=1&mytoken=2", ("token",)) == "GET /?tokens=1&mytoken=2"
