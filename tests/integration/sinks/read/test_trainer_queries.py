"""The saved queries for what trainers report, through ``rlpulse query`` on a real chDB store: the trainer's
scalars (``step-metrics``, read through the ``step_metrics`` view), failures per step
(``failures-by-step``) and how runs ended (``run-status``).

Rows are inserted directly, replays included (``optimize_on_insert=0``), as in test_queries.py.
"""

from __future__ import annotations

import pytest

from tests.integration.sinks.read.test_queries import S, T0, rows, seed
from tests.integration.sinks.read.test_queries import url as url  # noqa: F401 - the fixture, shared

pytestmark = pytest.mark.integration


def step_row(run_id: str, type_: str, t: int, step: int, count: int, metrics: dict | None = None,
             status: str | None = None, attempt: int = 1) -> dict:
    return {"project": "p", "run_id": run_id, "attempt": attempt, "stage": "", "time_ns": T0 + t * S, "type": type_,
            "trainer": "rl", "step": step, "step_count": count, "tokens": 0, "duration_s": 0.0, "throughput": 0.0,
            "mfu": None, "dropped_events": 0, "writer_id": "w", "sequence_id": t, "metrics": metrics or {},
            "status": status}


def grader_row(rollout: str, step: int, term: str, outcome: str, seq: int) -> dict:
    return {"project": "p", "run_id": "r1", "attempt": 1, "stage": "", "trace_id": "t", "span_id": f"s{seq}",
            "parent_span_id": None, "name": f"grader {term}", "kind": "GRADER", "start_time_ns": T0 + seq * S,
            "end_time_ns": T0 + seq * S, "status": "OK" if outcome == "ok" else "ERROR", "status_message": "",
            "rollout_id": rollout, "attempt_id": "", "sequence_id": seq, "step": step, "term": term, "outcome": outcome,
            "score": 1.0 if outcome == "ok" else None}


def test_step_metrics_are_long_form_one_value_per_step_and_name(url: str) -> None:
    metrics_3 = step_row("r1", "METRICS", 1, 3, 0, {"loss": 0.9, "kl": 0.01})
    seed(url, {"steps": [
        step_row("r1", "RUN_START", 0, -1, 0),
        metrics_3,
        dict(metrics_3),  # a replayed message: one value still
        step_row("r1", "STEP", 2, 3, 1, {"loss": 0.5, "grad_norm": 2.0}),  # the step's later loss wins
        step_row("r1", "HEARTBEAT", 3, -1, 1, {"ignored": 1.0}),  # only STEP and METRICS events carry scalars
        step_row("r1", "STEP", 4, 4, 2, {"clip_ratio/region_mean": 0.125}),
        step_row("r2", "STEP", 4, 4, 1, {"loss": 7.0}),  # another run
    ]})
    got = rows(url, "--saved", "step-metrics", "--param", "run_id=r1")
    assert [(r["attempt"], r["step"], r["name"], r["value"]) for r in got] == [
        (1, 3, "grad_norm", 2.0), (1, 3, "kl", 0.01), (1, 3, "loss", 0.5), (1, 4, "clip_ratio/region_mean", 0.125)]


def test_failures_by_step_per_term_and_cause(url: str) -> None:
    graders = [grader_row("a", 0, "judge", "ok", 1), grader_row("b", 0, "judge", "error", 2),
               grader_row("c", 0, "judge", "error", 3), grader_row("d", 0, "judge", "timeout", 4),
               grader_row("a", 0, "format", "ok", 5), grader_row("e", 1, "judge", "ungradable", 6)]
    seed(url, {"spans": [*graders, dict(graders[1])]})  # the replayed error counts once
    got = rows(url, "--saved", "failures-by-step", "--param", "run_id=r1")
    assert [(r["step"], r["term"], r["cause"], r["failures"], r["graded"], r["failure_rate"]) for r in got] == [
        (0, "judge", "error", 2, 4, 0.5), (0, "judge", "timeout", 1, 4, 0.25), (1, "judge", "ungradable", 1, 1, 1.0)]


def test_run_status_says_how_each_attempt_ended(url: str) -> None:
    seed(url, {"steps": [
        step_row("done", "RUN_START", 0, -1, 0), step_row("done", "STEP", 1, 0, 1),
        step_row("done", "RUN_END", 2, -1, 1, status="finished"),
        step_row("crash", "RUN_START", 0, -1, 0), step_row("crash", "RUN_END", 3, -1, 0, status="failed"),
        step_row("crash", "RUN_START", 4, -1, 0, attempt=2), step_row("crash", "STEP", 5, 0, 1, attempt=2),
        step_row("stopped", "RUN_START", 0, -1, 0), step_row("stopped", "RUN_END", 1, -1, 0, status="cancelled"),
        step_row("old-sdk", "RUN_END", 1, -1, 4),  # a RUN_END from before the status existed
    ]})
    got = rows(url, "--saved", "run-status")
    assert [(r["run_id"], r["attempt"], r["status"], r["steps"]) for r in got] == [
        ("crash", 1, "failed", 0), ("crash", 2, "running", 1), ("done", 1, "finished", 1), ("old-sdk", 1, "unknown", 4),
        ("stopped", 1, "cancelled", 0)]


def test_the_report_gives_each_terms_own_failure_rate(url: str) -> None:
    """judge fails 3 of 10, format never (0 of 10): judge's rate is 0.3, not 3 of 20."""
    from rlpulse.sinks.store.clickhouse import open_store
    from rlpulse.sinks.views.report import failures_by_cause, run_status

    def window(term: str, cause: str, failures: int) -> dict:
        return {"project": "p", "run_id": "r1", "attempt": 1, "term": term, "cause": cause, "window_start_ns": T0,
                "window_end_ns": T0 + 60 * S, "failures": failures, "graded": 10, "emitted_at_ns": T0 + 61 * S}

    seed(url, {"grader_failures": [window("judge", "timeout", 3), window("judge", "error", 0),
                                   window("format", "timeout", 0), window("format", "error", 0)],
               "steps": [step_row("r1", "RUN_END", 1, -1, 5, status="cancelled")]})
    with open_store(url, owner="test") as store:
        columns, rows_ = failures_by_cause(store, "p")
        status = run_status(store, "p")
    assert columns == ["run_id", "attempt", "term", "cause", "failures", "graded", "failure_rate"]
    assert rows_ == [("r1", 1, "format", "error", 0, 10, 0.0), ("r1", 1, "format", "timeout", 0, 10, 0.0),
                     ("r1", 1, "judge", "error", 0, 10, 0.0), ("r1", 1, "judge", "timeout", 3, 10, 0.3)]
    assert status[1] == [("r1", 1, "cancelled", 5)]
