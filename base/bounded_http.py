"""The HTTP server under the sink's read endpoint and ``rlpulse ui``: the standard library's, bounded.

A thread per connection, at most ``max_connections`` of them. A connection over the cap is answered
``busy`` (a complete 503) by the accepting thread, which never waits on a client, and closed, so
a flood cannot take the process's file descriptors or threads. A failed connection is one log line
under ``label``, never a traceback.
"""

from __future__ import annotations

import logging
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

log = logging.getLogger(__name__)


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections``; the ones over are answered ``busy`` at accept."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: a burst waits to be accepted (and refused) instead of retrying SYNs

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int,
                 busy: bytes, label: str):
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._busy, self._label = busy, label
        self.refused = 0  # connections turned away, for the log and the tests

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            try:
                request.settimeout(0)  # the accepting thread never waits on a client
                request.send(self._busy)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:  # one line, never a traceback
        log.warning("%s: connection from %s failed: %s", self._label, client_address[0], type(sys.exc_info()[1]).__name__)


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
