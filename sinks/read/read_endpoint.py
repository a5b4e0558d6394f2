"""Read-only queries on the sink's chDB store, over ClickHouse's own HTTP interface, on loopback.

chDB lets one process open a store, so while ``rlpulse sink`` runs nothing else can read it. The
sink therefore serves reads itself: a small HTTP server on 127.0.0.1 (an ephemeral port unless one
is asked for) that speaks enough of ClickHouse's HTTP interface for ``curl``, clickhouse-connect
and a dashboard's ClickHouse data source: ``/ping``, the query in the URL (``?query=``) or the
body or a multipart form, ``database``, ``default_format`` (TabSeparated by default, as
ClickHouse), ``param_<name>`` values for ``{name:Type}`` placeholders (parsed by ClickHouse as their
declared types), settings as URL parameters, gzip/deflate response compression, and errors as
ClickHouse sends them (``X-ClickHouse-Exception-Code``, a ``Code: N. DB::Exception: ...`` body).

Each request runs on a chDB connection of its own, opened on the engine the sink already hosts
(cheap: ~0.1 ms), so a query never shares session state with the sink's inserts; it is closed
after the request. What may run there, read-only and within limits, is ``rlpulse.sinks.read.read_engine``'s.

Every request but ``/ping`` must carry the user ``rlpulse`` and the password the sink drew at
start (``secrets.token_urlsafe``), as HTTP basic auth (what clickhouse-connect and Grafana send)
or ``X-ClickHouse-User``/``X-ClickHouse-Key`` headers: loopback is open to every local user,
the endpoint file that holds the password only to the store's owner (it, and finding it, are
``rlpulse.sinks.store.endpoint_file``'s). Anything else gets
ClickHouse's AUTHENTICATION_FAILED (516, HTTP 403). A password in the URL is refused too: URLs
end up in shell histories and logs.

Hostile requests: the password is checked on the headers before a byte of the body is
read; a body is at most MAX_BODY on the wire and once inflated; an invalid Content-Length or chunk
size is answered 400 and the connection closed; a request's line, headers and body must arrive within
10 s of its first byte, across reads (``rlpulse.base.bounded_http``); at most
``ReadLimits.max_connections`` connections are open for anyone, and a few more for requests that carry
the password (anything else over the cap gets 503), so slow clients cannot keep the owner out; a
``Host`` other than loopback's names and addresses is refused (DNS rebinding); a password in the URL
is masked in the debug log; a query_id is never echoed unless it is plain; a bad request is one log
line. chDB releases the GIL while a query runs, so the sink's inserts go on meanwhile; what a
query can take is bounded by :class:`ReadLimits` (time, one thread, memory, result, ``max_concurrent``).
"""

from __future__ import annotations

import base64
import gzip
import hmac
import json
import logging
import os
import re
import secrets
import threading
import time
import uuid
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from email.parser import BytesParser
from email.policy import HTTP
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from rlpulse.base.env import READ_PORT
from rlpulse.base.bounded_http import BoundedHandler, BoundedHTTPServer, mask_secrets
from rlpulse.sinks.store.endpoint_file import ENDPOINT_FILE, publish, withdraw
from rlpulse.sinks.read.read_engine import Engine, QueryFailed, ReadLimits
from rlpulse.base.errors import Error

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
READ_USER = "rlpulse"  # the one user; its password is new at every sink start
MAX_BODY = 16 * 1024 * 1024  # a query, not data: nothing is inserted here (on the wire, and once decompressed)
MAX_LINE = 1024  # a chunk-size or trailer line
IDLE_TIMEOUT = 30  # seconds a connection may stay silent (between requests, or mid-request) before it is closed
# Beyond ReadLimits.max_connections open connections, a new one is answered 503 and closed at once by
# the accepting thread: no thread, no file descriptor held for it.
_BUSY_TEXT = b"Code: 202. DB::Exception: Too many connections to the read endpoint. (TOO_MANY_SIMULTANEOUS_QUERIES)\n"
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=UTF-8\r\nX-ClickHouse-Exception-Code: 202"
         b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_TEXT), _BUSY_TEXT))

# URL parameters that steer the HTTP exchange rather than the query (accepted, not applied).
_TRANSPORT = frozenset({
    "query", "database", "default_format", "session_id", "session_timeout", "session_check", "query_id", "user",
    "password", "quota_key", "buffer_size", "wait_end_of_query", "client_protocol_version", "enable_http_compression",
    "http_zlib_compression_level", "send_progress_in_http_headers", "http_headers_progress_interval_ms",
    "cancel_http_readonly_queries_on_client_close", "role", "stacktrace", "add_http_cors_header", "compress",
    "decompress", "http_native_compression_disable_checksumming_on_decompress",
})
# ClickHouse's exceptionCodeToHTTPStatus, for the codes a read can meet.
_STATUS = {**{c: 400 for c in (6, 27, 36, 38, 41, 53, 62, 69, 72, 167, 168, 452, 457, 456)},
           **{c: 404 for c in (46, 47, 60, 63, 73, 81, 115, 170)},
           497: 403, 516: 403, 48: 501, 159: 408, 202: 503}
_CONTENT_TYPES = (("TabSeparated", "text/tab-separated-values; charset=UTF-8"),
                  ("TSV", "text/tab-separated-values; charset=UTF-8"),
                  ("CSV", "text/csv; charset=UTF-8"), ("JSONEachRow", "application/x-ndjson; charset=UTF-8"),
                  ("JSONLines", "application/x-ndjson; charset=UTF-8"), ("NDJSON", "application/x-ndjson; charset=UTF-8"),
                  ("JSON", "application/json; charset=UTF-8"), ("Pretty", "text/plain; charset=UTF-8"),
                  ("Vertical", "text/plain; charset=UTF-8"), ("Markdown", "text/markdown; charset=UTF-8"))


class BadRequest(Error):
    """A request the endpoint will not read further: answered 400 and its connection closed."""


# What a query_id may hold: it is sent back in a header, so never a control character (CRLF).
_QUERY_ID = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,8}")  # a chunk is at most 4 GiB on paper; MAX_BODY bounds it anyway


class _Handler(BoundedHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: clients pool their connections
    server_version = "rlpulse-read-endpoint"
    timeout = IDLE_TIMEOUT  # a silent client gives its connection back
    engine: Engine  # set on the subclass made per server
    password: str  # likewise

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        # a password in the URL is refused, and never logged either
        log.debug("read endpoint: %s", mask_secrets(format % args, ("password",), (self.password,)))

    def vouched(self) -> bool:
        """The request carries the password: it may take a reserved slot."""
        return self._authenticated(dict(parse_qsl(urlsplit(self.path).query, keep_blank_values=True)))

    def refuse_host(self) -> None:
        self.close_connection = True
        self._fail(QueryFailed(497, "Code: 497. DB::Exception: the sink's read endpoint answers requests for this "
                                    "machine's loopback names and addresses only (the Host header named another). "
                                    "(ACCESS_DENIED)"))

    def do_HEAD(self) -> None:  # noqa: N802
        self._send(200, b"", {"Content-Type": "text/plain; charset=UTF-8"}, head=True)

    def do_GET(self) -> None:  # noqa: N802
        self._serve(post=False)

    def do_POST(self) -> None:  # noqa: N802
        self._serve(post=True)

    def _serve(self, post: bool) -> None:
        """Authenticate on the headers alone, then read a bounded body, then answer. A request that
        fails anywhere is answered in one line and logged in one line, never with a traceback."""
        try:
            self._handle(post)
        except BadRequest as exc:
            log.info("read endpoint: bad request from %s: %s", self.client_address[0], exc)
            self.close_connection = True  # the rest of its body is not read: the stream is out of step
            self._fail(QueryFailed(36, f"Code: 36. DB::Exception: {exc}. (BAD_ARGUMENTS)"))
        except (ConnectionError, TimeoutError, OSError) as exc:
            log.info("read endpoint: connection from %s lost: %s", self.client_address[0], type(exc).__name__)
            self.close_connection = True
        except Exception as exc:  # a bug here must not print request data or a traceback into the sink's log
            log.warning("read endpoint: request failed: %s", type(exc).__name__)
            self.close_connection = True
            self._fail(QueryFailed(1001, "Code: 1001. DB::Exception: the read endpoint could not handle the request. "
                                         "(STD_EXCEPTION)"))

    def _body(self) -> bytes:
        """The body, at most MAX_BODY bytes on the wire and MAX_BODY once decompressed."""
        too_big = f"request body over {MAX_BODY >> 20} MiB: the read endpoint takes queries, not data"
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks, size = [], 0
            while True:
                line = self.rfile.readline(MAX_LINE + 1)
                size_field = line.split(b";")[0].strip()
                if len(line) > MAX_LINE or not _CHUNK_SIZE.fullmatch(size_field):
                    raise BadRequest("invalid chunk size")
                n = int(size_field, 16)
                if n == 0:
                    for _ in range(100):  # trailers, bounded as headers are
                        if not self.rfile.readline(MAX_LINE + 1).strip():
                            break
                    else:
                        raise BadRequest("too many trailer lines")
                    break
                size += n
                if size > MAX_BODY:
                    raise BadRequest(too_big)
                chunks.append(self.rfile.read(n))
                if self.rfile.readline(3).strip():
                    raise BadRequest("a chunk longer than its size")
            data = b"".join(chunks)
        else:
            field = (self.headers.get("Content-Length") or "0").strip()
            if not (field.isascii() and field.isdigit()):
                raise BadRequest("invalid Content-Length")
            length = int(field)
            if length > MAX_BODY:
                raise BadRequest(too_big)
            data = self.rfile.read(length) if length else b""
        encoding = self.headers.get("Content-Encoding", "identity").lower()
        if encoding in ("identity", ""):
            return data
        if encoding not in ("gzip", "deflate"):
            raise QueryFailed(48, f"Code: 48. DB::Exception: Content-Encoding {encoding[:40]!r} is not supported by the "
                                  "read endpoint (gzip, deflate). (NOT_IMPLEMENTED)")
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
        try:
            out = inflate.decompress(data, MAX_BODY + 1)  # never more than the bound in memory
        except zlib.error:
            raise BadRequest(f"the body is not valid {encoding}") from None
        if len(out) > MAX_BODY or inflate.unconsumed_tail:
            raise BadRequest(f"decompressed {too_big}")
        return out

    def _handle(self, post: bool) -> None:
        url = urlsplit(self.path)
        if url.path in ("/ping", "/replicas_status"):
            self.close_connection = post  # its body, if any, is not read
            self._send(200, b"Ok.\n", {"Content-Type": "text/plain; charset=UTF-8"})
            return
        if url.path not in ("/", ""):
            self.close_connection = post
            self._send(404, b"There is no such handle\n", {"Content-Type": "text/plain; charset=UTF-8"})
            return
        args = dict(parse_qsl(url.query, keep_blank_values=True))
        if not self._authenticated(args):  # before a byte of the body is read, and nothing of the request echoed
            self.close_connection = True
            self._fail(QueryFailed(516, "Code: 516. DB::Exception: Authentication failed: password is incorrect, or "
                                        "there is no user with such name; the sink's read endpoint takes the user and "
                                        f"password in the '{ENDPOINT_FILE}' file of its store directory, as HTTP basic "
                                        "auth or X-ClickHouse-User/X-ClickHouse-Key headers. (AUTHENTICATION_FAILED)"))
            return
        if not post and (self.headers.get("Content-Length", "0").strip() not in ("", "0")
                         or "Transfer-Encoding" in self.headers):
            self.close_connection = True  # a GET's body is not read: the next request cannot be found after it
        try:
            body = self._body() if post else b""
        except QueryFailed as exc:
            self.close_connection = True
            self._fail(exc)
            return
        content_type = self.headers.get("Content-Type", "")
        if content_type.startswith("multipart/form-data"):
            # clickhouse-connect sends long parameter values (and the query with them) as a form.
            message = BytesParser(policy=HTTP).parsebytes(f"Content-Type: {content_type}\r\n\r\n".encode() + body)
            if not message.is_multipart():
                raise BadRequest("a multipart/form-data body that is not a form")
            for part in message.iter_parts():
                name = part.get_param("name", header="content-disposition")
                if name and part.get_filename() is None:
                    payload = part.get_payload(decode=True)
                    try:
                        args[str(name)] = payload.decode() if isinstance(payload, bytes) else ""
                    except UnicodeDecodeError:
                        raise BadRequest(f"form field {str(name)[:40]!r} is not UTF-8 text") from None
            body = b""
        query_id = args.get("query_id") or str(uuid.uuid4())
        if not _QUERY_ID.fullmatch(query_id):  # never echoed: it would go into a response header
            raise BadRequest("query_id may hold only letters, digits and _.:@- (at most 128)")
        if "query" not in args and not body:
            self._send(200, b"Ok.\n", {"Content-Type": "text/plain; charset=UTF-8"})
            return
        sql = "\n".join(part for part in (args.get("query", ""), body.decode(errors="replace")) if part)
        params = {k[6:]: v for k, v in args.items() if k.startswith("param_")}
        settings = {k: v for k, v in args.items() if k not in _TRANSPORT and not k.startswith("param_")}
        try:
            for flag in ("compress", "decompress"):
                if args.get(flag, "0") not in ("0", "", "false"):
                    raise QueryFailed(48, f"Code: 48. DB::Exception: {flag}=1 (ClickHouse's compressed blocks) is not "
                                          "supported by the read endpoint; use HTTP compression or none. (NOT_IMPLEMENTED)")
            started = time.monotonic()
            answer = self.engine.answer(sql, args.get("default_format") or "TabSeparated", params, settings,
                                        args.get("database"))
        except QueryFailed as exc:
            self._fail(exc, query_id)
            return
        log.debug("read endpoint: %d bytes in %.3fs", len(answer.body), time.monotonic() - started)
        headers = {"Content-Type": _content_type(answer.fmt), "X-ClickHouse-Format": _header_safe(answer.fmt),
                   "X-ClickHouse-Summary": json.dumps(answer.summary, separators=(",", ":")),
                   "X-ClickHouse-Query-Id": query_id, "X-ClickHouse-Timezone": self.engine.timezone}
        body_out = answer.body
        if args.get("enable_http_compression") in ("1", "true"):
            accepted = {e.strip().split(";")[0] for e in self.headers.get("Accept-Encoding", "").split(",")}
            if "gzip" in accepted:
                body_out, headers["Content-Encoding"] = gzip.compress(body_out, 3), "gzip"
            elif "deflate" in accepted:
                body_out, headers["Content-Encoding"] = zlib.compress(body_out, 3), "deflate"
        self._send(200, body_out, headers)

    def _authenticated(self, args: Mapping[str, str]) -> bool:
        """The request names READ_USER and this start's password (compared in constant time)."""
        if "password" in args:
            return False
        user, key = self.headers.get("X-ClickHouse-User"), self.headers.get("X-ClickHouse-Key")
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        if key is None and scheme.lower() == "basic":
            try:
                user, _, key = base64.b64decode(token.strip(), validate=True).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                return False
        return user == READ_USER and key is not None and hmac.compare_digest(key.encode(), self.password.encode())

    def _fail(self, exc: QueryFailed, query_id: str = "") -> None:
        self._send(_STATUS.get(exc.code, 500), (exc.text.rstrip("\n") + "\n").encode(),
                   {"Content-Type": "text/plain; charset=UTF-8", "X-ClickHouse-Exception-Code": str(exc.code),
                    "X-ClickHouse-Query-Id": query_id})

    def _send(self, status: int, body: bytes, headers: Mapping[str, str], head: bool = False) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("X-ClickHouse-Server-Display-Name", "rlpulse-sink")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:  # said, so a client's pool does not send its next request on a closed connection
            self.send_header("Connection", "close")
        self.end_headers()
        if not head:
            self.wfile.write(body)


def _header_safe(value: str) -> str:
    """``value`` without what would end a header line (a FORMAT name comes from the statement)."""
    return re.sub(r"[^\x21-\x7e]", "", value)[:128]


def _content_type(fmt: str) -> str:
    for prefix, content_type in _CONTENT_TYPES:
        if fmt.startswith(prefix):
            return content_type
    return "application/octet-stream"


class ReadEndpoint:
    """The HTTP server, in daemon threads, and the endpoint file that lets readers find it."""

    def __init__(self, store_path: str | Path, port: int = 0, limits: ReadLimits | None = None, host: str = HOST):
        self.store_dir = Path(store_path)
        self.engine = Engine(str(store_path), limits or ReadLimits())
        self.user, self.password = READ_USER, secrets.token_urlsafe(24)  # never logged: it is in the 0600 file only
        handler = type("Handler", (_Handler,), {"engine": self.engine, "password": self.password})
        self._server = BoundedHTTPServer((host, port), handler, self.engine.limits.max_connections, _BUSY, "read endpoint",
                                         check_host=True)
        self.address: tuple[str, int] = self._server.server_address[:2]  # type: ignore[assignment]
        self.url = f"http://{self.address[0]}:{self.address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="rlpulse-read-endpoint", daemon=True)

    def start(self) -> ReadEndpoint:
        self._thread.start()
        path = publish(self.store_dir, self.url, self.user, self.password)
        log.info("read-only queries on the store at %s (loopback only; user and password in %s)", self.url, path)
        return self

    def close(self) -> None:
        withdraw(self.store_dir)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


@contextmanager
def serve_reads(store: Any, port: int | None = None, limits: ReadLimits | None = None) -> Iterator[ReadEndpoint | None]:
    """While the block runs, serve read-only queries on ``store`` if it is a chDB store (a server needs none).

    ``port``: None reads ``RLPULSE_READ_PORT`` (0, the default, picks a free port).
    """
    parts = urlsplit(store.url)
    if parts.scheme != "chdb":
        yield None
        return
    if port is None:
        port = int(os.environ.get(READ_PORT) or 0)
    endpoint = ReadEndpoint(parts.path, port=port, limits=limits).start()
    try:
        yield endpoint
    finally:
        endpoint.close()

