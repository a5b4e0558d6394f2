"""The file that lets readers find the sink's read endpoint, and the readers' side of it.

While ``rlpulse sink`` holds a chDB store it serves reads (``rlpulse.sinks.read.read_endpoint``) and
publishes where, and with which credentials, in ``endpoint`` in the store directory:
``{"url", "pid", "user", "password"}``, mode 0600 (loopback is open to every local user, this file
only to the store's owner), written whole (a temporary file renamed over it) and removed at exit by
the process that wrote it. A reader (``rlpulse query``, ``report``, ``watch``) trusts a file only
while its pid is the store lock's holder: one left by a sink that died is ignored.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import NamedTuple

ENDPOINT_FILE = "endpoint"  # in the store directory: {"url", "pid", "user", "password"}, 0600, removed at exit


class Endpoint(NamedTuple):
    """Where a sink serves reads, and the credentials it takes."""

    url: str
    user: str
    password: str

    def __repr__(self) -> str:  # never the password, should one be logged or put in an error
        return f"Endpoint(url={self.url!r}, user={self.user!r}, password='***')"


def publish(store_dir: Path, url: str, user: str, password: str) -> Path:
    """Write the endpoint file for this process (0600, whole or not at all); returns its path."""
    path = store_dir / ENDPOINT_FILE
    tmp = path.with_name(f".{ENDPOINT_FILE}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "pid": os.getpid(), "user": user, "password": password}, f)
    os.replace(tmp, path)  # readers never see half a file
    return path


def withdraw(store_dir: Path) -> None:
    """Remove the endpoint file if this process wrote it (a newer sink's is left alone)."""
    path = store_dir / ENDPOINT_FILE
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def _holder_pid(store_dir: Path) -> tuple[int | None, str]:
    try:
        text = (store_dir / "rlpulse.lock").read_text()
    except OSError:
        return None, ""
    m = re.match(r"pid (\d+)", text)
    return (int(m.group(1)) if m else None), text


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
