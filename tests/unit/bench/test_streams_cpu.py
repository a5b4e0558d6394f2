"""bench/streams_cpu.py hands every event of the drain's workload to the worker and counts what it wrote."""

import pytest

from bench.streams_cpu import measure
from bench.workload import WorkloadConfig

pytestmark = pytest.mark.full


def test_every_event_of_the_workload_reaches_the_worker_and_its_state_is_counted():
    result = measure(runs=5)
    assert result["events"] == WorkloadConfig(runs=5).events  # 1,222 events a run
    assert result["messages"] == 5 * (2 * 5 + 5)  # per run: 5 chunks of a span, a step and an engine container
    # each run's steps and windows closed and were published; its state was written once per message
    assert result["output_messages"] > 0
    assert result["changelog_bytes_per_message"] > 0
