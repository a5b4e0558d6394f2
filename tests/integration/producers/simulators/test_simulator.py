"""``rlpulse simulate --seed N --ground-truth F`` is reproducible."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlpulse.schemas.enums import FAILURE_CAUSES
from rlpulse.pipeline import settings_env
from rlpulse.base.settings import Settings

pytestmark = pytest.mark.integration


def simulate(settings: Settings, out: Path, seed: int) -> dict:
    run = subprocess.run(
        [sys.executable, "-m", "rlpulse.cli", "simulate", "--seed", str(seed), "--ground-truth", str(out),
         "--runs", "2", "--steps", "3", "--gpu", "--silent-run"],
        env=settings_env(settings), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(out.read_text())


def test_same_seed_same_ground_truth(settings: Settings, tmp_path: Path) -> None:
    first = simulate(settings, tmp_path / "a.json", seed=7)
    second = simulate(dataclasses.replace(settings, topic_prefix=settings.topic_prefix + "b"), tmp_path / "b.json", seed=7)
    other = simulate(settings, tmp_path / "c.json", seed=8)
    assert first == second
    assert first != other
    assert first["undelivered"] == 0 and first["gpu_samples"] == 6
    assert sum(first["rollouts"].values()) == 2 * 3 * 8 + 8  # two runs, and the silent one's single step
    causes = {key.rsplit("/", 1)[1] for key in first["failures"]}
    assert causes == set(FAILURE_CAUSES)
    assert "silent_run/sim/sim-silent/1/FIRING" in first["expected_alerts"]
