"""The engine poller's HTTP GET: one response, whole, within a time limit in all, from a server that may be hostile.

``fetch`` bounds the whole exchange by one deadline: the connection, the TLS handshake, the request,
the status line, the headers and the body. Every receive waits only for what is left of it (a server
dripping a byte at a time keeps every receive under any fixed socket timeout, and ``urllib`` checks a
deadline only between its reads), and the bytes read are capped, headers included. Whatever is not a
whole HTTP response is a :class:`ScrapeError` whose message says why without quoting the peer's bytes:
another protocol's banner, a line over ``http.client``'s 64 KiB, a body shorter than its Content-Length
or a chunked body cut (``http.client``'s ``read(n)`` returns such a body as if it were whole), a
redirect (not followed), a status other than 2xx. No proxy is used. The one step no socket timeout
bounds is the name lookup: the poller bounds each fetch as a whole (``EnginePoller.scrape``).
"""

from __future__ import annotations

import http.client
import io
import socket
import ssl
import time
import urllib.parse
from typing import Any

from rlpulse.base.errors import Error
from rlpulse.base.urls import request_failure

MAX_BYTES = 4 * 1024 * 1024  # vLLM's page is ~100-300 KiB with every histogram; far more is not a metrics page
TIMEOUT_S = 3.0  # the whole request, connect to last byte


class ScrapeError(Error):
    """An endpoint that did not give a metrics page; the message says why (no body quoted)."""


class _Deadline:
    """What is left of one scrape's time limit; ScrapeError once it is spent."""

    def __init__(self, timeout_s: float):
        self.timeout_s, self.end = timeout_s, time.monotonic() + timeout_s

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise ScrapeError(f"no complete response within {self.timeout_s:g}s")
        return left


class _Reader(io.RawIOBase):
    """The socket's bytes, each receive waiting at most what is left of the deadline (a server dripping a
    byte at a time keeps every receive under any fixed timeout), and ``cap`` bytes in all: status line,
    headers and body."""

    def __init__(self, sock: socket.socket, deadline: _Deadline, cap: int):
        self._sock, self._deadline, self._left = sock, deadline, cap

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._left <= 0:
            raise ScrapeError("response over the cap, headers included")
        self._sock.settimeout(self._deadline.left())
        with memoryview(buffer) as view:
            n = self._sock.recv_into(view[:self._left])
        self._left -= n
        return n


class _Socket:
    """What ``http.client`` uses of its socket, every send and receive within the deadline."""

    def __init__(self, sock: socket.socket, deadline: _Deadline, cap: int):
        self._sock, self._deadline, self._cap = sock, deadline, cap

    def sendall(self, data: bytes) -> None:
        self._sock.settimeout(self._deadline.left())  # since 3.5 the total time of a sendall
        self._sock.sendall(data)

    def makefile(self, mode: str, *args: Any, **kwargs: Any) -> io.BufferedReader:
        assert mode == "rb", mode
        return io.BufferedReader(_Reader(self._sock, self._deadline, self._cap))

    def close(self) -> None:
        pass  # http.client closes its socket while its response may still read: fetch closes it at the end


class _Connection(http.client.HTTPConnection):
    """One GET over plain HTTP or TLS, connect to last byte within ``deadline``; no proxy, no redirect."""

    def __init__(self, host: str, port: int, deadline: _Deadline, cap: int, tls: bool):
        super().__init__(host, port, timeout=deadline.timeout_s)
        self._deadline, self._cap, self._tls = deadline, cap, tls
        self.raw: socket.socket | None = None

    def connect(self) -> None:
        # The name lookup is the one step no socket timeout bounds; the poller bounds the whole fetch.
        sock = socket.create_connection((self.host, self.port), timeout=self._deadline.left())
        try:
            if self._tls:
                sock.settimeout(self._deadline.left())  # the handshake's reads, all together (ssl's own deadline)
                sock = _TLS.wrap_socket(sock, server_hostname=self.host)
            self.raw, self.sock = sock, _Socket(sock, self._deadline, self._cap)
        except BaseException:
            sock.close()
            raise


_TLS = ssl.create_default_context()
HEADER_BYTES = 256 * 1024  # status line and headers: a few hundred bytes from vLLM


def fetch(url: str, timeout_s: float = TIMEOUT_S, max_bytes: int = MAX_BYTES) -> bytes:
    """The body of ``url``, at most ``max_bytes``, within ``timeout_s`` in all (connect, TLS, status
    line, headers, body: every receive waits only for what is left); ScrapeError otherwise, its message
    the reason (the peer's bytes are not quoted). Only a whole response is a body: one shorter than its
    Content-Length, or chunked and cut, is refused."""
    deadline = _Deadline(timeout_s)
    conn: _Connection | None = None
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ScrapeError("not an http:// or https:// URL with a host")
        tls = parts.scheme == "https"
        conn = _Connection(parts.hostname, parts.port or (443 if tls else 80), deadline, max_bytes + HEADER_BYTES, tls)
        conn.request("GET", parts.path or "/", headers={"Accept": "text/plain", "Accept-Encoding": "identity",
                                                              "Connection": "close"})
        response = conn.getresponse()
        if response.status in (301, 302, 303, 307, 308):  # a metrics endpoint answers where it is; a redirect
            # followed could send us anywhere
            raise ScrapeError(f"redirected ({response.status}); give the metrics URL itself")
        if not 200 <= response.status < 300:
            raise ScrapeError(f"HTTP {response.status}")
        length = response.length  # Content-Length as http.client read it; None when chunked or to the close
        if length is not None and length > max_bytes:
            raise ScrapeError(f"response of {length} bytes, over the {max_bytes}-byte cap")
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = response.read(65536)
            if not chunk:
                if response.length:  # http.client's read(n) returns what came before the close, as if whole
                    raise http.client.IncompleteRead(b"".join(chunks), response.length)
                return b"".join(chunks)
            size += len(chunk)
            if size > max_bytes:
                raise ScrapeError(f"response over the {max_bytes}-byte cap")
            chunks.append(chunk)
    except ScrapeError:
        raise
    except TimeoutError:  # socket.timeout, and ssl's handshake timing out
        raise ScrapeError(f"no complete response within {timeout_s:g}s") from None
    except http.client.RemoteDisconnected:  # a BadStatusLine: nothing at all came
        raise ScrapeError("closed without answering") from None
    except http.client.BadStatusLine:  # an SSH banner, an HTTP/0.9 server, any other protocol
        raise ScrapeError("not an HTTP response (its first line is no HTTP status line)") from None
    except http.client.LineTooLong:
        raise ScrapeError("a status or header line over 65536 bytes (LineTooLong)") from None
    except http.client.IncompleteRead as exc:
        got = (f"{len(exc.partial)} of {len(exc.partial) + exc.expected} bytes" if exc.expected is not None
               else "a chunked body ended before its last chunk")
        raise ScrapeError(f"response cut short: {got} (IncompleteRead)") from None
    except (http.client.HTTPException, OSError, ValueError) as exc:  # ssl.SSLError, refused, reset, no such host...
        raise ScrapeError(request_failure(exc)) from None  # never str(exc): http.client quotes the URL
    finally:
        if conn is not None:
            conn.close()
            if conn.raw is not None:
                conn.raw.close()
