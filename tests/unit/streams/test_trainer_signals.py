"""What trainers report: through the SDK into the records, and through the
run processor into the figures and alerts.

SDK calls go through the real sender into ``InMemoryTransport`` and are decoded with the real
codec; the figures come from ``rlpulse.streams.testing.Harness`` over the real run processor.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import textwrap

import pytest

from rlpulse.producers import InMemoryTransport, TrainingTelemetry
from rlpulse.producers.sdk.events import MAX_METRICS
from rlpulse.base.settings import AlertThresholds, Settings
from rlpulse.streams.runs import RunConfig
from rlpulse.streams.testing import NS, Harness

SETTINGS = Settings.load({"RLPULSE_TOPIC_PREFIX": "mem", "RLPULSE_HEARTBEAT_INTERVAL": "1h"})
NOW = 7_000_000_000
T0 = 1_000_000 * NS  # the harness's start
CONFIG = RunConfig(window_s=10, lateness_s=2, idle_s=5, retention_s=30, stall_after_s=20, silent_after_s=3,
                   thresholds=AlertThresholds(staleness_max=2))


def telemetry(transport: InMemoryTransport, **kwargs) -> TrainingTelemetry:
    return TrainingTelemetry(project="p", run_id="r", settings=SETTINGS, clock=lambda: NOW, transport=transport, **kwargs)


# -- the SDK ---------------------------------------------------------------------------------------
def test_finish_reason_decides_clipped_and_policy_version_travels() -> None:
    transport = InMemoryTransport()
    with telemetry(transport) as tel:
        # ended with EOS exactly at the limit: not truncated, whatever the token count says
        tel.rollout(step=4, rollout_id="a", reward=1.0, completion_tokens=64, max_tokens=64, finish_reason="stop",
                    policy_version=3)
        tel.rollout(step=4, rollout_id="b", reward=0.0, completion_tokens=10, max_tokens=64, finish_reason="length")
        tel.rollout(step=4, rollout_id="c", reward=0.0, completion_tokens=64, max_tokens=64)  # no reason: by length
        tel.rollout(step=4, rollout_id="d", reward=0.0, finish_reason="length", clipped=False)  # given: kept
    got = [(r["rollout_id"], r["clipped"], r["finish_reason"], r["policy_version"]) for r in transport.records("spans")]
    assert got == [("a", False, "stop", 3), ("b", True, "length", None), ("c", True, None, None), ("d", False, "length", None)]


def test_a_grader_that_raised_is_outcome_error_with_no_score_at_its_own_times() -> None:
    transport = InMemoryTransport()
    with telemetry(transport) as tel:
        tel.grader(step=1, rollout_id="a", term="judge", outcome="error", score=0.7, start_ns=1_000, end_ns=5_000)
        tel.grader(step=1, rollout_id="a", term="fmt", outcome="ok", score=0.25, duration_s=2.0)
        with pytest.raises(ValueError, match="start_ns 9 is after end_ns 8"):
            tel.grader(step=1, rollout_id="a", term="judge", outcome="ok", start_ns=9, end_ns=8)
        with pytest.raises(ValueError, match="outcome must be one of ok, timeout, unavailable, unreadable, ungradable, error"):
            tel.grader(step=1, rollout_id="a", term="judge", outcome="raised")
    judge, fmt = transport.records("spans")
    assert (judge["outcome"], judge["score"], judge["status"], judge["start_time_ns"], judge["end_time_ns"],
            judge["time_ns"]) == ("error", None, "ERROR", 1_000, 5_000, 5_000)
    assert (fmt["score"], fmt["start_time_ns"], fmt["end_time_ns"]) == (0.25, NOW - 2 * NS, NOW)


def test_step_metrics_and_log_are_checked_and_published() -> None:
    transport = InMemoryTransport()
    with telemetry(transport) as tel:
        tel.log(3, {"loss": 0.5, "clip_ratio/region_mean": 0.125})
        tel.step_completed(3, tokens=100, duration_s=1.0, metrics={"grad_norm": 2.0, "kl": 1})
        with pytest.raises(ValueError, match=r"metrics\['loss'\] must be a finite number, got nan"):
            tel.step_completed(4, metrics={"loss": math.nan})
        with pytest.raises(ValueError, match=f"metrics has {MAX_METRICS + 1} keys; at most {MAX_METRICS}"):
            tel.log(4, {f"m{i}": 1.0 for i in range(MAX_METRICS + 1)})
        with pytest.raises(ValueError, match="metrics key"):
            tel.log(4, {"x" * 300: 1.0})
        assert tel.step_count == 1  # the refused step_completed counted nothing
    steps = [(r["type"], r["step"], r["metrics"]) for r in transport.records("steps")]
    assert steps == [("RUN_START", -1, {}), ("METRICS", 3, {"loss": 0.5, "clip_ratio/region_mean": 0.125}),
                     ("STEP", 3, {"grad_norm": 2.0, "kl": 1.0}), ("RUN_END", -1, {})]


@pytest.mark.parametrize(("error", "status"), [(None, "finished"), (RuntimeError, "failed"),
                                                (KeyboardInterrupt, "cancelled"), (SystemExit, "cancelled")])
def test_run_end_says_how_the_block_was_left(error, status) -> None:
    transport = InMemoryTransport()
    try:
        with telemetry(transport):
            if error is not None:
                raise error()
    except BaseException as exc:  # noqa: B036 - KeyboardInterrupt and SystemExit are what is tested
        assert type(exc) is error
    assert [(r["type"], r["status"]) for r in transport.records("steps")] == [("RUN_START", None), ("RUN_END", status)]


def test_the_async_face_ends_with_the_status_too() -> None:
    transport = InMemoryTransport()

    async def job() -> None:
        async with telemetry(transport).aio as tel:
            await tel.log(1, {"loss": 1.0})
            raise ValueError("the trainer crashed")

    with pytest.raises(ValueError):
        asyncio.run(job())
    assert [(r["type"], r["status"]) for r in transport.records("steps")] == [
        ("RUN_START", None), ("METRICS", None), ("RUN_END", "failed")]


def test_a_rank_other_than_0_publishes_spans_but_no_steps() -> None:
    transport = InMemoryTransport()
    with telemetry(transport, rank=1, world_size=2) as tel:
        tel.rollout(step=0, rollout_id="r1-a", reward=1.0)
        tel.step_completed(0, metrics={"loss": 1.0})
        tel.log(0, {"loss": 1.0})
        assert tel.step_count == 0
    assert [r["rollout_id"] for r in transport.records("spans")] == ["r1-a"]
    assert transport.records("steps") == []
    with pytest.raises(ValueError, match="rank must be an integer in"):
        telemetry(transport, rank=2, world_size=2)


def test_two_rank_processes_count_each_step_once(tmp_path) -> None:
    """Two processes, as torchrun starts them, each call step_completed for every step."""
    script = textwrap.dedent("""
        import json, sys
        from rlpulse.producers import InMemoryTransport, TrainingTelemetry
        from rlpulse.base.settings import Settings
        rank = int(sys.argv[1])
        transport = InMemoryTransport()
        settings = Settings.load({"RLPULSE_TOPIC_PREFIX": "mem", "RLPULSE_HEARTBEAT_INTERVAL": "1h"})
        with TrainingTelemetry(project="p", run_id="r", settings=settings, transport=transport, rank=rank, world_size=2) as tel:
            for step in range(3):
                tel.rollout(step=step, rollout_id=f"{rank}-{step}", reward=1.0)
                tel.step_completed(step, metrics={"loss": 1.0 / (step + 1)})
        print(json.dumps([[r["type"], r["step"], r["step_count"]] for r in transport.records("steps")]
                         + [len(transport.records("spans"))]))
    """)
    import json

    out = [json.loads(subprocess.run([sys.executable, "-c", script, str(rank)], capture_output=True, text=True,
                                     check=True, timeout=60).stdout) for rank in (0, 1)]
    assert out[0] == [["RUN_START", -1, 0], ["STEP", 0, 1], ["STEP", 1, 2], ["STEP", 2, 3], ["RUN_END", -1, 3], 3]
    assert out[1] == [3]  # rank 1: its rollouts only


def test_a_batch_takes_terms_one_at_a_time() -> None:
    transport = InMemoryTransport()
    with telemetry(transport) as tel:
        with tel.rollouts(step=2, policy_version=1) as batch:
            for rid, share in (("a", 0.5), ("b", 0.25)):
                batch.term(rid, "format", share)
            batch.term("a", "accuracy", 1.0)  # b's accuracy grader failed: left out, as TRL's nansum does
            batch.rollout("a", completion_tokens=12, finish_reason="stop")
            batch.rollout("b", completion_tokens=64, finish_reason="length", reward=0.3)
            with pytest.raises(ValueError, match="term_shares is the batch's to give"):
                batch.rollout("b", term_shares={})
        with pytest.raises(RuntimeError):
            with tel.rollouts(step=3) as lost:
                lost.term("c", "format", 1.0)
                raise RuntimeError("gathering failed")
    got = [(r["rollout_id"], r["step"], r["reward"], r["term_shares"], r["clipped"], r["policy_version"])
           for r in transport.records("spans")]
    assert got == [("a", 2, 1.5, {"format": 0.5, "accuracy": 1.0}, False, 1), ("b", 2, 0.3, {"format": 0.25}, True, 1)]


# -- the streams -----------------------------------------------------------------------------------
def rollout(t_s: float, seq: int, step: int, version: int | None) -> dict:
    t = T0 + int(t_s * NS)
    return dict(project="p", run_id="r", attempt=1, time_ns=t, kind="ROLLOUT", start_time_ns=t, end_time_ns=t, step=step,
                reward=1.0, clipped=False, completion_tokens=10, term_shares={}, sample_id=None, writer_id="w",
                sequence_id=seq, term=None, outcome=None, policy_version=version)


def step_event(t_s: float, seq: int, type_: str, step: int, count: int) -> dict:
    return dict(project="p", run_id="r", attempt=1, time_ns=T0 + int(t_s * NS), type=type_, trainer="rl", step=step,
                step_count=count, writer_id="w", sequence_id=seq, spans_sent=0)


def test_staleness_per_step_and_the_policy_stale_alert() -> None:
    h = Harness(CONFIG)
    h.feed("steps", [step_event(0, 1, "RUN_START", -1, 0)])
    # step 5: versions 5, 4, 2 and one rollout that names none (left out of the staleness)
    h.feed("spans", [rollout(1, 1, 5, 5), rollout(1.1, 2, 5, 4), rollout(1.2, 3, 5, 2), rollout(1.3, 4, 5, None)])
    h.feed("steps", [step_event(2, 2, "STEP", 5, 1)])
    h.feed("spans", [rollout(3, 5, 6, 6), rollout(3.1, 6, 6, 5)])  # step 6 starts: step 5 is complete
    h.feed("steps", [step_event(4, 3, "STEP", 6, 2)])
    h.feed("spans", [rollout(5, 7, 7, None)])  # step 7: no version, so no staleness and no say on the alert
    h.advance(8)
    stats = {s["step"]: (s["staleness_max"], s["staleness_mean"]) for s in h.emissions("step-stats")}
    assert stats == {5: (3, 4 / 3), 6: (1, 0.5), 7: (None, None)}
    stale = [row for row in h.alert_rows() if row[0] == "policy_stale"]
    assert stale == [("policy_stale", "p/r/1", "FIRING"), ("policy_stale", "p/r/1", "RESOLVED")]


def test_a_grader_error_counts_under_its_own_cause_in_the_windows() -> None:
    h = Harness(CONFIG)
    t = T0 + NS
    graders = [dict(project="p", run_id="r", attempt=1, time_ns=t + i, kind="GRADER", start_time_ns=t, end_time_ns=t + i,
                    step=0, term="judge", outcome=o, writer_id="w", sequence_id=i + 1)
               for i, o in enumerate(["ok", "error", "error", "timeout"])]
    h.feed("spans", graders)
    h.advance(20)
    causes = {w["cause"]: (w["failures"], w["graded"]) for w in h.latest("grader-failures").values()}
    assert causes == {"error": (2, 4), "timeout": (1, 4), "unavailable": (0, 4), "unreadable": (0, 4),
                      "ungradable": (0, 4)}
