"""The agent-stack venv (``.venv-agents`` in the checkout): ``openai``, ``langchain-openai``, ``langgraph``,
``mcp`` and ``dashscope``, pinned in ``requirements-agents.txt``, plus the SDK, and nothing of the
pipeline: the traced-call tests run an agent in it as a user's job would, against servers the test
starts on loopback, while the pipeline runs in the test's own venv.

Built as the trainer venv is (``tests/trainers/trainer_venv.py``: the framework layer keyed on the
requirements file, the SDK layer on its sources). Build it ahead: ``.venv/bin/python tests/agents/agent_venv.py``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from collections.abc import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.trainers import trainer_venv  # noqa: E402 - runnable as a script too

ROOT = trainer_venv.ROOT
REQUIREMENTS = Path(__file__).with_name("requirements-agents.txt")
VENV = ROOT / ".venv-agents"
VenvError = trainer_venv.VenvError


def ensure(log: Callable[[str], None] = print) -> Path:
    """The agent venv's python, built or refreshed when stale; raises VenvError with pip's output."""
    return trainer_venv.ensure(venv=VENV, root=ROOT, log=log, requirements=REQUIREMENTS)


if __name__ == "__main__":
    started = time.monotonic()
    print(ensure(), f"ready in {time.monotonic() - started:.0f}s")
