"""Progress lines for long waits: what a command is waiting for, and for how long.

Plain lines (no escape codes, no carriage returns), so a CI log reads the same as a terminal.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def elapsed(seconds: float) -> str:
    """``8s``, ``2m05s``, ``1h02m``: short enough for the end of a progress line."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Ticker:
    """While a ``with Ticker("waiting for X", say=print):`` block runs, a thread says
    ``waiting for X ... 5s`` every ``every`` seconds (not at once: a wait that ends quickly says
    nothing). ``update(text)`` changes what it says it is waiting for."""

    def __init__(self, what: str, say: Callable[[str], None] = print, every: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.what = what
        self.say = say
        self.every = every
        self.clock = clock
        self.started = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def line(self) -> str:
        return f"{self.what} ... {elapsed(self.clock() - self.started)}"

    def update(self, what: str) -> None:
        self.what = what

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.say(self.line())

    def __enter__(self) -> Ticker:
        self.started = self.clock()
        self._thread = threading.Thread(target=self._run, name="rlpulse-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
