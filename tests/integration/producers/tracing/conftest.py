"""The agent venv for the traced-call tests of real agent stacks (``tests/agents/agent_venv.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.agents import agent_venv
from tests.conftest import unavailable


@pytest.fixture(scope="session")
def agent_python() -> Path:
    """The agent venv's python, built or refreshed when stale; under ``CI=true`` a venv that cannot be
    built fails the tests that ask for it, elsewhere they skip, saying why."""
    try:
        return agent_venv.ensure(log=lambda line: print(f"agent venv: {line}"))
    except (agent_venv.VenvError, OSError) as exc:
        unavailable(f"the agent venv {agent_venv.VENV} could not be built (`python tests/agents/agent_venv.py` builds it): {exc}")
