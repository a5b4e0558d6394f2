"""A message's spans are added per accumulator in one batch (``rlpulse.streams.runs.Batch``): the
figures must be exactly those of one add per span, whatever the order and mix of a message."""

from __future__ import annotations

import random

import pytest

from rlpulse.streams.histograms import ExpHistogram, RewardHistogram
from rlpulse.streams.runs import RunConfig, RunProcessor
from rlpulse.streams.stage import RunStage

from bench.workload import WorkloadConfig, messages

pytestmark = pytest.mark.full

NOW = 1_800_000_000_000_000_000


@pytest.mark.parametrize("seed", range(5))
def test_a_batch_add_is_one_add_per_value_bit_for_bit(seed: int) -> None:
    rng = random.Random(seed)
    rewards = [rng.choice([0.0, -0.5, 0.1 + 0.2, 1.0, 7.5, rng.random(), -rng.random()]) for _ in range(300)]
    # lengths: zeros, repeats, and values far outside the populated span (rebucketing mid-batch)
    lengths = [rng.choice([0, 1, 16, 1024, 2**20, rng.randrange(1, 5000), rng.random() * 1e-6]) for _ in range(300)]
    one, many = RewardHistogram(), RewardHistogram()
    for x in rewards:
        one.add(x)
    many.add_many(rewards[:7])
    many.add_many(rewards[7:])
    assert many == one
    ones, manys = ExpHistogram(), ExpHistogram()
    for v in lengths:
        ones.add(v)
    for i in range(0, 300, 50):
        manys.add_many(lengths[i:i + 50])
    assert manys.to_dict() == ones.to_dict() and manys.count == 300


def test_a_bad_value_in_a_batch_raises_as_one_add_does() -> None:
    with pytest.raises(ValueError, match="nan"):
        RewardHistogram().add_many([0.5, float("nan")])
    h = ExpHistogram()
    with pytest.raises(ValueError, match="non-negative"):
        h.add_many([3.0, -1.0])
    assert h.count == 1  # what came before the bad value is in, as with one add each


def run(split: bool, config: WorkloadConfig) -> list:
    """Every output of the workload, with each span container either whole or one span per message."""
    stage = RunStage(RunProcessor(RunConfig(window_s=10, lateness_s=100_000, idle_s=4), resumed_ns=NOW), {})
    out = []
    for m in messages(config, NOW):
        if m.short == "hardware":
            continue
        for records in ([[r] for r in m.records] if split and m.short == "spans" else [m.records]):
            out += stage.on_message(m.short, 0, records, NOW)
    out += stage.on_tick(0, NOW + 10**12)  # idle: every step and window closes now, once
    return sorted(repr(o) for o in out)


@pytest.mark.parametrize("config", [WorkloadConfig(runs=3, steps=6), WorkloadConfig(
    runs=2, steps=5, rollouts=13, terms=("judge", "format", "total"), steps_per_container=3, seed=11)])
def test_a_whole_message_gives_the_figures_of_one_span_per_message(config: WorkloadConfig) -> None:
    whole = run(False, config)
    assert len(whole) > 100 and whole == run(True, config)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -2.0])
@pytest.mark.parametrize("at", [0, 1, 2])
def test_a_value_add_refuses_anywhere_in_a_batch_raises_after_the_ones_before_it(bad: float, at: int) -> None:
    values = [5.0, 9.0, 700.0]
    values.insert(at, bad)
    h = ExpHistogram()
    with pytest.raises(ValueError):
        h.add_many(values)
    one = ExpHistogram()
    for v in values[:at]:
        one.add(v)
    assert h == one
