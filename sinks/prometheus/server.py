"""The scrape endpoint: ``GET /metrics`` only, bounded as the sink's read endpoint is.

The standard library's server under ``BoundedHTTPServer`` (``rlpulse.base.bounded_http``): at most
``MAX_CONNECTIONS`` open connections for anyone and a few more for requests with the token (anything
else over the cap is answered 503), a request's line and headers must arrive within 10 s of its first
byte, a silent connection is closed after ``IDLE_TIMEOUT``, no request body is ever read (a request
that announces one has its connection closed after the answer). With a token (required off loopback),
the ``Authorization: Bearer`` header is compared with ``hmac.compare_digest`` before anything else:
the path, the method, the store. Without one (loopback), a request whose ``Host`` is not loopback's
(a page of another site re-pointed at 127.0.0.1: DNS rebinding) is refused 403, so a browser cannot
read the figures for a site. The token is never logged; a refused request is one debug line without it.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST

from rlpulse.sinks.prometheus.collector import Scraper
from rlpulse.base.bounded_http import BoundedHandler, BoundedHTTPServer, ServedServer

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
PORT = 9464  # OpenTelemetry's Prometheus exporter's default
MAX_CONNECTIONS = 16
IDLE_TIMEOUT = 30  # seconds a connection may stay silent
MIN_TOKEN = 16  # characters
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses; a name or any other address is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_token(host: str, token: str | None, env_name: str) -> str | None:
    """The token to require: ValueError when binding off loopback without one, or with a short one."""
    token = token or None
    if token is None and not is_loopback(host):
        raise ValueError(f"--host {host} is not loopback: set {env_name} to a bearer token "
                         f"(at least {MIN_TOKEN} characters) that Prometheus sends (authorization: credentials)")
    if token is not None and (len(token) < MIN_TOKEN or any(c.isspace() or not c.isprintable() for c in token)):
        raise ValueError(f"{env_name} must be at least {MIN_TOKEN} printable characters without spaces")
    return token


class _Handler(BoundedHandler):
    protocol_version = "HTTP/1.1"
    server_version = "rlpulse-prometheus"
    timeout = IDLE_TIMEOUT
    scraper: Scraper  # set on the subclass made per server
    token: str | None

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        # the request line holds no token (it travels in a header); still, debug only
        log.debug("prometheus: " + format, *args)

    def vouched(self) -> bool:  # a reserved slot: the token, or anyone where none is asked
        return self._authorized()

    def _authorized(self) -> bool:
        if self.token is None:
            return True
        scheme, _, given = self.headers.get("Authorization", "").partition(" ")
        ok = hmac.compare_digest(given.strip().encode(errors="replace"), self.token.encode())
        return ok and scheme.lower() == "bearer"

    def _refuse_body(self) -> None:
        if self.headers.get("Content-Length", "0").strip() not in ("", "0") or "Transfer-Encoding" in self.headers:
            self.close_connection = True  # the body is not read: the next request cannot be found after it

    def do_GET(self) -> None:  # noqa: N802
        self._refuse_body()
        if not self._authorized():
            return self._unauthorized()
        if urlsplit(self.path).path != "/metrics":
            return self._send(404, b"not found: the figures are at /metrics\n")
        try:
            body = self.scraper.scrape()
        except Exception as exc:  # store busy or gone, a query over its limit: Prometheus marks the target down
            log.warning("prometheus: scrape failed: %s", str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
            return self._send(503, f"scrape failed: {type(exc).__name__}; see rlpulse prometheus's log\n".encode())
        self._send(200, body, CONTENT_TYPE_LATEST)

    def _other(self) -> None:
        self._refuse_body()
        self.close_connection = True
        if not self._authorized():
            return self._unauthorized()
        self._send(405, b"only GET /metrics\n", headers={"Allow": "GET"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = _other  # noqa: N815

    def _unauthorized(self) -> None:
        self.close_connection = True
        log.debug("prometheus: refused %s without a valid bearer token", self.client_address[0])
        self._send(401, b"401 unauthorized: send Authorization: Bearer <token>\n", headers={"WWW-Authenticate": "Bearer"})

    def _send(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in {"Content-Type": content_type, "Cache-Control": "no-store",
                            "X-Content-Type-Options": "nosniff", **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


class PrometheusServer(ServedServer):
    """The scrape endpoint (``start``/``close``, or ``serve_forever``)."""

    thread_name = "rlpulse-prometheus"

    def __init__(self, scraper: Scraper, host: str = HOST, port: int = PORT, token: str | None = None,
                 max_connections: int = MAX_CONNECTIONS):
        handler = type("Handler", (_Handler,), {"scraper": scraper, "token": token})
        # With a token, rebinding gains nothing (a page cannot send it), and Prometheus may name the host as it likes
        self._server = BoundedHTTPServer((host, port), handler, max_connections, _BUSY, "prometheus",
                                         check_host=token is None)
        self.address: tuple[str, int] = self._server.server_address[:2]  # type: ignore[assignment]
        shown = f"[{self.address[0]}]" if ":" in self.address[0] else self.address[0]
        self.url = f"http://{shown}:{self.address[1]}/metrics"
