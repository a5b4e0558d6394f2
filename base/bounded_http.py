"""The HTTP server under the sink's read endpoint, ``rlpulse ui``, ``rlpulse prometheus`` and ``rlpulse otlp``:
the standard library's, bounded.

Slots. A thread per connection, at most ``max_connections`` of them for anyone, and ``reserve`` more
for requests that show their credentials. A connection over both is answered ``busy`` (a complete 503)
by the accepting thread, which never waits on a client, and closed, so a flood cannot take the
process's file descriptors or threads. A connection over the first cap takes a reserved slot, and is
served only if its request carries valid credentials (the handler's :meth:`BoundedHandler.vouched`:
the ui's token, the read endpoint's password, a bearer token), once, then closed; without them it is
answered ``busy``. A reserved connection that has not shown its credentials yet is evicted (answered
``busy`` and shut) when a newer one needs its slot, oldest first, and has ``arrival_s`` from its accept
to send its whole request: slow clients without credentials can hold the ``max_connections`` shared
slots, never the reserve, so the owner's request is answered at once however many there are.

Arrival. The request line, the headers and the body a handler reads must arrive within ``arrival_s``
(10 s) of the request's first byte, across reads: a client sending one byte every few seconds is cut
off at the deadline, not kept for a per-read timeout after each byte. Between requests a connection may
stay silent for the handler's ``timeout`` (keep-alive). The head is at most ``MAX_HEAD`` bytes and
``MAX_HEADERS`` header lines (431 beyond).

Host. With ``check_host``, a request whose ``Host`` names anything but this machine's loopback
(``localhost``, ``127.0.0.1``, ``[::1]``, any loopback address), the exact bound address, or a name of
``allowed_hosts`` is answered 403 before anything else, as Jupyter does: a page of a site whose name was
re-pointed at 127.0.0.1 (DNS rebinding) names that site. The port is not compared (a rebinding page
names ours); a request without ``Host`` (never a browser's) passes.

A failed connection is one log line under ``label``, never a traceback; :func:`mask_secrets` masks
credentials in a request line before it is logged.
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import logging
import re
import socket
import sys
import threading
import time
from collections.abc import Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self
from urllib.parse import quote, unquote_plus

log = logging.getLogger(__name__)

ARRIVAL_S = 10.0  # seconds from a request's first byte to the end of its body
RESERVE = 4  # slots beyond max_connections, for requests that show their credentials
MAX_HEAD = 32 * 1024  # bytes of headers after the request line
MAX_HEADERS = 64  # header lines
LOOPBACK_NAMES = frozenset({"localhost", "localhost."})


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection: ``max_connections`` for anyone, ``reserve`` more for requests with credentials;
    the ones over are answered ``busy`` at accept. ``check_host``: refuse a foreign Host (see the module)."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: a burst waits to be accepted (and refused) instead of retrying SYNs

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int,
                 busy: bytes, label: str, reserve: int = RESERVE, check_host: bool = False,
                 allowed_hosts: Iterable[str] = ()):
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._busy, self.label = busy, label
        self._reserve = reserve
        self._lock = threading.Lock()
        self._in_reserve = 0  # threads on reserved slots (evicted ones until they end)
        self._reserved: dict[Any, float] = {}  # connections on reserved slots -> accepted at (monotonic)
        self._waiting: dict[Any, float] = {}  # those of them that have not shown credentials: the ones evicted, oldest first
        self.refused = 0  # connections turned away, for the log and the tests
        self.evicted = 0  # reserved connections shut for a newer one
        self.check_host = check_host
        bound = str(self.server_address[0]).lower()
        self.allowed_hosts = frozenset({bound, *LOOPBACK_NAMES, *(h.lower().strip("[]") for h in allowed_hosts)})
        try:
            self._any_address = ipaddress.ip_address(bound).is_unspecified
        except ValueError:
            self._any_address = False

    # -- slots ---------------------------------------------------------------------------------

    def process_request(self, request: Any, client_address: Any) -> None:
        reserved = False
        if not self._slots.acquire(blocking=False):
            with self._lock:
                if self._in_reserve >= self._reserve and not self._evict_one():
                    self._refuse(request)
                    return
                self._in_reserve += 1
                self._reserved[request] = self._waiting[request] = time.monotonic()
            reserved = True
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(request, reserved)
            raise

    def _refuse(self, request: Any) -> None:
        self.refused += 1
        try:
            request.settimeout(0)  # the accepting thread never waits on a client
            request.send(self._busy)
        except OSError:
            pass
        self.shutdown_request(request)

    def _evict_one(self) -> bool:
        """Shut the oldest reserved connection that has not shown credentials (under the lock): its thread ends at once.
        Never more than ``reserve`` evicted threads still ending: a flood is refused instead."""
        if not self._waiting or self._in_reserve >= 2 * self._reserve:
            return False
        victim = min(self._waiting, key=self._waiting.__getitem__)
        del self._waiting[victim]
        self.evicted += 1
        try:
            victim.send(self._busy, socket.MSG_DONTWAIT)
        except OSError:
            pass
        try:
            victim.shutdown(socket.SHUT_RDWR)  # its thread's read returns at once
        except OSError:
            pass
        return True

    def _release(self, request: Any, reserved: bool) -> None:
        if not reserved:
            self._slots.release()
            return
        with self._lock:
            self._in_reserve -= 1
            self._reserved.pop(request, None)
            self._waiting.pop(request, None)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        reserved = request in self._reserved
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request, reserved)

    def reserved_since(self, request: Any) -> float | None:
        """When a connection on a reserved slot was accepted (it has ``arrival_s`` from then); None for a shared slot."""
        with self._lock:
            return self._reserved.get(request)

    def vouch(self, request: Any) -> bool:
        """A reserved connection's request showed its credentials: no newer one evicts it. False if it was evicted."""
        with self._lock:
            return self._waiting.pop(request, None) is not None

    @property
    def busy(self) -> bytes:
        return self._busy

    # -- Host ----------------------------------------------------------------------------------

    def host_allowed(self, host: str | None) -> bool:
        """Whether a request naming ``host`` (its Host header; None: none sent) is for this server."""
        if host is None:
            return True
        match = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[^:\[\]@/\\\s]*)(:[0-9]{1,5})?", host.strip())
        if not match or not match.group(1):
            return False
        name = match.group(1).strip("[]").lower()
        try:
            addr = ipaddress.ip_address(name)
        except ValueError:
            return name in self.allowed_hosts
        # An address is no rebinding (that needs a name): loopback, the bound one, or any when bound to all
        return addr.is_loopback or name in self.allowed_hosts or self._any_address

    def handle_error(self, request: Any, client_address: Any) -> None:  # one line, never a traceback
        log.warning("%s: connection from %s failed: %s", self.label, client_address[0], type(sys.exc_info()[1]).__name__)


class _DeadlineReader(io.RawIOBase):
    """The connection's reads, each given the time left to ``deadline`` (monotonic; None: ``idle`` s per read);
    ``TimeoutError`` once it has passed. Writes keep ``idle`` as their timeout."""

    def __init__(self, sock: socket.socket, idle: float | None):
        super().__init__()
        self._sock, self.idle = sock, idle
        self.deadline: float | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.deadline is None:
            return self._sock.recv_into(buffer)
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive within its deadline")
        self._sock.settimeout(left)
        try:
            return self._sock.recv_into(buffer)
        finally:
            self._sock.settimeout(self.idle)


class _Head:
    """What ``http.client.parse_headers`` reads the headers through: at most ``budget`` bytes in all."""

    def __init__(self, rfile: Any, budget: int):
        self._rfile, self._left = rfile, budget

    def readline(self, limit: int = -1) -> bytes:
        line = self._rfile.readline(min(limit if limit >= 0 else self._left + 1, self._left + 1))
        self._left -= len(line)
        if self._left < 0:
            raise http.client.LineTooLong(f"headers over {MAX_HEAD} bytes")
        return line


class BoundedHandler(BaseHTTPRequestHandler):
    """A request handler for :class:`BoundedHTTPServer`: the arrival deadline, the head's bounds, the Host check,
    and the reserve's rule (served once, only if :meth:`vouched`), before any ``do_*`` method runs."""

    server: BoundedHTTPServer
    arrival_s = ARRIVAL_S
    _reader: _DeadlineReader
    _buffered: io.BufferedReader

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket's own reader, replaced by one that keeps the deadline
        self._reader = _DeadlineReader(self.connection, self.timeout)
        self._buffered = io.BufferedReader(self._reader, self.rbufsize if self.rbufsize > 0 else io.DEFAULT_BUFFER_SIZE)
        self.rfile = self._buffered

    def vouched(self) -> bool:
        """Whether this request (its line and headers, read) carries valid credentials: override it."""
        return False

    def refuse_host(self) -> None:
        """The answer to a request whose Host names another server (override for the server's own format)."""
        self.send_error_text(403, "403 forbidden: this server answers requests for this machine's own names only "
                                  "(its Host header named another)\n")

    def send_error_text(self, status: int, text: str) -> None:
        body = text.encode()
        self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def handle_one_request(self) -> None:
        reader = self._reader
        since = self.server.reserved_since(self.request)
        try:
            # the wait for a request: the idle timeout, or on a reserved slot the arrival deadline from accept
            reader.deadline = None if since is None else since + self.arrival_s
            if not self._buffered.peek(1):
                self.close_connection = True
                return
            if since is None:
                reader.deadline = time.monotonic() + self.arrival_s
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.requestline = self.request_version = self.command = ""
                self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG)
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            rfile, self.rfile = self.rfile, _Head(self.rfile, MAX_HEAD)  # type: ignore[assignment]
            try:
                parsed = self.parse_request()
            finally:
                self.rfile = rfile
            if not parsed:
                return
            if len(self.headers) > MAX_HEADERS:
                self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"more than {MAX_HEADERS} header lines")
                return
            hosts = self.headers.get_all("Host") or []
            if self.server.check_host and (len(hosts) > 1 or not self.server.host_allowed(hosts[0] if hosts else None)):
                self.refuse_host()
                return
            if since is not None:  # a reserved slot: served once, and only with credentials
                if not (self.vouched() and self.server.vouch(self.request)):
                    self.close_connection = True
                    self.wfile.write(self.server.busy)
                    return
                self.close_connection = True
            method = getattr(self, "do_" + self.command, None)
            if method is None:
                self.send_error(HTTPStatus.NOT_IMPLEMENTED, f"Unsupported method ({self.command[:20]!r})")
                return
            method()
            self.wfile.flush()
        except TimeoutError:  # a read past the deadline, or a write past the idle timeout
            log.debug("%s: a request from %s did not arrive in time", self.server.label, self.client_address[0])
            self.close_connection = True
        finally:
            reader.deadline = None


_PAIR = re.compile(r"(?<=[?&;])([^=&;\s'\"]+)=([^&;\s'\"]*)")


def mask_secrets(text: str, keys: Iterable[str] = (), values: Iterable[str] = ()) -> str:
    """``text`` (a request line, a log message quoting one) with the value of each URL parameter named in ``keys``
    (compared decoded and case-blind: ``%74oken=`` is ``token=``) and every occurrence of ``values`` (raw and
    percent-encoded) written ``***``."""
    names = {k.lower() for k in keys}

    def pair(m: re.Match[str]) -> str:
        return f"{m.group(1)}=***" if unquote_plus(m.group(1)).lower() in names else m.group(0)

    out = _PAIR.sub(pair, text) if names else text
    for value in values:
        if value:
            for spelling in {value, quote(value, safe=""), quote(value)}:
                out = out.replace(spelling, "***")
    return out


class ServedServer:
    """A ``BoundedHTTPServer`` in ``_server``, served on a daemon thread: ``start``, ``close`` (shuts
    it down and joins the thread), or ``serve_forever`` in the caller's thread; a context manager."""

    _server: BoundedHTTPServer
    _thread: threading.Thread | None = None
    thread_name = "rlpulse-http"

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._server.serve_forever, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
