"""At-least-once into ClickHouse, exactly once through the saved queries: a full replay of every
offset, and a sink killed with SIGKILL between an insert and its offset commit, leave every
saved query's answer unchanged."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import subprocess
import sys
import time

import pytest

from producers.simulator import SimConfig, simulate
from rlpulse.pipeline import SINK_TOPICS, Pipeline, settings_env, wait_groups_ready
from rlpulse.settings import Settings
from schemas.topics import ensure_topics
from tests.integration.test_pipeline import _rewind_group

pytestmark = pytest.mark.integration

PROJECT = "faults"
RUN = f"{PROJECT}-run1"
SAVED = {
    "stalled-runs": [],
    "failures-by-cause": ["since=2020-01-01 00:00:00", "until=2100-01-01 00:00:00"],
    "reward-percentiles": [f"run_id={RUN}", "attempt=1"],
    "clipped-ratio-trend": [f"run_id={RUN}", "attempt=1"],
    "gpu-utilization-by-run": [f"run_id={RUN}"],
    "span-tree": [f"run_id={RUN}", "attempt=1", "rollout_id=s1-r3"],
}


def saved_answers(settings: Settings) -> dict:
    answers = {}
    for name, params in SAVED.items():
        args = [a for p in params for a in ("--param", p)]
        run = subprocess.run([sys.executable, "-m", "rlpulse.cli", "query", "--saved", name, "--format", "json", *args],
                             env=settings_env(settings), capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        answers[name] = json.loads(run.stdout)
    return answers


def test_replay_and_sigkill_between_insert_and_commit_change_no_saved_answer(settings: Settings) -> None:
    settings = dataclasses.replace(settings, stall_after=2.0, silent_after=30.0, heartbeat_interval=0.5)
    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        simulate(settings, SimConfig(project=PROJECT, runs=2, steps=3, gpu=True, stall_s=3.0))
        pipeline.wait_caught_up(time.time_ns() + int((settings.window + settings.allowed_lateness + 3) * 1e9))
        pipeline.stop()
    first = saved_answers(settings)
    assert len(first["reward-percentiles"]) == 3 and len(first["clipped-ratio-trend"]) == 3
    assert len(first["gpu-utilization-by-run"]) == 1 and first["span-tree"]
    assert {row["rule"] if "rule" in row else None for row in first["stalled-runs"]} <= {None, "stalled_run"}

    # Replay every offset; the first sink dies by SIGKILL right after its first insert.
    asyncio.run(_rewind_group(settings, settings.sink_group, SINK_TOPICS))
    with Pipeline(settings) as pipeline:
        pipeline.start(("sink",), extra_env={"RLPULSE_FAULT_KILL_AFTER_INSERTS": "1"})
        assert pipeline.procs["sink"].wait(120) == -signal.SIGKILL
        pipeline.procs.clear()
        pipeline.start(("sink",))
        pipeline.wait_caught_up(0)
        pipeline.stop()
    assert saved_answers(settings) == first
