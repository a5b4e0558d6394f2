"""Simulated training runs through the real SDK, with their ground truth.

Deterministic for a seed (event times aside): the same seed gives the same rollouts, rewards
and grader outcomes, and :func:`simulate` returns what it sent so tests and the demo can
compare ClickHouse with it.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from producers.events import GRADER_OUTCOMES
from producers.telemetry import TrainingTelemetry
from rlpulse.settings import Settings

TERMS = ("judge", "format")


@dataclass
class GroundTruth:
    spans: int = 0
    steps: int = 0  # step-table rows: RUN_START + STEP per step + RUN_END (+ heartbeats, not counted here)
    rollouts: int = 0
    graded: Counter = field(default_factory=Counter)  # (run_id, term) -> scores
    failures: Counter = field(default_factory=Counter)  # (run_id, term, cause) -> failures
    undelivered: int = 0

    def as_dict(self) -> dict:
        return {
            "spans": self.spans, "steps": self.steps, "rollouts": self.rollouts, "undelivered": self.undelivered,
            "graded": {f"{r}/{t}": n for (r, t), n in sorted(self.graded.items())},
            "failures": {f"{r}/{t}/{c}": n for (r, t, c), n in sorted(self.failures.items())},
        }


def simulate(
    settings: Settings,
    project: str,
    runs: int = 3,
    steps: int = 4,
    rollouts_per_step: int = 8,
    seed: int = 7,
    progress: Callable[[str], None] = lambda line: None,
    stall_s: float = 0.0,
) -> GroundTruth:
    """Publish ``runs`` short RL runs; every failure cause occurs in every run.

    With ``stall_s``, the last run stops making progress after its first step for that long
    while its heartbeats go on (a stalled job), then carries on.
    """
    rng = random.Random(seed)
    truth = GroundTruth()
    for r in range(runs):
        run_id = f"{project}-run{r + 1}"
        with TrainingTelemetry(project=project, run_id=run_id, attempt=1, trainer="rl", settings=settings) as tel:
            truth.steps += 2  # RUN_START and RUN_END
            for step in range(steps):
                for i in range(rollouts_per_step):
                    rollout_id = f"s{step}-r{i}"
                    _one_rollout(tel, rng, truth, run_id, step, rollout_id, forced=(step * rollouts_per_step + i))
                tel.step_completed(step=step, tokens=rng.randint(50_000, 150_000), duration_s=rng.uniform(2, 6),
                                   mfu=round(rng.uniform(0.3, 0.5), 3))
                truth.steps += 1
                if stall_s and r == runs - 1 and step == 0:
                    progress(f"run {run_id}: stalling for {stall_s:.0f}s after step 0 (heartbeats go on)")
                    tel.flush(60.0)
                    time.sleep(stall_s)
            truth.undelivered += tel.flush(60.0)
        progress(f"run {run_id}: {steps} steps x {rollouts_per_step} rollouts published")
    return truth


def _one_rollout(tel: TrainingTelemetry, rng: random.Random, truth: GroundTruth, run_id: str, step: int,
                 rollout_id: str, forced: int) -> None:
    max_tokens = 1024
    completion = rng.randint(100, 1200)
    shares = {}
    for t, term in enumerate(TERMS):
        # The first rollouts of a run walk through every outcome so each cause appears at least once.
        outcome = GRADER_OUTCOMES[forced - t * 2] if 0 <= forced - t * 2 < len(GRADER_OUTCOMES) else (
            rng.choices(GRADER_OUTCOMES, weights=(80, 8, 5, 4, 3))[0])
        score = round(rng.random(), 3) if outcome == "ok" else 0.0
        shares[term] = score * (0.7 if term == "judge" else 0.3)
        tel.grader(step=step, rollout_id=rollout_id, term=term, outcome=outcome, duration_s=rng.uniform(0.1, 3.0),
                   score=score)
        truth.spans += 1
        truth.graded[(run_id, term)] += 1
        if outcome != "ok":
            truth.failures[(run_id, term, outcome)] += 1
    tel.rollout(step=step, rollout_id=rollout_id, reward=sum(shares.values()), term_shares=shares,
                completion_tokens=min(completion, max_tokens), max_tokens=max_tokens, sample_id=f"prompt-{step}-{rollout_id[-1]}")
    truth.spans += 1
    truth.rollouts += 1
