"""``rlpulse ui --allow-host``: the names a ui bound beyond loopback answers to, through the command a
user runs; any other Host gets 403 before the token is looked at, and a malformed name is refused."""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.full

TOKEN = "allow-host-test-token-0123456789"


def status(port: int, host: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/ui.css", headers={"Host": host, "Authorization": f"token {TOKEN}"})
        return conn.getresponse().status
    finally:
        conn.close()


def test_the_named_hosts_are_answered_and_no_other(tmp_path: Path) -> None:
    env = {**os.environ, "RLPULSE_UI_TOKEN": TOKEN, "RLPULSE_CLICKHOUSE_URL": f"chdb://{tmp_path / 'store'}"}
    ui = subprocess.Popen([sys.executable, "-m", "rlpulse.cli", "ui", "--port", "0", "--allow-host", "ui.lab.example",
                           "--allow-host", "[fd00::7]"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    try:
        port = None
        assert ui.stdout is not None
        for line in ui.stdout:
            found = re.search(r"open http://127\.0\.0\.1:(\d+)/", line)
            if found:
                port = int(found.group(1))
                break
        assert port is not None
        assert status(port, "ui.lab.example:8421") == 200
        assert status(port, "[fd00::7]:8421") == 200
        assert status(port, f"127.0.0.1:{port}") == 200
        assert status(port, "rebound.example") == 403
    finally:
        ui.terminate()
        ui.wait(timeout=10)


def test_a_malformed_name_is_refused_naming_it() -> None:
    done = subprocess.run([sys.executable, "-m", "rlpulse.cli", "ui", "--allow-host", "evil.example:80"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--allow-host 'evil.example:80' is not a host name" in done.stderr, done
