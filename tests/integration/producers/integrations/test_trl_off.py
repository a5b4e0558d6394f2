"""Telemetry off with the judge kept, in a real TRL ``GRPOTrainer`` (TRL 1.16, CPU, the trainer venv of
``test_trl_job.py``): ``tests/trainers/trl_off_job.py`` runs the reward functions of the real-TRL job,
written the integration's way (``GraderFailure`` returned and raised, None, NaN, a plain exception):

* without ``instrument``, TRL takes the returned ``GraderFailure`` as a reward and fails (``TypeError:
  must be real number, not GraderFailure``): what a user who deleted the line met;
* with ``instrument(trainer, ..., enabled=False)``, training runs to its last step, and TRL logged
  exactly what it logs instrumented (``instrument`` into an ``InMemoryTransport``): every figure of
  every step, rewards, losses, gradients, but the timings; nothing connects to a broker (the
  bootstrap is a closed port).

The job runs with no broker: ``RLPULSE_KAFKA_BOOTSTRAP`` names a port nothing listens on.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unavailable
from tests.trainers import trainer_venv

pytestmark = [pytest.mark.integration, pytest.mark.full]

JOB = Path(__file__).resolve().parents[3] / "trainers" / "trl_off_job.py"
TIMINGS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


@pytest.fixture(scope="module")
def trainer_python() -> Path:
    try:
        return trainer_venv.ensure(log=lambda line: print(f"trainer venv: {line}"))
    except (trainer_venv.VenvError, OSError) as exc:
        unavailable(f"the trainer venv {trainer_venv.VENV} could not be built "
                    f"(`python tests/trainers/trainer_venv.py` builds it): {exc}")


def run_job(python: Path, mode: str, workdir: Path) -> dict[str, Any]:
    out = workdir / f"{mode}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPULSE_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["RLPULSE_KAFKA_BOOTSTRAP"] = "127.0.0.1:1"  # nothing listens: telemetry off must not need a broker
    done = subprocess.run([str(python), str(JOB), str(out), mode], cwd=workdir, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert done.returncode == 0, f"the TRL job ({mode}) failed ({done.returncode}):\n{done.stdout[-6000:]}"
    result = json.loads(out.read_text())
    result["output"] = done.stdout
    return result


def figures(log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every figure TRL logged but the timings; NaN as a string, so that NaN equals NaN."""
    return [{k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in entry.items() if k not in TIMINGS}
            for entry in log_history]


def test_telemetry_off_keeps_a_judge_written_the_integrations_way_working_in_real_trl(trainer_python: Path,
                                                                                    tmp_path: Path) -> None:
    plain = run_job(trainer_python, "plain", tmp_path)
    assert plain["error"] == ["TypeError", "must be real number, not GraderFailure"], plain["output"][-3000:]

    off = run_job(trainer_python, "off", tmp_path)
    assert off["error"] is None, off["output"][-3000:]
    assert off["instrument_returned"] == "NoneType"
    steps = [entry["step"] for entry in off["log_history"] if "loss" in entry]
    assert steps == list(range(1, 7))
    # the generations at global_step 2 (length_reward raised GraderFailure) and 4 (judge_reward raised) were scored
    rewards = {entry["step"]: entry for entry in off["log_history"] if "reward" in entry}
    assert sorted(rewards) == [1, 3, 5] and all(math.isfinite(entry["reward"]) for entry in rewards.values())
    assert rewards[3]["rewards/length_reward/mean"] is None  # the raised GraderFailure: every score None (NaN) for TRL
    assert rewards[5]["rewards/judge_reward/mean"] is None  # the raised RuntimeError: the same
    assert "Kafka" not in off["output"]

    on = run_job(trainer_python, "on", tmp_path)
    assert on["error"] is None and on["instrument_returned"] == "TrlTelemetry" and on["grader_spans"] > 0
    assert figures(off["log_history"]) == figures(on["log_history"])  # TRL saw the same, telemetry on or off
