"""Slow clients for the servers' tests: connections that send a request one byte at a time (slowloris).

``Drip(address, n, every)`` opens ``n`` connections and, on a thread of its own, sends each of them one
more byte of an endless request head every ``every`` seconds, until it is closed. ``closed_at`` says when
the server closed each one (None while it is open), counted from its connect.
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

HEAD = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100_000


class Drip:
    def __init__(self, address: tuple[str, int], n: int, every: float = 2.0, head: bytes = HEAD):
        self.head, self.every = head, every
        self.socks: list[socket.socket] = []
        self.opened: list[float] = []
        self.closed_at: list[float | None] = []
        self.early_answers: list[bytes] = []  # what the server sent instead of waiting (a 503 at accept)
        for _ in range(n):
            s = socket.create_connection(address, timeout=5)
            try:
                s.sendall(head[:1])
            except OSError:  # answered 503 and closed at accept
                pass
            self.socks.append(s)
            self.opened.append(time.monotonic())
            self.closed_at.append(None)
        self._sent = [1] * n
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slowloris", daemon=True)
        self._thread.start()

    def _closed(self, i: int, s: socket.socket) -> bool:
        """Whether the server closed connection i (it may have sent an answer first)."""
        s.setblocking(False)
        try:
            got = s.recv(65536)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        finally:
            s.setblocking(True)
        if got:
            self.early_answers.append(got)
            return self._closed(i, s)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            for i, s in enumerate(self.socks):
                if self.closed_at[i] is not None:
                    continue
                if self._closed(i, s):
                    self.closed_at[i] = time.monotonic() - self.opened[i]
                    continue
                try:
                    s.send(self.head[self._sent[i]:self._sent[i] + 1])
                    self._sent[i] += 1
                except OSError:
                    self.closed_at[i] = time.monotonic() - self.opened[i]

    def open_count(self) -> int:
        return sum(c is None for c in self.closed_at)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for s in self.socks:
            s.close()

    def __enter__(self) -> Drip:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
