"""Terminal escapes from the data, through the real command: a value carrying them, read by
`rlpulse query` from the real ClickHouse engine, is printed neutralised (table, CSV and JSON)."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys

import pytest

from rlpulse.pipeline import settings_env
from rlpulse.base.settings import Settings

pytestmark = pytest.mark.integration
HOSTILE_SQL = "SELECT concat('run', char(27), ']0;pwned', char(7), char(10), 'forged-row', char(27), '[2J') AS run_id"


@pytest.mark.parametrize("fmt", ["table", "csv", "json"])
def test_query_prints_a_hostile_value_neutralised(settings: Settings, fmt: str) -> None:
    run = subprocess.run([sys.executable, "-m", "rlpulse.cli", "query", "--format", fmt, HOSTILE_SQL],
                         env=settings_env(settings), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "\x1b" not in run.stdout and "\x07" not in run.stdout, run.stdout
    if fmt == "json":
        assert json.loads(run.stdout) == [{"run_id": "run\x1b]0;pwned\x07\nforged-row\x1b[2J"}]  # escaped by JSON
    elif fmt == "csv":  # a newline stays inside its quoted field: the CSV reads back as one row
        assert list(csv.reader(io.StringIO(run.stdout))) == [["run_id"], ["run\\x1b]0;pwned\\x07\nforged-row\\x1b[2J"]]
    else:  # in a table a newline would forge a row: escaped too
        assert "run\\x1b]0;pwned\\x07\\nforged-row\\x1b[2J" in run.stdout
        assert not any(line.startswith("forged-row") for line in run.stdout.splitlines()), run.stdout
