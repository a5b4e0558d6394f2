"""The webhook client of ``rlpulse alerts``: POSTs one alert as JSON, retrying transient failures.

See ``rlpulse.sinks.alerts.alert_feed`` for the delivery contract (ids, retries, giving up, secrets in URLs).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.client
import json
import logging
import math
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from typing import Any
from collections.abc import Callable
from urllib.parse import unquote, urlunsplit
from rlpulse.base.errors import Error
from rlpulse.base.urls import mask_url, request_failure, split_url

# The feed's logger name, as before this client had a module of its own: log lines and their
# filters stay the same.
log = logging.getLogger("rlpulse.sinks.alerts.alert_feed")

# What is read of an answer: its status says accepted or not; the body is read up to this, then
# the connection is closed (a receiver that answers 200 MiB costs 64 KiB).
RESPONSE_CAP = 64 * 1024
# Past the time limit, the wait for a POST stuck where no socket timeout reaches (a host name that
# takes long to resolve) is abandoned after this much more, its thread left to end on its own.
STUCK_GRACE_S = 1.0


def alert_id(alert: dict[str, Any]) -> str:
    """The id of one alert transition: equal for re-posts and re-publications of it, 32 hex digits."""
    identity = [alert.get("project", ""), alert["rule"], alert["key"], alert["state"], int(alert["first_seen_ns"])]
    return hashlib.sha256(json.dumps(identity, separators=(",", ":")).encode()).hexdigest()[:32]


class _Deadline:
    """A socket whose every send and receive waits at most the time left before ``deadline``
    (``time.monotonic()``): a receiver dripping its answer a byte at a time runs out of it, where a
    timeout per read would let it take forever."""

    deadline = math.inf

    def arm(self) -> None:
        if self.deadline == math.inf:  # not given one (yet): the socket's own timeout holds
            return
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the POST's time limit passed")
        self.settimeout(left)  # type: ignore[attr-defined]  # a socket's, by the classes below

    def recv(self, *args: Any) -> Any:
        self.arm()
        return super().recv(*args)  # type: ignore[misc]

    def recv_into(self, *args: Any) -> Any:
        self.arm()
        return super().recv_into(*args)  # type: ignore[misc]

    def send(self, *args: Any) -> Any:
        self.arm()
        return super().send(*args)  # type: ignore[misc]

    def sendall(self, *args: Any) -> Any:
        self.arm()  # CPython's sendall, and its TLS handshake and reads, take the timeout as a total
        return super().sendall(*args)  # type: ignore[misc]


class _DeadlineSocket(_Deadline, socket.socket):
    pass


class _DeadlineSSLSocket(_Deadline, ssl.SSLSocket):
    pass


def _connect(address: tuple[str, int], deadline: float, source_address: Any = None) -> _DeadlineSocket:
    """``socket.create_connection``, each address tried with the time left (not the whole limit each)."""
    host, port = address
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        sock = _DeadlineSocket(family, kind, proto)
        sock.deadline = deadline
        try:
            sock.arm()
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            error = exc
            sock.close()
    raise error or OSError(f"no address for the host (port {port})")


class _HTTPConnection(http.client.HTTPConnection):
    """http.client's connection on a ``_DeadlineSocket``: connect, a proxy's CONNECT, the request, the
    status line, the headers and the body all within one time limit."""

    def __init__(self, host: str, *, deadline: float, **kwargs: Any):
        super().__init__(host, **kwargs)
        self._create_connection = lambda address, timeout, source=None: _connect(address, deadline, source)


class _HTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, host: str, *, deadline: float, context: ssl.SSLContext, **kwargs: Any):
        super().__init__(host, context=context, **kwargs)
        self._deadline, self._tls = deadline, context
        self._create_connection = lambda address, timeout, source=None: _connect(address, deadline, source)

    def connect(self) -> None:  # HTTPSConnection.connect, with the handshake given the time left
        http.client.HTTPConnection.connect(self)
        assert isinstance(self.sock, _DeadlineSocket)
        self.sock.arm()
        tls = self._tls.wrap_socket(self.sock, server_hostname=getattr(self, "_tunnel_host", None) or self.host)
        tls.deadline = self._deadline  # type: ignore[attr-defined]  # a _DeadlineSSLSocket (the context's class)
        self.sock = tls


class _Request(urllib.request.Request):
    deadline = math.inf


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req: Any) -> Any:
        # (typeshed's protocol for the class knows no deadline argument; do_open passes it on)
        return self.do_open(_HTTPConnection, req, deadline=req.deadline)  # type: ignore[arg-type]


class _HTTPSHandler(urllib.request.HTTPSHandler):
    tls: ssl.SSLContext | None = None

    def https_open(self, req: Any) -> Any:
        if self.tls is None:  # the system's trusted certificates (SSL_CERT_FILE too), as urllib's default
            self.tls = ssl.create_default_context()
            self.tls.sslsocket_class = _DeadlineSSLSocket
        return self.do_open(_HTTPSConnection, req, context=self.tls, deadline=req.deadline)  # type: ignore[arg-type]


class _Rejected(Error):
    """The receiver refused this request for good (4xx other than 408/425/429, or a redirect)."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    # urllib would turn a redirected POST into a GET without the body; a redirect is a refusal.
    def redirect_request(self, *args: Any) -> None:
        return None


_TRANSIENT_HTTP = {408, 425, 429}


async def _in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """Run blocking ``fn`` on a daemon thread: a stopping feed abandons it instead of waiting (as
    ``asyncio.to_thread`` would, at interpreter exit, for a hanging webhook)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def work() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting task
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: the feed stopped and nobody waits
            pass

    threading.Thread(target=work, name="rlpulse-webhook", daemon=True).start()
    return await future


class Webhook:
    """POSTs alerts as JSON, one at a time; ``deliver`` returns True when accepted, False when given up.

    ``timeout_s`` bounds each POST whole: connecting, sending, the status line, the headers and the
    (capped) body, however slowly the receiver answers. A POST past it is a failed try, retried as
    any transient failure. A 2xx status with its headers in time is an acceptance: what the body
    adds is read up to ``RESPONSE_CAP`` within the same limit, and never decides anything.
    """

    def __init__(self, url: str, *, timeout_s: float = 5.0, give_up_after_s: float = 600.0,
                 backoff_s: float = 0.5, max_backoff_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.origin = mask_url(url, origin_only=True)  # all that is ever printed of the URL
        parts = split_url(url, "--webhook", origin_only=True)  # one that cannot be read: a ValueError quoting none of it
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--webhook: expected an http:// or https:// URL with a host, got one for {self.origin}")
        self.url = url
        self._headers = {"Content-Type": "application/json", "User-Agent": "rlpulse-alerts"}
        if parts.username is not None:
            # urllib does not take user:password@ from the URL: send it as HTTP Basic, as curl does.
            credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            self._headers["Authorization"] = "Basic " + base64.b64encode(credentials).decode()
            self.url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        self.timeout_s, self.give_up_after_s = timeout_s, give_up_after_s
        self.backoff_s, self.max_backoff_s, self._clock = backoff_s, max_backoff_s, clock
        self._opener = urllib.request.build_opener(_NoRedirect, _HTTPHandler, _HTTPSHandler)
        self._failing_since: float | None = None  # first failure with no success since
        self.delivered = 0
        self.failed = 0

    async def deliver(self, alert: dict[str, Any]) -> bool:
        key = alert_id(alert)
        body = json.dumps({"alert_id": key, **alert}, separators=(",", ":")).encode()
        what = f"{alert['rule']} {alert['state']} {alert['key']} (id {key})"
        backoff, tries = self.backoff_s, 0
        while True:
            tries += 1
            try:
                await asyncio.wait_for(_in_daemon_thread(lambda: self._post(body, key)), self.timeout_s + STUCK_GRACE_S)
            except _Rejected as exc:
                self.failed += 1
                log.error("webhook %s refused %s: %s; given up", self.origin, what, exc)
                return False
            except Exception as exc:  # refused, timeout, 5xx: retried alike
                # our own words: urllib's and http.client's texts quote pieces of the URL
                reason = str(exc) if isinstance(exc, _Failed) else request_failure(exc, self.timeout_s)
            else:
                self.delivered += 1
                if self._failing_since is not None:
                    log.info("webhook %s accepts again", self.origin)
                self._failing_since = None
                return True
            now = self._clock()
            self._failing_since = now if self._failing_since is None else self._failing_since
            if now - self._failing_since >= self.give_up_after_s:
                self.failed += 1
                log.error("webhook %s failed %d times for %s, failing for %.0fs; given up; last error %s",
                          self.origin, tries, what, now - self._failing_since, reason)
                return False
            if tries == 1:
                log.warning("webhook %s: %s for %s; retrying", self.origin, reason, what)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    def _post(self, body: bytes, key: str) -> None:
        request = _Request(self.url, data=body, method="POST", headers={**self._headers, "Idempotency-Key": key})
        request.deadline = time.monotonic() + self.timeout_s
        try:
            response = self._opener.open(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            exc.close()  # its body is never read
            if 300 <= exc.code < 500 and exc.code not in _TRANSIENT_HTTP:
                raise _Rejected(f"HTTP {exc.code}") from None
            raise _Failed(f"HTTP {exc.code}") from None
        with response:  # accepted: the rest of the answer is read up to the cap, in the time left, then dropped
            try:
                response.read(RESPONSE_CAP)
            except (OSError, http.client.HTTPException):
                pass


class _Failed(Error):
    """A transient failure whose message is rlpulse's own (``HTTP 503``)."""
