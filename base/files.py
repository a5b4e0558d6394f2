"""File helpers at the ground: owner-only files and folders, and where the home is.

Every part of rlpulse (SDK, streams, sinks, the CLI) may import this; it imports nothing of theirs.
"""

from __future__ import annotations

import os
from pathlib import Path

# What rlpulse and the processes it starts create (the chDB store, the broker's data, logs, pid
# files) is the owner's only: the store holds every run's data, the logs name hosts and runs.
PRIVATE_UMASK = 0o077


def private_dir(path: Path) -> Path:
    """``path`` (and missing parents) as a directory only its owner can enter, whatever the umask.

    An existing directory is tightened too: one made by an older version with 0755 stops
    exposing what is in it.
    """
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):  # Path.mkdir(parents=True) would make the parents with the umask's mode
        folder.mkdir(mode=0o700, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


def private_file(path: Path, append: bool = True) -> int:
    """An fd of ``path`` opened for writing, created (or tightened) to 0600 for its owner alone."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o600)
    if os.fstat(fd).st_mode & 0o077:
        os.fchmod(fd, 0o600)
    return fd
