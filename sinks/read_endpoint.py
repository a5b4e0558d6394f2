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
after the request. What may run there, read-only and within limits, is ``sinks.read_engine``'s.

Every request but ``/ping`` must carry the user ``rlpulse`` and the password the sink drew at
start (``secrets.token_urlsafe``), as HTTP basic auth (what clickhouse-connect and Grafana send)
or ``X-ClickHouse-User``/``X-ClickHouse-Key`` headers: loopback is open to every local user,
the endpoint file that holds the password only to the store's owner. Anything else gets
ClickHouse's AUTHENTICATION_FAILED (516, HTTP 403). A password in the URL is refused too: URLs
end up in shell histories and logs.

chDB releases the GIL while a query runs, and the server runs in its own threads, so the sink's
event loop and inserts go on meanwhile. What a query can take from ingestion is bounded by
:class:`ReadLimits`: ``max_execution_time`` per query, ``max_threads`` (one core of two), memory and
result size, and at most ``max_concurrent`` queries at once (others wait their turn, then get 503).
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
from contextlib import contextmanager
from email.parser import BytesParser
from email.policy import HTTP
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple
from urllib.parse import parse_qsl, urlsplit

from rlpulse.schemas.env import READ_PORT
from rlpulse.sinks.read_engine import Engine, QueryFailed, ReadLimits

log = logging.getLogger(__name__)

ENDPOINT_FILE = "endpoint"  # in the store directory: {"url", "pid", "user", "password"}, 0600, removed at exit
HOST = "127.0.0.1"
READ_USER = "rlpulse"  # the one user; its password is new at every sink start
MAX_BODY = 16 * 1024 * 1024  # a query, not data: nothing is inserted here

# URL parameters that steer the HTTP exchange rather than the query (accepted, not applied).
_TRANSPORT = frozenset({
    "query", "database", "default_format", "session_id", "session_timeout", "session_check", "query_id", "user",
    "password", "quota_key", "buffer_size", "wait_end_of_query", "client_protocol_version", "enable_http_compression",
    "http_zlib_compression_level", "send_progress_in_http_headers", "http_headers_progress_interval_ms",
    "cancel_http_readonly_queries_on_client_close", "role", "stacktrace", "add_http_cors_header", "compress",
    "decompress", "http_native_compression_disable_checksumming_on_decompress",
})
# ClickHouse's exceptionCodeToHTTPStatus, for the codes a read can meet.
_STATUS = {**{c: 400 for c in (6, 27, 36, 38, 41, 53, 62, 69, 72, 167, 168, 457, 456)},
           **{c: 404 for c in (46, 47, 60, 63, 73, 81, 115, 170)},
           497: 403, 516: 403, 48: 501, 159: 408, 202: 503}
_CONTENT_TYPES = (("TabSeparated", "text/tab-separated-values; charset=UTF-8"), ("TSV", "text/tab-separated-values; charset=UTF-8"),
                  ("CSV", "text/csv; charset=UTF-8"), ("JSONEachRow", "application/x-ndjson; charset=UTF-8"),
                  ("JSONLines", "application/x-ndjson; charset=UTF-8"), ("NDJSON", "application/x-ndjson; charset=UTF-8"),
                  ("JSON", "application/json; charset=UTF-8"), ("Pretty", "text/plain; charset=UTF-8"),
                  ("Vertical", "text/plain; charset=UTF-8"), ("Markdown", "text/markdown; charset=UTF-8"))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: clients pool their connections
    server_version = "rlpulse-read-endpoint"
    timeout = 60  # a silent client gives its thread back
    engine: Engine  # set on the subclass made per server
    password: str  # likewise

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("read endpoint: " + format, *args)

    def do_HEAD(self) -> None:  # noqa: N802
        self._send(200, b"", {"Content-Type": "text/plain; charset=UTF-8"}, head=True)

    def do_GET(self) -> None:  # noqa: N802
        self._handle(b"")

    def do_POST(self) -> None:  # noqa: N802
        try:
            body = self._body()
        except QueryFailed as exc:
            self._fail(exc)
            return
        self._handle(body)

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks, size = [], 0
            while True:
                n = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if n == 0:
                    while self.rfile.readline().strip():  # trailers
                        pass
                    break
                size += n
                if size > MAX_BODY:
                    raise QueryFailed(36, "Code: 36. DB::Exception: Request body over 16 MiB: the "
                                                             "read endpoint takes queries, not data. (BAD_ARGUMENTS)")
                chunks.append(self.rfile.read(n))
                self.rfile.readline()
            data = b"".join(chunks)
        else:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                raise QueryFailed(36, "Code: 36. DB::Exception: Request body over 16 MiB: the read endpoint takes "
                                      "queries, not data. (BAD_ARGUMENTS)")
            data = self.rfile.read(length) if length else b""
        encoding = self.headers.get("Content-Encoding", "identity").lower()
        if encoding == "gzip":
            data = gzip.decompress(data)
        elif encoding == "deflate":
            data = zlib.decompress(data)
        elif encoding not in ("identity", ""):
            raise QueryFailed(48, f"Code: 48. DB::Exception: Content-Encoding {encoding} is not supported by the "
                                  "read endpoint (gzip, deflate). (NOT_IMPLEMENTED)")
        return data

    def _handle(self, body: bytes) -> None:
        url = urlsplit(self.path)
        if url.path in ("/ping", "/replicas_status"):
            self._send(200, b"Ok.\n", {"Content-Type": "text/plain; charset=UTF-8"})
            return
        if url.path not in ("/", ""):
            self._send(404, f"There is no handle {url.path}\n".encode(), {"Content-Type": "text/plain; charset=UTF-8"})
            return
        args = dict(parse_qsl(url.query, keep_blank_values=True))
        if not self._authenticated(args):
            self._fail(QueryFailed(516, "Code: 516. DB::Exception: Authentication failed: password is incorrect, or "
                                        "there is no user with such name; the sink's read endpoint takes the user and "
                                        f"password in the '{ENDPOINT_FILE}' file of its store directory, as HTTP basic "
                                        "auth or X-ClickHouse-User/X-ClickHouse-Key headers. (AUTHENTICATION_FAILED)"),
                       args.get("query_id", ""))
            return
        content_type = self.headers.get("Content-Type", "")
        if content_type.startswith("multipart/form-data"):
            # clickhouse-connect sends long parameter values (and the query with them) as a form.
            message = BytesParser(policy=HTTP).parsebytes(f"Content-Type: {content_type}\r\n\r\n".encode() + body)
            for part in message.iter_parts():
                name = part.get_param("name", header="content-disposition")
                if name and part.get_filename() is None:
                    args[name] = part.get_payload(decode=True).decode()
            body = b""
        query_id = args.get("query_id") or str(uuid.uuid4())
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
        headers = {"Content-Type": _content_type(answer.fmt), "X-ClickHouse-Format": answer.fmt,
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
        self.end_headers()
        if not head:
            self.wfile.write(body)


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
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.address: tuple[str, int] = self._server.server_address[:2]  # type: ignore[assignment]
        self.url = f"http://{self.address[0]}:{self.address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="rlpulse-read-endpoint", daemon=True)

    def start(self) -> "ReadEndpoint":
        self._thread.start()
        path = self.store_dir / ENDPOINT_FILE
        tmp = path.with_name(f".{ENDPOINT_FILE}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": self.url, "pid": os.getpid(), "user": self.user, "password": self.password}, f)
        os.replace(tmp, path)  # readers never see half a file
        log.info("read-only queries on the store at %s (loopback only; user and password in %s)", self.url, path)
        return self

    def close(self) -> None:
        path = self.store_dir / ENDPOINT_FILE
        try:
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()
        except (OSError, ValueError):
            pass
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


def _holder_pid(store_dir: Path) -> tuple[int | None, str]:
    try:
        text = (store_dir / "rlpulse.lock").read_text()
    except OSError:
        return None, ""
    m = re.match(r"pid (\d+)", text)
    return (int(m.group(1)) if m else None), text


class Endpoint(NamedTuple):
    """Where a sink serves reads, and the credentials it takes."""

    url: str
    user: str
    password: str

    def __repr__(self) -> str:  # never the password, should one be logged or put in an error
        return f"Endpoint(url={self.url!r}, user={self.user!r}, password='***')"


def find_endpoint(store_dir: Path, wait: float = 5.0) -> Endpoint | None:
    """The read endpoint of the process holding the store at ``store_dir``, or None.

    A file left by a process that died is ignored (its pid is not the lock holder's). A sink that
    has just taken the lock (migrating, starting its server) gets ``wait`` seconds to publish it.
    """
    deadline = time.monotonic() + wait
    while True:
        pid, holder = _holder_pid(store_dir)
        try:
            found = json.loads((store_dir / ENDPOINT_FILE).read_text())
        except (OSError, ValueError):
            found = {}
        if pid is not None and found.get("pid") == pid and found.get("url"):
            return Endpoint(str(found["url"]), str(found.get("user", "")), str(found.get("password", "")))
        if "sink" not in holder or time.monotonic() > deadline:
            return None
        time.sleep(0.1)
