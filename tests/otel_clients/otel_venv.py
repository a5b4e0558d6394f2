"""The OpenTelemetry client venv (``.venv-otel`` in the checkout): the OpenTelemetry SDK with its
OTLP/HTTP exporter, ``openai`` and the OpenInference and OpenLLMetry instrumentations, pinned in
``requirements-otel.txt``, plus the rlpulse SDK, and nothing of the pipeline: the OTLP-in tests run
a job in it (``seed001_job.py``, ``instrumented_openai.py``) as a user's process would be, exporting
to a Collector or ``rlpulse otlp``, while the pipeline runs in the test's own venv.

Built as the agent venv is (``tests/agents/agent_venv.py``, through ``tests/trainers/trainer_venv.py``:
the framework layer keyed on the requirements file, the SDK layer on its sources). Build it ahead:
``.venv/bin/python tests/otel_clients/otel_venv.py``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from collections.abc import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.trainers import trainer_venv  # noqa: E402 - runnable as a script too

ROOT = trainer_venv.ROOT
HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements-otel.txt"
VENV = ROOT / ".venv-otel"
SEED001_JOB = HERE / "seed001_job.py"
INSTRUMENTED_OPENAI = HERE / "instrumented_openai.py"
VenvError = trainer_venv.VenvError


def ensure(log: Callable[[str], None] = print) -> Path:
    """The OpenTelemetry venv's python, built or refreshed when stale; raises VenvError with pip's output."""
    return trainer_venv.ensure(venv=VENV, root=ROOT, log=log, requirements=REQUIREMENTS)


if __name__ == "__main__":
    started = time.monotonic()
    print(ensure(), f"ready in {time.monotonic() - started:.0f}s")
