"""The reference pages of ``docs/reference/`` are what ``rlpulse reference`` generates now.

A change to the catalogue (a record's field, a table's column, an alert rule, a saved query, a
setting) without the pages regenerated fails here, naming the stale page.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ROOT / "docs" / "reference"


def _check(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlpulse.cli", "reference", "--check", "--out", str(folder)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_the_committed_pages_are_current() -> None:
    done = _check(PAGES)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.full  # the check's own check: make test keeps the one that guards the pages
def test_a_stale_page_is_named(tmp_path: Path) -> None:
    shutil.copytree(PAGES, tmp_path / "reference")
    alerts = tmp_path / "reference" / "alerts.md"
    alerts.write_text(alerts.read_text().replace("`stalled_run`", "`stalled_runs`"))
    (tmp_path / "reference" / "queries.md").unlink()
    done = _check(tmp_path / "reference")
    assert done.returncode == 1
    assert sorted(line.split("/")[-1].split()[0] for line in done.stdout.splitlines()) == ["alerts.md", "queries.md"]


def test_the_pages_name_every_rule_query_and_variable() -> None:
    from rlpulse.base import env as envvars
    from rlpulse.sinks.read.queries import list_saved
    from rlpulse.streams.alerting import SEVERITY

    alerts, queries, settings = ((PAGES / n).read_text() for n in ("alerts.md", "queries.md", "settings.md"))
    assert [r for r in SEVERITY if f"`{r}`" not in alerts] == []
    assert [q for q in list_saved() if f"## {q}\n" not in queries] == []
    assert [v for v in envvars.VARIABLES if f"`{v}`" not in settings] == []
