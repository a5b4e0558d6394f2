"""A run's steps and windows travel through the changelog as positional lists (``encode`` /
``decode``): they must read back to the same figures, a state an older worker wrote (dicts) must
still restore, and the bytes a message writes must be fewer than the dicts'."""

from __future__ import annotations

import orjson
import pytest

from rlpulse.streams.runs import RunConfig, RunProcessor
from rlpulse.streams.stage import RunStage, load_state
from rlpulse.streams.state import Run

from bench.workload import WorkloadConfig, messages

pytestmark = pytest.mark.full

NOW = 1_800_000_000_000_000_000


def plain(run: Run) -> dict:
    """The run as the dicts an older worker wrote for its steps and windows."""
    state = orjson.loads(orjson.dumps(run.to_dict()))
    state["steps"] = {k: f.to_dict() for k, f in run.steps.items()}
    state["windows"] = {k: w.to_dict() for k, w in run.windows.items()}
    return orjson.loads(orjson.dumps(state))


def test_every_state_of_a_workload_reads_back_and_an_older_workers_dicts_restore() -> None:
    stage = RunStage(RunProcessor(RunConfig(window_s=10, lateness_s=2, idle_s=4), resumed_ns=NOW), {})
    compact = dicts = checked = 0
    config = WorkloadConfig(runs=4, terms=("judge", "format"), rollouts=20)
    for i, m in enumerate(messages(config, NOW)):
        if m.short == "hardware":
            continue
        stage.on_message(m.short, 0, m.records, NOW + i)
        value = stage.table[m.key]
        live = stage._cache[m.key][1]  # noqa: SLF001 - the run the processor holds
        restored = Run.from_dict(load_state(value))
        older = plain(live)
        assert plain(restored) == older  # every field of every step and window, the sums bit for bit
        assert plain(Run.from_dict(older)) == older  # dicts written before the lists restore
        if live.steps:
            checked += 1
            compact += len(value)
            dicts += len(orjson.dumps(older))
    assert checked > 10 and compact < 0.7 * dicts, (compact, dicts)
