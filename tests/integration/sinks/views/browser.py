"""What the browser tests of ``rlpulse ui`` share: Debian's chromium through Playwright, and the
real ``rlpulse ui`` command started on a free loopback port for the length of a test module."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlpulse.base.env import UI_TOKEN
from rlpulse.base.settings import Settings
from rlpulse.pipeline import settings_env
from tests.conftest import unavailable

REPO = Path(__file__).resolve().parents[4]
CHROMIUM = "/usr/bin/chromium"  # Debian's: the tests never download a browser


def playwright_or_unavailable() -> Any:
    """Playwright's ``sync_playwright``, or the test is unavailable (a skip; a failure under CI=true)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("playwright is not installed (pip install -e '.[dev]' installs the pinned one)")
    if not os.access(CHROMIUM, os.X_OK):
        unavailable(f"{CHROMIUM} is missing (apt-get install chromium, or `make browser`)")
    return sync_playwright


@contextmanager
def ui_server(settings: Settings, token: str) -> Iterator[str]:
    """``rlpulse ui --port 0`` as a user runs it; yields the link it prints (``http://127.0.0.1:PORT/?token=...``)."""
    env = {**settings_env(settings), "PYTHONPATH": str(REPO), UI_TOKEN: token}
    ui = subprocess.Popen([sys.executable, "-m", "rlpulse.cli", "ui", "--port", "0"], env=env, cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = [ui.stdout.readline() for _ in range(2)]  # type: ignore[union-attr]
        link = re.search(r"open (http://127\.0\.0\.1:\d+/\?token=\S+)", "".join(lines))
        assert link, lines
        yield link.group(1)
    finally:
        ui.terminate()
        ui.wait(timeout=30)
