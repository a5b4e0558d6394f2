"""streams/_loops.pyx is its methods' Python, line for line: the same inputs through both give
the same state, float bits included, and the same errors.

Each case runs once with the compiled loops (``compiled.LOOPS``) and once with them off, on
fresh accumulators, and compares ``to_dict()`` as JSON (``repr`` of every float: exact)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from typing import Any

import pytest

from rlpulse.streams import compiled, figures
from rlpulse.streams.figures import GraderWindow, StepFigures
from rlpulse.streams.histograms import ExpHistogram, RewardHistogram, exp_index

from tests.conftest import unavailable

pytestmark = pytest.mark.full

COMPILED = compiled.LOOPS


@pytest.fixture(autouse=True)
def built() -> None:
    if COMPILED is None:
        unavailable("streams/_loops.pyx is not built: pip install -e . builds it (Cython and a C compiler)")


def both(monkeypatch: pytest.MonkeyPatch, run: Callable[[], Any]) -> tuple[str, str]:
    """``run()``'s result as JSON with the compiled loops, then without."""
    out = []
    for loops in (COMPILED, None):
        monkeypatch.setattr(compiled, "LOOPS", loops)
        out.append(json.dumps(run(), sort_keys=True))
    return out[0], out[1]


def spans(rng: random.Random, n: int, step: int = 7) -> list[dict[str, Any]]:
    terms = ["total", "format", "correct", "x" * 300] + [f"t{i}" for i in range(80)]
    out = []
    for _ in range(n):
        span: dict[str, Any] = {"time_ns": rng.randrange(10**18, 10**18 + 10**12), "step": step,
                                "reward": rng.choice([0.0, -0.0, 1.0, -2.5, 5.0, 1e-300, rng.uniform(-3, 7)])}
        if rng.random() < 0.5:
            span["clipped"] = rng.random() < 0.3
        if rng.random() < 0.7:
            span["term_shares"] = {t: rng.uniform(-1, 2) for t in rng.sample(terms, rng.randrange(0, 6))}
        if rng.random() < 0.8:
            span["completion_tokens"] = rng.choice([0, 1, 1024, rng.randrange(0, 100_000)])
        if rng.random() < 0.3:
            span["policy_version"] = rng.randrange(0, step + 3)
        if rng.random() < 0.8:
            span["sample_id"] = rng.choice([f"s{rng.randrange(40)}", "y" * 300])
        out.append(span)
    return out


def test_step_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(figures, "MAX_SAMPLES", 12)  # so sample groups are dropped too
    monkeypatch.setattr(figures, "MAX_TERMS", 20)  # and terms
    reached = []
    for seed in range(40):
        def run(seed: int = seed) -> dict[str, Any]:
            rng = random.Random(seed)
            f = StepFigures()
            for _ in range(rng.randrange(1, 6)):  # several messages into one step, some after it closed
                f.add_many(spans(rng, rng.randrange(0, 60)))
                f.closed = rng.random() < 0.3
            return f.to_dict()

        compiled, pure = both(monkeypatch, run)
        assert compiled == pure, seed
        state = json.loads(compiled)
        reached.append((state["terms_dropped"], state["samples_dropped"], state["stale"][0]))
    # the cases went through the caps and the staleness figures, not only the plain path
    assert sum(1 for t, _, _ in reached if t) >= 10 and sum(1 for _, s, _ in reached if s) >= 10
    assert sum(1 for _, _, n in reached if n) >= 30


@pytest.mark.parametrize("seed", range(30))
def test_reward_histogram(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    def run() -> dict[str, Any]:
        rng = random.Random(seed)
        h = RewardHistogram()
        for _ in range(5):
            h.add_many([rng.choice([0.0, -0.0, 0.1, 0.30000000000000004, 0.99, 1.0, 5.0, 5.000001, -7.0,
                                    rng.uniform(-1, 6)]) for _ in range(rng.randrange(0, 50))])
        return h.to_dict()

    compiled, pure = both(monkeypatch, run)
    assert compiled == pure


@pytest.mark.parametrize("seed", range(30))
def test_exp_histogram(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    def run() -> dict[str, Any]:
        rng = random.Random(seed)
        h = ExpHistogram(max_size=rng.choice([2, 8, 160]))
        for _ in range(6):  # lengths (ints), durations (floats), powers of two, spans that force a downscale
            h.add_many([rng.choice([0, 0.0, 1, 2, 1024, 2**40, 1e-9, 0.5, rng.randrange(1, 200_000),
                                    rng.uniform(0.0001, 30.0), 2.0 ** rng.randrange(-30, 30)])
                        for _ in range(rng.randrange(0, 40))])
        return h.to_dict()

    compiled, pure = both(monkeypatch, run)
    assert compiled == pure


def test_exp_index_is_the_same_bucket() -> None:
    rng = random.Random(3)
    values = [2.0**e for e in range(-60, 60)] + [math.nextafter(2.0**e, 0) for e in range(-60, 60)] + \
             [math.nextafter(2.0**e, math.inf) for e in range(-60, 60)] + [rng.uniform(1e-6, 1e9) for _ in range(3000)] + \
             [float(n) for n in range(1, 3000)]
    for scale in range(-10, 21):
        assert [COMPILED.exp_index(v, scale) for v in values] == [exp_index(v, scale) for v in values], scale


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_the_same_errors(monkeypatch: pytest.MonkeyPatch, bad: float) -> None:
    for make, values in ((RewardHistogram, [0.5, bad, 1.0]), (ExpHistogram, [3, bad, 1]), (ExpHistogram, [3, -1.0])):
        errors = []
        for loops in (COMPILED, None):
            monkeypatch.setattr(compiled, "LOOPS", loops)
            h = make()
            with pytest.raises(ValueError) as raised:
                h.add_many(values)
            errors.append((str(raised.value), json.dumps(h.to_dict(), sort_keys=True)))
        assert errors[0] == errors[1]


@pytest.mark.parametrize("seed", range(20))
def test_grader_window(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    def run() -> dict[str, Any]:
        rng = random.Random(seed)
        w = GraderWindow()
        for _ in range(4):
            calls = []
            for _ in range(rng.randrange(0, 40)):
                start = rng.randrange(10**18, 10**18 + 10**10)
                calls.append(GraderWindow.call_of({
                    "start_time_ns": start, "end_time_ns": start + rng.choice([0, -5, rng.randrange(10**9)]),
                    "judge_input_tokens": rng.choice([None, 0, 12, 2**41]), "judge_output_tokens": rng.choice([None, 3]),
                    "outcome": rng.choice([None, "ok", "timeout", "parse_error", "made-up"])}))
            w.add_many(calls)
            w.closed = rng.random() < 0.5
        return w.to_dict()

    compiled, pure = both(monkeypatch, run)
    assert compiled == pure


@pytest.mark.parametrize("seed", range(5))
def test_grader_call_is_call_of(seed: int) -> None:
    """The compiled on_records works a grader span out with grader_call: call_of's tuple exactly."""
    rng = random.Random(seed)
    for _ in range(500):
        start = rng.randrange(0, 2**63)
        span = {"start_time_ns": start, "end_time_ns": rng.choice([start, start - 5, start + rng.randrange(10**12), 2**70]),
                "judge_input_tokens": rng.choice([None, -1, 0, 12, 2**40, 2**40 + 1]),
                "judge_output_tokens": rng.choice([None, 3, 0]),
                "outcome": rng.choice([None, "", "ok", "timeout", "unreadable", "made-up"])}
        want = GraderWindow.call_of(span)
        got = COMPILED.grader_call(span, figures.NS, figures.MAX_JUDGE_TOKENS, figures.CAUSES, figures.UNKNOWN_CAUSE)
        assert repr(got) == repr(want)


def test_one_run_is_true_only_when_every_record_names_the_first_ones_run() -> None:
    rec = {"project": "p", "run_id": "r"}
    assert COMPILED.one_run([rec, dict(rec), dict(rec)]) is True
    assert COMPILED.one_run([rec, dict(rec, run_id="r2")]) is False
    assert COMPILED.one_run([rec, dict(rec, project="q")]) is False
    # the same run key from two runs ("a/b" + "c", "a" + "b/c"): grouped as on_message groups them
    assert COMPILED.one_run([{"project": "a/b", "run_id": "c"}, {"project": "a", "run_id": "b/c"}]) is False
    assert COMPILED.one_run([]) is False


@pytest.mark.parametrize("seed", range(10))
def test_exp_encode_and_quantiles(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    def run() -> list[Any]:
        rng = random.Random(seed)
        out: list[Any] = []
        for _ in range(100):
            h = ExpHistogram(max_size=rng.choice([4, 160, 7]))
            h.add_many([rng.choice([0.0, 1.0, rng.uniform(1e-3, 10), rng.lognormvariate(0, 4)])
                        for _ in range(rng.randrange(0, 80))])
            out.append(h.encode())
            qs = tuple(sorted([rng.random() for _ in range(rng.randrange(1, 5))] + [0.0, 0.5, 0.99, 1.0]))
            try:
                out.append(h.quantiles(qs))
            except ValueError as exc:
                out.append(str(exc))
        for bad, qs in ((ExpHistogram(), (0.5,)), (h, (0.5, 2.0))):
            try:
                bad.quantiles(qs)
            except ValueError as exc:
                out.append(str(exc))
        return out

    compiled, pure = both(monkeypatch, run)
    assert compiled == pure and "empty" in compiled and "within" in compiled
