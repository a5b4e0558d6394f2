"""Every test here runs twice: with the streams' compiled loops (``streams/_loops.pyx``, where
they are built) and, in ``make test-all``, with the methods' own Python
(``rlpulse.streams.compiled.LOOPS`` set to None): the two must give the same figures.
``test_loops.py`` compares the two itself, case by case, and runs once."""

from __future__ import annotations

import pytest

from rlpulse.streams import compiled

BOTH_WAYS_ITSELF = "test_loops.py"


@pytest.fixture(autouse=True, params=["compiled", pytest.param("python", marks=pytest.mark.full)])
def loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "python":
        monkeypatch.setattr(compiled, "LOOPS", None)
    return str(request.param)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    twice = [i for i in items if i.path.name == BOTH_WAYS_ITSELF and hasattr(i, "callspec")
             and i.callspec.params.get("loops") == "python"]
    if twice:
        config.hook.pytest_deselected(items=twice)
        items[:] = [i for i in items if i not in twice]
