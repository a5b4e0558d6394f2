"""The public streams harness works as docs/figures-and-alerts.md shows it: its example runs here."""

from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "figures-and-alerts.md"


def test_the_guides_harness_example_runs_and_its_assertion_holds() -> None:
    section = GUIDE.read_text().split("## Testing figures and rules offline", 1)[1]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)[:1]
    assert "assert (stats" in code  # the example checks figures itself: a wrong figure fails here
    namespace: dict = {}
    exec(compile(code, str(GUIDE), "exec"), namespace)
    assert namespace["stats"]["clipped_ratio"] == 0.25
