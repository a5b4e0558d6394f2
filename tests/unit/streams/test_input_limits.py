"""Input limits (docs/sdk-and-tracing.md, "Input limits"): the SDK refuses at the call with a ValueError naming the
field and the limit; the streams refuse what other writers send past them, count it, log a few
lines, and keep every other record's figures exact."""

from __future__ import annotations

import logging

import pytest

from rlpulse.producers import TrainingTelemetry
from rlpulse.base.settings import Settings
from rlpulse.streams.runs import RunConfig
from rlpulse.streams.stage import load_state
from rlpulse.streams.testing import NS, Harness
from tests.unit.streams.test_runs import T0, Job

CONFIG = RunConfig(window_s=10, lateness_s=2, idle_s=5, retention_s=30, stall_after_s=900, silent_after_s=300)


@pytest.fixture
def tel():
    # Never started: validation happens before anything is queued.
    return TrainingTelemetry(project="p", run_id="r", settings=Settings.load({}))


# -- the SDK, at the call ----------------------------------------------------------------------
@pytest.mark.parametrize("call, kwargs, message", [
    ("rollout", dict(step=1, rollout_id="x" * 257, reward=0.5), "rollout_id is 257 characters; at most 256 are allowed"),
    ("rollout", dict(step=1, rollout_id="é" * 257, reward=0.5), "rollout_id is 257 characters; at most 256 are allowed"),
    ("rollout", dict(step=1, rollout_id="x", reward=0.5, sample_id="s" * 300),
     "sample_id is 300 characters; at most 256 are allowed"),
    ("rollout", dict(step=1, rollout_id="x", reward=0.5, term_shares={"t" * 257: 0.5}),
     "term_shares key is 257 characters; at most 256 are allowed"),
    ("rollout", dict(step=1, rollout_id="x", reward=0.5, attributes={"k" * 257: 1}),
     "attributes key is 257 characters; at most 256 are allowed"),
    ("rollout", dict(step=1, rollout_id="x", reward=0.5, attributes={"note": "n" * 65_537}),
     r"attributes\['note'\] is 65537 characters; at most 65536 are allowed"),
    ("rollout", dict(step=1, rollout_id="x", reward=0.5, attributes={f"k{i}": i for i in range(129)}),
     "attributes has 129 keys; at most 128 are allowed"),
    ("rollout", dict(step=1, rollout_id="x", reward=0.5, term_shares={f"t{i}": 0.1 for i in range(65)}),
     "term_shares has 65 keys; at most 64 are allowed"),
    ("grader", dict(step=1, rollout_id="x" * 1000, term="judge", outcome="ok", duration_s=1.0),
     "rollout_id is 1000 characters; at most 256 are allowed"),
    ("grader", dict(step=1, rollout_id="x", term="j" * 257, outcome="ok", duration_s=1.0),
     "term is 257 characters; at most 256 are allowed"),
])
def test_sdk_refuses_over_the_limits_at_the_call(tel, call, kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        getattr(tel, call)(**kwargs)
    assert tel.pending == 0  # nothing queued


def test_sdk_takes_what_is_exactly_at_the_limits(tel):
    tel.rollout(step=1, rollout_id="x" * 256, reward=0.5, sample_id="s" * 256, term_shares={"t" * 256: 0.5},
                attributes={**{f"k{i}": i for i in range(127)}, "k" * 256: "v" * 65_536})
    tel.grader(step=1, rollout_id="x" * 256, term="t" * 256, outcome="ok", duration_s=1.0)
    assert tel.pending == 2


@pytest.mark.parametrize("field, kwargs", [
    ("project", dict(project="p" * 257, run_id="r")),
    ("run_id", dict(project="p", run_id="r" * 257)),
    ("stage", dict(project="p", run_id="r", stage="s" * 257)),
])
def test_sdk_refuses_long_identity_when_made(field, kwargs):
    with pytest.raises(ValueError, match=f"^{field} is 257 characters; at most 256 are allowed$"):
        TrainingTelemetry(settings=Settings.load({}), **kwargs)


def test_publish_span_has_the_same_limits(tel):
    span = {
        "time_ns": 1,
        "trace_id": b"t" * 16,
        "span_id": b"s" * 8,
        "name": "llm",
        "kind": "LLM",
        "start_time_ns": 0,
        "end_time_ns": 1,
    }
    with pytest.raises(ValueError, match="^name is 300 characters; at most 256 are allowed$"):
        tel.publish_span({**span, "name": "n" * 300})
    with pytest.raises(ValueError, match="^status_message is 70000 characters; at most 65536 are allowed$"):
        tel.publish_span({**span, "status_message": "m" * 70_000})
    with pytest.raises(ValueError, match="^attributes has 129 keys; at most 128 are allowed$"):
        tel.publish_span({**span, "attributes": {f"a{i}": i for i in range(129)}})
    assert tel.pending == 0
    assert tel.publish_span({**span, "attributes": {f"a{i}": i for i in range(128)}})
    assert tel.pending == 1


# -- the streams, for other writers ------------------------------------------------------------
def _window_terms(h: Harness) -> set[str]:
    return {key[3] for key in h.latest("grader-windows")}


def test_streams_refuse_a_runs_terms_past_64_and_count_them(caplog):
    h = Harness(CONFIG)
    job = Job()
    with caplog.at_level(logging.WARNING, logger="rlpulse.streams.runs"):
        h.feed("spans", [job.grader(1.0, term=f"t{i}") for i in range(64)])
        h.feed("spans", [job.grader(1.5, term=f"x{i}", outcome="timeout") for i in range(100)])
        h.feed("spans", [job.grader(2.0, term="t0", outcome="timeout")])  # a known term goes on being counted
        h.advance(10)
    assert _window_terms(h) == {f"t{i}" for i in range(64)}
    t0 = [r for k, r in h.latest("grader-windows").items() if k[3] == "t0"][0]
    assert (t0["graded"], t0["failures"]) == (2, 1)
    assert h.stage.processor.terms_refused == 100
    state = load_state(h.table["p/r1"])
    assert state["terms_refused"] == 100 and len(state["terms"]) == 64
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 3  # the 1st, 10th and 100th
    assert lines[0] == (
        "grader span of p/r1 refused: term 'x0' would be distinct term number 65 (at most 64); its "
        "figures stay bounded (1 grader spans refused for this run, 1 on this worker); the raw span is "
        "still stored"
    )


def test_streams_refuse_long_terms_and_ids_of_other_writers(caplog):
    h = Harness(CONFIG)
    job, long_run = Job(), Job(run_id="r" * 300)
    with caplog.at_level(logging.WARNING):
        h.feed("spans", [job.grader(1.0, term="judge"), job.grader(1.0, term="j" * 257)])
        h.feed("spans", [long_run.grader(1.0) for _ in range(3)])
        h.feed("spans", [{**job.rollout(1.0, 0, 0.5, sample="s" * 257), "term_shares": {"j" * 257: 0.5, "judge": 0.5}}])
        h.advance(10)
    assert _window_terms(h) == {"judge"}
    assert h.stage.processor.terms_refused == 1 and h.stage.processor.names_refused == 3
    assert list(h.table) == ["p/r1"]  # no state for the run with the 300-character id
    [stats] = h.latest("step-stats").values()
    assert stats["rollouts"] == 1  # the rollout counts; its long term and sample id are not kept
    assert {k[4] for k in h.latest("reward-histograms")} == {"total", "judge"}
    messages = [r.getMessage() for r in caplog.records]
    assert (
        "3 spans records refused: project of 1 and run_id of 300 characters, at most 256 each "
        "(3 refused on this worker)" in messages
    )
    assert any("a term of 257 characters (at most 256)" in m for m in messages)


def test_streams_refuse_new_runs_past_max_runs_until_one_expires(caplog):
    import dataclasses

    h = Harness(dataclasses.replace(CONFIG, max_runs=3))
    jobs = [Job(run_id=f"r{i}") for i in range(5)]
    with caplog.at_level(logging.ERROR, logger="rlpulse.streams.stage"):
        for job in jobs:
            h.feed("spans", [job.grader(1.0)])
            h.feed("steps", [job.step(1.0, "RUN_START")])
    assert sorted(h.table) == ["p/r0", "p/r1", "p/r2"]
    assert h.stage.processor.runs_refused == 4  # r3 and r4: a span and a step each
    assert caplog.records[0].getMessage() == (
        "1 spans records of the new run p/r3 refused: this worker holds 3 runs, at most 3; the run's figures "
        "start once ended runs expire (1 records refused on this worker)"
    )
    # the held runs end and expire: a new run is taken again
    for job in jobs[:3]:
        h.feed("steps", [job.step(2.0, "RUN_END")])
    h.advance(60)
    assert h.table == {}
    h.feed("spans", [jobs[4].grader(70.0)])
    assert list(h.table) == ["p/r4"]
    assert T0 and NS  # the epoch the jobs' times count from
