"""A million-event backlog of 200 runs, published before the processors start, drains exactly.

The bench's workload (``bench.workload``: every run's writer, sequence ids, RUN_END naming its
last span) is published to the raw topics first; then ``rlpulse streams`` and ``rlpulse sink``
start as a user starts them and drain it. ClickHouse must then equal the truth counted from the
records themselves: failures by run, term and cause, rollouts and clipped per step, every raw
row. Rates are measured in ``make bench``, never here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from bench.drain import DrainConfig, measure_drain
from bench.e2e import check_exact, publish_backlog
from bench.monitor import EventIndex
from bench.workload import Truth, WorkloadConfig
from rlpulse.pipeline import Pipeline
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics

pytestmark = [pytest.mark.integration, pytest.mark.full]  # a million events: make test-all

# 200 runs x (10 steps x (250 rollouts x 2 spans + 50 traced rollouts x (LLM + TOOL)) + 10 STEP + RUN_START + RUN_END
# + 10 engine samples) = 1,204,400 events; each STEP carries 8 trainer scalars
WORKLOAD = WorkloadConfig(project="million", runs=200, steps=10, rollouts=250, steps_per_container=1)


def test_a_million_event_backlog_of_200_runs_drains_exactly(settings: Settings) -> None:
    settings = dataclasses.replace(settings, window=10.0, allowed_lateness=2.0)
    assert WORKLOAD.events == 1_204_400
    ensure_topics(settings)
    index, truth = EventIndex(), Truth()
    published = asyncio.run(publish_backlog(settings, WORKLOAD, index, truth, print))
    assert published["span_events"] + published["step_events"] + published["hardware_events"] == WORKLOAD.events
    assert index.total == WORKLOAD.events
    with Pipeline(settings) as pipeline:
        started = time.monotonic()
        pipeline.start()
        drained = asyncio.run(measure_drain(settings, pipeline, index, DrainConfig(timeout_s=600.0, profile_s=0.0),
                                            started, print))
        pipeline.check_alive()  # neither process restarted or died on the way
    assert drained.figures["drain_complete"], drained.timeline[-5:]
    exact = check_exact(settings, truth, WORKLOAD.project)
    assert exact["exact_checks"] == {"failures_by_cause": "exact", "step_rollouts_clipped": "exact", "span_rows": "exact",
                                     "step_rows": "exact", "llm_tool_spans": "exact", "trainer_metrics": "exact",
                                     "engine_rows": "exact"}, exact
    assert truth.events == {"spans": 1_200_000, "steps": 2_400, "hardware": 2_000}
    assert truth.kinds == {"GRADER": 500_000, "ROLLOUT": 500_000, "LLM": 100_000, "TOOL": 100_000}
    assert truth.metrics == 200 * 10 * 8
    assert len(truth.step_stats()) == 200 * 10  # every step of every run was compared
