"""The agent-lightning venv (``.venv-agentlightning`` in the checkout): agent-lightning 0.3.0 with AgentOps,
``openai`` and LiteLLM, pinned in ``requirements-agentlightning.txt``, plus the SDK, and nothing of the
pipeline. ``test_agentlightning_parity.py`` runs ``policy.py``'s agent in it twice, once under
agent-lightning's tracer (``al_agent.py``, its adapters run there too) and once under rlpulse's
(``rlpulse_agent.py``), while the pipeline runs in the test's own venv.

Built as the trainer venv is (``tests/trainers/trainer_venv.py``: the framework layer keyed on the
requirements file and the interpreter, the SDK layer on its sources). Build it ahead:
``.venv/bin/python tests/agentlightning/al_venv.py`` (about a minute from nothing, 150 packages, no GPU
wheels; measured in docs/agentlightning.md).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.trainers import trainer_venv  # noqa: E402 - runnable as a script too

ROOT = trainer_venv.ROOT
REQUIREMENTS = Path(__file__).with_name("requirements-agentlightning.txt")
VENV = ROOT / ".venv-agentlightning"
VenvError = trainer_venv.VenvError


def ensure(log: Callable[[str], None] = print) -> Path:
    """The venv's python, built or refreshed when stale; raises VenvError with pip's output."""
    return trainer_venv.ensure(venv=VENV, root=ROOT, log=log, requirements=REQUIREMENTS)


if __name__ == "__main__":
    started = time.monotonic()
    print(ensure(), f"ready in {time.monotonic() - started:.0f}s")
