"""``rlpulse ui``: a local, read-only web page of the runs, a run, a step's samples and a trajectory.

The server is the standard library's ``ThreadingHTTPServer``, bounded as the sink's read endpoint
is (``rlpulse.base.bounded_http``): at most ``MAX_CONNECTIONS`` open connections for anyone and a few
more reserved for requests that carry the token (anything else over the cap is answered 503), a
request's line and headers must arrive within 10 s of its first byte (a client dripping a byte at a time
is cut off then), a silent connection is closed after ``IDLE_TIMEOUT``, a request line over ``MAX_URL``
is refused, a request with a body is refused unread (the page only reads: GET and HEAD). A request
whose ``Host`` is not this machine's loopback name or address, the bound address or one of
``allowed_hosts`` is answered 403 before anything else (DNS rebinding). Pages are server-rendered HTML with inline SVG charts
(``rlpulse.sinks.views.ui_charts``): no script at all, and the Content-Security-Policy says so.

Authentication comes before anything else, as in Jupyter: the server draws a token
(``secrets.token_urlsafe``, or ``RLPULSE_UI_TOKEN``) and prints ``http://127.0.0.1:PORT/?token=...``.
A request carries it in ``?token=`` (answered with a cookie for this port, HttpOnly and
SameSite=Strict, and a redirect to the same URL without it, so a shared link never holds it), the
cookie, or an ``Authorization: token ...`` header; it is compared in constant time. Anything else
gets 403 and no data. The redirect goes to a path of this server only (``/\\evil.example/`` goes to
``/``), and the ``--verbose`` log writes request lines with the token masked. It binds 127.0.0.1 unless
told otherwise.

Each request reads through ``rlpulse.sinks.store.clickhouse.open_reader``, as ``rlpulse query`` and
``rlpulse watch`` do: a chDB store held by the sink is read through the sink's read endpoint, a free
one is opened for the request only (so a sink can start meanwhile; chDB lets one process hold it),
a server is a ClickHouse client. One request reads at a time (chDB opens a store once per process).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

from rlpulse.base.bounded_http import BoundedHandler, BoundedHTTPServer, ServedServer, mask_secrets
from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views.ui_html import CSS, REFRESH, error_page, keep_refresh, page
from rlpulse.sinks.views.ui_routes import REFRESH_MIN, BadParameter, integer, route
from rlpulse.sinks.views.ui_pages import NotFound

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
MAX_URL = 8192  # a page's URL holds a few ids and filters
MAX_FIELDS = 64  # query-string fields parsed at most
MAX_CONNECTIONS = 16
IDLE_TIMEOUT = 30  # seconds a connection may stay silent
READ_WAIT = 30  # seconds a request waits for the store while another one reads it
CSP = ("default-src 'self'; script-src 'none'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
       "form-action 'self'; img-src 'self' data:")
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def same_origin(path: str) -> str:
    """``path`` if it is a path of this server (one ``/``, then not ``/`` or ``\\``, which browsers read as another
    host: ``/\\evil.example/`` is ``//evil.example/``; no control character or space); otherwise ``/``."""
    if not path.startswith("/") or path[1:2] in ("/", "\\") or any(c <= " " or "\x7f" <= c <= "\x9f" for c in path):
        return "/"
    return path


class _Handler(BoundedHandler):
    protocol_version = "HTTP/1.1"
    server_version = "rlpulse-ui"
    timeout = IDLE_TIMEOUT
    ui: UiServer  # set on the subclass made per server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        # the request line may hold ?token=...: masked, in any spelling of the key, and the token anywhere
        log.debug("ui: %s", mask_secrets(format % args, ("token",), (self.ui.token,)))

    def vouched(self) -> bool:
        """The request carries the token (URL, cookie or header): it may take a reserved slot."""
        given = ""
        if len(self.path) <= MAX_URL:
            try:
                given = parse_qs(urlsplit(self.path).query, max_num_fields=MAX_FIELDS).get("token", [""])[0]
            except ValueError:
                pass
        return self._authenticated(given)

    def refuse_host(self) -> None:
        self.close_connection = True
        self._send(403, b"403 forbidden: the page answers requests for 127.0.0.1, localhost or the address it is bound "
                        b"to, or a name it was given (the Host header named another)\n",
                   "text/plain; charset=utf-8", head=self.command == "HEAD")

    def do_GET(self) -> None:  # noqa: N802
        self._serve(head=False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(head=True)

    def _refuse_method(self) -> None:
        if not self._authenticated(parse_qs(urlsplit(self.path).query).get("token", [""])[0]):
            return self._forbidden()
        self.close_connection = True  # its body, if any, is not read
        self._send(405, b"the page only reads: GET and HEAD\n", "text/plain; charset=utf-8", {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method  # noqa: N815

    def _serve(self, head: bool) -> None:
        try:
            self._handle(head)
        except (ConnectionError, TimeoutError):
            self.close_connection = True
        except Exception as exc:  # a bug: one log line, a page without details, never a traceback to the browser
            log.warning("ui: %s failed: %s", urlsplit(self.path).path[:80], type(exc).__name__)
            log.debug("ui: failure", exc_info=True)
            self.close_connection = True
            self._html(500, error_page(500, f"the page could not be built ({type(exc).__name__}); see the ui's log",
                                       time.time_ns()), head)

    def _handle(self, head: bool) -> None:
        if len(self.path) > MAX_URL:  # not parsed: the cookie or header must carry the token
            if not self._authenticated(""):
                return self._forbidden()
            self.close_connection = True
            self._send(414, b"URL too long\n", "text/plain; charset=utf-8")
            return
        url = urlsplit(self.path)
        try:
            query = parse_qs(url.query, keep_blank_values=True, strict_parsing=False, max_num_fields=MAX_FIELDS)
        except ValueError:
            query = {}
            if not self._authenticated(""):
                return self._forbidden()
            self._html(400, error_page(400, "too many URL parameters", time.time_ns()), head)
            return
        given = query.pop("token", [""])[0]
        if not self._authenticated(given):
            return self._forbidden()
        if self.headers.get("Content-Length", "0").strip() not in ("", "0") or "Transfer-Encoding" in self.headers:
            self.close_connection = True  # a GET's body is not read: the next request cannot be found after it
        if given:  # the token in the URL: into a cookie, and off the address bar (a link shared later holds none)
            clean = same_origin(url.path) + ("?" + urlencode([(k, v) for k, vs in query.items() for v in vs]) if query else "")
            cookie = f"{self.ui.cookie}={self.ui.token}; Path=/; HttpOnly; SameSite=Strict"
            self._send(303, b"", "text/plain; charset=utf-8", {"Location": clean, "Set-Cookie": cookie}, head)
            return
        if url.path == "/ui.css":
            self._send(200, CSS.encode(), "text/css; charset=utf-8", {"Cache-Control": "private, max-age=300"}, head)
            return
        now = time.time_ns()
        try:
            refresh = integer(query, "refresh", low=REFRESH_MIN)
            refresh = min(refresh, 3600) if refresh else None
            kept = REFRESH.set(refresh)  # the page's links and forms keep it
            try:
                with self.ui.store() as store:
                    title, crumbs, body = route(store, url.path, query, now)
                body = keep_refresh(body)
            finally:
                REFRESH.reset(kept)
        except BadParameter as exc:
            self._html(400, error_page(400, str(exc), now), head)
            return
        except NotFound as exc:
            self._html(404, error_page(404, str(exc), now), head)
            return
        except (RuntimeError, ConnectionError, TimeoutError) as exc:  # store busy, no endpoint, server down
            log.info("ui: cannot read the store: %s", exc)
            self._html(503, error_page(503, f"cannot read the store: {exc}", now), head)
            return
        self._html(200, page(title, crumbs, body, self.ui.source, now, refresh), head)

    def _authenticated(self, given: str) -> bool:
        """The token from the URL, the cookie or the Authorization header, compared in constant time."""
        candidates = [given] if given else []
        try:
            jar = SimpleCookie(self.headers.get("Cookie", ""))
            if self.ui.cookie in jar:
                candidates.append(jar[self.ui.cookie].value)
        except CookieError:
            pass
        scheme, _, value = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() in ("token", "bearer"):
            candidates.append(value.strip())
        expected = self.ui.token.encode()
        # every candidate is compared (no early exit on the first), each in constant time
        return any([hmac.compare_digest(c.encode(errors="replace"), expected) for c in candidates])

    def _forbidden(self) -> None:
        self.close_connection = True
        self._send(403, b"403 forbidden: open the URL that `rlpulse ui` printed (it carries the token)\n",
                   "text/plain; charset=utf-8")

    def _html(self, status: int, body: str, head: bool = False) -> None:
        self._send(status, body.encode(), "text/html; charset=utf-8", {}, head)

    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None,
              head: bool = False) -> None:
        self.send_response(status)
        for name, value in {"Content-Type": content_type, "Content-Security-Policy": CSP,
                            "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                            "X-Frame-Options": "DENY", "Cache-Control": "no-store", **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if not head:
            self.wfile.write(body)


class UiServer(ServedServer):
    """The page's HTTP server (``start``/``close``, or ``serve_forever``); ``opener`` opens the store for one request."""

    thread_name = "rlpulse-ui"

    def __init__(self, opener: Callable[[], Store], source: str, host: str = HOST, port: int = 0,
                 token: str | None = None, max_connections: int = MAX_CONNECTIONS, allowed_hosts: Iterable[str] = ()):
        """``allowed_hosts``: names (beyond loopback's and the bound address) a request's Host may give, for a
        server bound beyond loopback and reached by a name."""
        self.opener, self.source = opener, source
        self.token = token or secrets.token_urlsafe(32)
        self._reading = threading.Lock()
        handler = type("Handler", (_Handler,), {"ui": self})
        self._server = BoundedHTTPServer((host, port), handler, max_connections, _BUSY, "ui", check_host=True,
                                         allowed_hosts=allowed_hosts)
        self.address: tuple[str, int] = self._server.server_address[:2]  # type: ignore[assignment]
        self.cookie = f"rlpulse-ui-{self.address[1]}"  # per port: two pages on one host keep their own tokens
        shown = f"[{self.address[0]}]" if ":" in self.address[0] else self.address[0]
        self.url = f"http://{shown}:{self.address[1]}/"

    @property
    def token_url(self) -> str:
        return f"{self.url}?token={self.token}"

    @contextmanager
    def store(self) -> Iterator[Store]:
        if not self._reading.acquire(timeout=READ_WAIT):
            raise TimeoutError(f"another page has been reading the store for {READ_WAIT} s")
        try:
            with self.opener() as store:
                yield store
        finally:
            self._reading.release()

