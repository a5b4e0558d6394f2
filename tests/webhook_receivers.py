"""Loopback webhook receivers that misbehave, for the tests of ``rlpulse alerts``' webhook client
(``sinks/alerts/webhook.py``): one that drips its answer a byte at a time, one that answers with an
endless body, one that answers a status of the URL's choosing; plain HTTP or TLS.

Each records what the client did: when each connection opened and closed, the bytes sent before the
client hung up, the requests' ``Authorization`` headers.
"""

from __future__ import annotations

import http.server
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path


def self_signed(folder: Path) -> tuple[Path, Path]:
    """(certificate, key) in PEM for 127.0.0.1, made by ``openssl``; trust the certificate as its own CA."""
    cert, key = folder / "receiver.pem", folder / "receiver.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


class _RawReceiver:
    """A TCP server that reads one request (headers and its Content-Length body) per connection and
    hands the connection to ``answer``; a thread per connection."""

    def __init__(self, tls: tuple[Path, Path] | None = None):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.context: ssl.SSLContext | None = None
        if tls is not None:
            self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.context.load_cert_chain(*tls)
        self.connections: list[tuple[float, float]] = []  # (accepted, closed by the client or done), monotonic
        self.requests = 0
        self._closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def url(self, userinfo: str = "", path: str = "/hook") -> str:
        scheme = "https" if self.context else "http"
        return f"{scheme}://{userinfo + '@' if userinfo else ''}127.0.0.1:{self.port}{path}"

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        accepted = time.monotonic()
        try:
            if self.context is not None:
                conn = self.context.wrap_socket(conn, server_side=True)
            conn.settimeout(30)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                body += chunk
            self.requests += 1
            self.answer(conn)
        except OSError:
            pass
        finally:
            self.connections.append((accepted, time.monotonic()))
            conn.close()

    def answer(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._closed.set()
        self.sock.close()


class DripReceiver(_RawReceiver):
    """Answers ``200 OK`` one byte every ``interval`` seconds: each read of the client gets a byte
    well within any per-read timeout, and the whole answer takes ``len(ANSWER) * interval``."""

    ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"

    def __init__(self, interval: float = 0.3, tls: tuple[Path, Path] | None = None):
        self.interval = interval
        super().__init__(tls)

    def answer(self, conn: socket.socket) -> None:
        for byte in self.ANSWER:
            conn.sendall(bytes([byte]))  # raises once the client hung up
            time.sleep(self.interval)


class HugeBodyReceiver(_RawReceiver):
    """Answers ``200 OK`` with a body of ``size`` bytes, streamed in 64 KiB chunks (never built in
    memory); ``sent`` is what it could send before the client closed the connection."""

    def __init__(self, size: int = 200 << 20):
        self.size = size
        self.sent: list[int] = []
        super().__init__()

    def answer(self, conn: socket.socket) -> None:
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {self.size}\r\nConnection: close\r\n\r\n".encode())
        chunk, sent = bytes(65536), 0
        try:
            while sent < self.size:
                sent += conn.send(chunk[: self.size - sent])
        finally:
            self.sent.append(sent)


class StatusReceiver:
    """Answers each POST with the status its path ends in (``/hook/503``), recording the ``Authorization`` headers."""

    def __init__(self) -> None:
        self.authorizations: list[str | None] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                self.rfile.read(int(self.headers["Content-Length"]))
                receiver.authorizations.append(self.headers["Authorization"])
                self.send_response(int(self.path.partition("?")[0].rsplit("/", 1)[1]))
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
