"""The per-run stall window (seed 001: "Base the window on the usual step time of the run") and the
first-step rule, with injected clocks; the truth (median, factor, floor, ceiling) is worked out by hand
in each test."""

import pytest

from rlpulse.streams.alerting import AlertBook
from rlpulse.streams.stall import HISTORY, StallDetector
from tests.unit.streams.test_stall import S, detector, ev, summary

pytestmark = pytest.mark.full


def run_steps(det, step_s, steps, start=0.0, count0=0, heartbeat_s=None):
    """RUN_START at ``start`` then one STEP every ``step_s`` (event time = processing time), with
    heartbeats every ``heartbeat_s`` in between; returns every alert and the last increase's time."""
    out = det.observe(ev("RUN_START", count0, t=int(start * S)), now_ns=int(start * S))
    t = start
    for k in range(1, steps + 1):
        if heartbeat_s:
            h = t + heartbeat_s
            while h < t + step_s:
                out += det.observe(ev("HEARTBEAT", count0 + k - 1, t=int(h * S)), now_ns=int(h * S))
                out += det.tick(int(h * S))
                h += heartbeat_s
        t += step_s
        out += det.observe(ev("STEP", count0 + k, t=int(t * S), step=k - 1), now_ns=int(t * S))
    return out, t


def test_a_fast_run_stalls_within_a_few_of_its_own_step_times_not_the_global_window():
    det, state, _ = detector(stall_after=900, stall_min_s=1, factor=5)
    alerts, last = run_steps(det, 2.0, 10)
    assert alerts == [] and last == 20.0
    # truth: 10 intervals of 2 s (the first from RUN_START), median 2 s, window 5 x 2 = 10 s, not 900 s
    assert state["p/r1/1"]["intervals"] == [2 * S] * 10 and state["p/r1/1"]["window_ns"] == 10 * S
    for t in range(21, 30):  # heartbeats, count stuck at 10
        assert det.observe(ev("HEARTBEAT", 10, t=t * S), now_ns=t * S) == []
        assert det.tick(t * S) == []
    assert det.tick(30 * S - 1) == []
    [alert] = det.tick(30 * S)  # 20 s (last increase) + 10 s
    assert (alert["rule"], alert["state"], alert["severity"]) == ("stalled_run", "FIRING", "critical")
    assert alert["threshold"] == 10.0 and alert["value"] == 10.0 and alert["first_seen_ns"] == 30 * S
    assert alert["summary"] == ("run r1 attempt 1: step_count 10 has not increased for 10s while the job still reports "
                                "(window 5 x median step time 2s over the last 10 steps = 10s)")
    [resolved] = det.observe(ev("STEP", 11, t=35 * S, step=10), now_ns=35 * S)
    assert (resolved["rule"], resolved["state"]) == ("stalled_run", "RESOLVED")


def test_a_slow_run_does_not_alert_on_a_normal_step_and_alerts_when_one_is_several_times_late():
    # steps every 20 min, the global window 15 min, heartbeats every minute
    det, state, _ = detector(stall_after=900, silent_after=300, stall_min_s=60, factor=5)
    alerts, last = run_steps(det, 1200.0, 6, heartbeat_s=60.0)
    # the first step has no step time to go by: the first-step rule fires at RLPULSE_STALL_AFTER, then
    # resolves with the step; no later (normal, 20-minute) step alerts at all
    assert summary(alerts) == [("first_step_stalled", "FIRING", "p/r1/1"), ("first_step_stalled", "RESOLVED", "p/r1/1")]
    assert alerts[0]["first_seen_ns"] == 900 * S and alerts[1]["time_ns"] == 1200 * S
    assert last == 7200.0 and state["p/r1/1"]["window_ns"] == 6000 * S  # 5 x 1200 s, above the global 900 s
    out = []
    for t in range(7260, 13200, 60):  # step 7 is late: heartbeats, no increase
        out += det.observe(ev("HEARTBEAT", 6, t=t * S), now_ns=t * S) + det.tick(t * S)
    assert out == []  # 99 minutes flat, 5 step times: no alert yet
    assert det.tick(13200 * S - 1) == []
    [alert] = det.tick(13200 * S)
    assert (alert["rule"], alert["threshold"], alert["value"]) == ("stalled_run", 6000.0, 6000.0)
    assert "5 x median step time 20m over the last 6 steps = 100m" in alert["summary"]


def test_the_window_is_clamped_to_the_floor_and_the_ceiling():
    det, _, _ = detector(stall_after=900, stall_min_s=60, factor=5)
    run_steps(det, 2.0, 5)  # 5 x 2 s = 10 s, raised to the 60 s floor
    det.observe(ev("HEARTBEAT", 5, t=30 * S), now_ns=30 * S)
    assert det.tick(70 * S - 1) == []
    [alert] = det.tick(70 * S)
    assert alert["threshold"] == 60.0 and alert["summary"].endswith("= 10s, raised to the floor 60s)")
    # the floor never exceeds stall_after: a 4 s global window with 60 s of floor gives 4 s
    det, _, _ = detector(stall_after=4, silent_after=300, stall_min_s=60, factor=5)
    run_steps(det, 0.5, 3)
    det.observe(ev("HEARTBEAT", 3, t=3 * S), now_ns=3 * S)
    assert det.tick(int(5.5 * S) - 1) == []
    assert [a["threshold"] for a in det.tick(int(5.5 * S))] == [4.0]
    # the ceiling: 5 x 1200 s = 6000 s, capped at 3000 s
    det, _, _ = detector(stall_after=900, silent_after=10_000, stall_max_s=3000, factor=5)
    run_steps(det, 1200.0, 3)
    assert det.tick(6600 * S - 1) == []
    [alert] = det.tick(6600 * S)
    assert alert["threshold"] == 3000.0 and alert["summary"].endswith("= 100m, capped at 50m)")


def test_step_times_are_the_jobs_own_event_times_so_a_backlog_burst_is_not_a_fast_run():
    det, state, _ = detector(stall_after=900, stall_min_s=1, factor=5)
    det.observe(ev("RUN_START", 0, t=0), now_ns=5000 * S)
    for k in range(1, 9):  # read in one burst, 1 ms apart, though the job stepped every 30 s
        det.observe(ev("STEP", k, t=30 * k * S, step=k - 1), now_ns=5000 * S + k * 1_000_000)
    assert state["p/r1/1"]["window_ns"] == 150 * S
    # an increase whose event time is not later says nothing: no interval kept
    det.observe(ev("STEP", 9, t=240 * S, step=8), now_ns=5001 * S)
    assert len(state["p/r1/1"]["intervals"]) == 8


def test_the_history_is_bounded_and_follows_the_runs_recent_pace():
    det, state, _ = detector(stall_after=900, stall_min_s=1, factor=5)
    _, last = run_steps(det, 2.0, 40)
    assert len(state["p/r1/1"]["intervals"]) == HISTORY and state["p/r1/1"]["window_ns"] == 10 * S
    t = last
    for k in range(41, 41 + HISTORY // 2 + 1):  # the run slows to 20 s steps: the median follows within half the history
        t += 20
        assert det.observe(ev("STEP", k, t=int(t * S), step=k - 1), now_ns=int(t * S)) == []
    assert state["p/r1/1"]["window_ns"] == 100 * S


def test_a_first_report_past_step_zero_gives_no_first_interval():
    """Tracking that starts mid-run (count 7 at the first report) cannot tell the step's start: the
    window stays stall_after until two increases were seen."""
    det, state, _ = detector(stall_after=900, stall_min_s=1, factor=5)
    det.observe(ev("HEARTBEAT", 7, t=0), now_ns=0)
    det.observe(ev("STEP", 8, t=1 * S, step=7), now_ns=1 * S)
    assert "intervals" not in state["p/r1/1"] and det.window_ns(state["p/r1/1"]) == 900 * S
    det.observe(ev("STEP", 9, t=3 * S, step=8), now_ns=3 * S)
    assert state["p/r1/1"]["intervals"] == [2 * S] and det.window_ns(state["p/r1/1"]) == 10 * S


def test_first_step_stalled_uses_the_global_window_whatever_the_step_time_settings():
    det, _, _ = detector(stall_after=120, stall_min_s=1, factor=5)
    det.observe(ev("RUN_START", 0, t=0), now_ns=0)
    for t in range(10, 120, 10):
        assert det.observe(ev("HEARTBEAT", 0, t=t * S), now_ns=t * S) == []
    [alert] = det.tick(120 * S)
    assert (alert["rule"], alert["severity"], alert["threshold"]) == ("first_step_stalled", "critical", 120.0)
    assert alert["summary"] == ("run r1 attempt 1: no step completed 120s after its first report while the job still "
                                "reports (window 2m = RLPULSE_STALL_AFTER: no step completed yet)")
    assert summary(det.observe(ev("STEP", 1, t=130 * S, step=0), now_ns=130 * S)) == [
        ("first_step_stalled", "RESOLVED", "p/r1/1")]


def test_state_from_a_worker_before_the_per_run_window_reads_with_no_history():
    state = {"p/r1/1": {"project": "p", "run_id": "r1", "attempt": 1, "step_count": 3, "increased_ns": 0, "seen_ns": 0}}
    det = StallDetector(state, AlertBook({}), 900, 300, stall_min_s=1, factor=5)
    det.observe(ev("STEP", 4, t=10 * S), now_ns=10 * S)  # no base time: sets it, no interval
    det.observe(ev("STEP", 5, t=12 * S), now_ns=12 * S)
    assert state["p/r1/1"]["intervals"] == [2 * S] and state["p/r1/1"]["window_ns"] == 10 * S


def test_the_stall_settings_load_from_the_environment_and_refuse_nonsense():
    from rlpulse.base.settings import Settings
    from rlpulse.streams.runs import RunConfig

    s = Settings.load({"RLPULSE_STALL_MIN": "500ms", "RLPULSE_STALL_MAX": "2h", "RLPULSE_STALL_FACTOR": "3",
                       "RLPULSE_STALL_AFTER": "10m"})
    assert (s.stall_after, s.stall_min, s.stall_max, s.stall_factor) == (600.0, 0.5, 7200.0, 3.0)
    c = RunConfig.from_settings(s)
    assert (c.stall_after_s, c.stall_min_s, c.stall_max_s, c.stall_factor) == (600.0, 0.5, 7200.0, 3.0)
    assert Settings.load({}, stall_min="2m").stall_min == 120.0  # a flag, then the variable, then the default
    assert Settings.load({}).env()["RLPULSE_STALL_MAX"] == "86400.0s"
    for env, says in (({"RLPULSE_STALL_MIN": "2h", "RLPULSE_STALL_MAX": "1h"}, "RLPULSE_STALL_MIN (7200s) is above"),
                      ({"RLPULSE_STALL_FACTOR": "0.5"}, "RLPULSE_STALL_FACTOR must be a number of at least 1"),
                      ({"RLPULSE_STALL_MIN": "0s"}, "RLPULSE_STALL_MIN must be a positive duration"),
                      ({"RLPULSE_STALL_MAX": "soon"}, "RLPULSE_STALL_MAX: invalid duration 'soon'")):
        with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
            Settings.load(env)
