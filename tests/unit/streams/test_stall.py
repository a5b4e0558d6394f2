from rlpulse.streams.alerting import AlertBook
from rlpulse.streams.stall import StallDetector

S = 1_000_000_000  # one second in ns; every time below is an injected clock value


def ev(kind, count, run_id="r1", attempt=1, t=0, step=-1):
    return dict(project="p", run_id=run_id, attempt=attempt, stage="", time_ns=t, type=kind, trainer="rl",
                step=step, step_count=count)


def detector(stall_after=900, silent_after=300, **kwargs):
    state, book_state = {}, {}
    return StallDetector(state, AlertBook(book_state), stall_after, silent_after, **kwargs), state, book_state


def summary(alerts):
    return [(a["rule"], a["state"], a["key"]) for a in alerts]


def test_stall_fires_once_at_stall_after_despite_many_heartbeats():
    det, _, _ = detector()
    assert det.observe(ev("RUN_START", 0), now_ns=0) == []
    assert det.observe(ev("STEP", 1, step=0), now_ns=10 * S) == []
    for t in range(25, 910, 15):  # heartbeats every 15 s, count stuck at 1
        assert det.observe(ev("HEARTBEAT", 1), now_ns=t * S) == []
        assert det.tick(t * S) == []
    assert det.tick(910 * S - 1) == []
    [alert] = det.tick(910 * S)  # 900 s after the count last rose, at 10 s
    assert alert == {
        "rule": "stalled_run", "state": "FIRING", "key": "p/r1/1", "severity": "critical",
        "summary": alert["summary"], "value": 900.0, "threshold": 900.0, "project": "p", "run_id": "r1",
        "attempt": 1, "time_ns": 910 * S, "first_seen_ns": 910 * S, "last_seen_ns": 910 * S,
    }
    assert "step_count 1" in alert["summary"]
    for t in range(915, 3000, 15):
        assert det.observe(ev("HEARTBEAT", 1), now_ns=t * S) == []
        assert det.tick(t * S + S // 2) == []


def test_heartbeat_after_stall_after_fires_without_waiting_for_the_timer():
    det, _, _ = detector()
    det.observe(ev("RUN_START", 0), now_ns=0)
    for t in range(15, 900, 15):
        assert det.observe(ev("HEARTBEAT", 0), now_ns=t * S) == []
    # no step completed yet: the first-step rule, under its own name
    assert summary(det.observe(ev("HEARTBEAT", 0), now_ns=900 * S)) == [("first_step_stalled", "FIRING", "p/r1/1")]


def test_stall_resolves_once_when_the_count_increases():
    det, _, book_state = detector()
    det.observe(ev("RUN_START", 0), now_ns=0)
    det.observe(ev("HEARTBEAT", 0), now_ns=890 * S)
    [fired] = det.tick(900 * S)
    det.observe(ev("HEARTBEAT", 0), now_ns=905 * S)
    [resolved] = det.observe(ev("STEP", 1, step=0), now_ns=950 * S)
    assert (resolved["rule"], resolved["state"], resolved["key"]) == ("first_step_stalled", "RESOLVED", "p/r1/1")
    assert resolved["first_seen_ns"] == fired["first_seen_ns"] == 900 * S
    assert resolved["last_seen_ns"] == resolved["time_ns"] == 950 * S
    assert resolved["value"] == 950.0 and "rose to 1" in resolved["summary"]
    assert book_state == {}
    assert det.observe(ev("STEP", 2, step=1), now_ns=960 * S) == []
    assert det.tick(961 * S) == []
    # the next stall is measured from the last increase (960 s), as a new episode
    det.observe(ev("HEARTBEAT", 2), now_ns=1850 * S)
    [again] = det.tick(1860 * S)
    assert (again["rule"], again["state"], again["first_seen_ns"]) == ("stalled_run", "FIRING", 1860 * S)


def test_silent_fires_once_and_resolves_when_reports_resume():
    det, _, _ = detector()
    det.observe(ev("RUN_START", 0), now_ns=0)
    det.observe(ev("STEP", 1, step=0), now_ns=100 * S)
    assert det.tick(400 * S - 1) == []
    [silent] = det.tick(400 * S)
    assert (silent["rule"], silent["state"], silent["severity"]) == ("silent_run", "FIRING", "warning")
    assert silent["value"] == 300.0 and silent["threshold"] == 300.0
    assert det.tick(401 * S) == [] and det.tick(800 * S) == []
    [back] = det.observe(ev("HEARTBEAT", 1), now_ns=850 * S)
    assert (back["rule"], back["state"], back["first_seen_ns"]) == ("silent_run", "RESOLVED", 400 * S)
    assert det.tick(851 * S) == []


def test_going_silent_keeps_an_open_stall_and_silence_fires_no_new_stall():
    det, _, book_state = detector(stall_after=60, silent_after=300)
    det.observe(ev("RUN_START", 0), now_ns=0)
    assert summary(det.observe(ev("HEARTBEAT", 0), now_ns=60 * S)) == [("first_step_stalled", "FIRING", "p/r1/1")]
    assert summary(det.tick(360 * S)) == [("silent_run", "FIRING", "p/r1/1")]  # stalled not resolved
    assert len(book_state) == 2
    # a second run that goes silent before its stall is due never fires a stall
    det2, _, _ = detector(stall_after=600, silent_after=300)
    det2.observe(ev("RUN_START", 0), now_ns=0)
    assert summary(det2.tick(300 * S)) == [("silent_run", "FIRING", "p/r1/1")]
    assert det2.tick(700 * S) == []


def test_run_end_resolves_open_alerts_and_stops_tracking():
    det, state, book_state = detector(stall_after=60, silent_after=300)
    det.observe(ev("RUN_START", 0), now_ns=0)
    det.observe(ev("HEARTBEAT", 0), now_ns=60 * S)
    det.tick(400 * S)  # stalled and silent both firing
    ended = det.observe(ev("RUN_END", 0), now_ns=410 * S)
    assert summary(ended) == [("first_step_stalled", "RESOLVED", "p/r1/1"), ("silent_run", "RESOLVED", "p/r1/1")]
    assert [a["summary"] for a in ended] == ["run r1 attempt 1: run ended"] * 2
    assert state == {} and book_state == {}
    assert det.tick(5000 * S) == []
    assert det.observe(ev("RUN_END", 0), now_ns=5001 * S) == []  # a repeated end is harmless


def test_new_attempt_is_a_new_series_from_zero_and_inherits_no_alert():
    det, state, _ = detector()
    det.observe(ev("RUN_START", 0), now_ns=0)
    det.observe(ev("STEP", 50, step=49), now_ns=10 * S)
    det.observe(ev("HEARTBEAT", 50), now_ns=900 * S)
    assert summary(det.tick(910 * S)) == [("stalled_run", "FIRING", "p/r1/1")]
    # the run is resumed as attempt 2: the old attempt is over, the new one starts clean
    superseded = det.observe(ev("RUN_START", 0, attempt=2), now_ns=920 * S)
    assert summary(superseded) == [("stalled_run", "RESOLVED", "p/r1/1")]
    assert "superseded by attempt 2" in superseded[0]["summary"]
    assert list(state) == ["p/r1/2"] and state["p/r1/2"]["step_count"] == 0
    assert det.observe(ev("STEP", 1, attempt=2, step=50), now_ns=930 * S) == []
    assert det.tick(931 * S) == []
    # another run's attempt is untouched by it
    det.observe(ev("RUN_START", 0, run_id="r2", attempt=1), now_ns=940 * S)
    assert sorted(state) == ["p/r1/2", "p/r2/1"]


def test_step_repeated_after_a_restore_counts_again_and_is_not_a_stall():
    det, _, _ = detector()
    det.observe(ev("STEP", 10, step=9), now_ns=0)
    # restored from a checkpoint: step 9 is repeated and the step number stays <= 10 for
    # 1800 s, longer than stall_after, but step_count keeps rising, so there is no stall
    count = 10
    for t in range(15, 3000, 15):
        if t % 600 == 0:
            count += 1
            assert det.observe(ev("STEP", count, step=[9, 10, 11, 12][t // 600 - 1]), now_ns=t * S) == []
        else:
            assert det.observe(ev("HEARTBEAT", count), now_ns=t * S) == []
        assert det.tick(t * S) == []


def test_a_late_lower_count_does_not_reset_the_series():
    det, state, _ = detector()
    det.observe(ev("STEP", 5, step=4), now_ns=0)
    det.observe(ev("HEARTBEAT", 3), now_ns=10 * S)  # out of order: an older report
    assert state["p/r1/1"]["step_count"] == 5 and state["p/r1/1"]["increased_ns"] == 0
    assert det.observe(ev("HEARTBEAT", 4), now_ns=20 * S) == []  # still not an increase


def test_tracked_runs_are_capped_by_evicting_the_longest_silent():
    det, state, book_state = detector(max_runs=2)
    det.observe(ev("RUN_START", 0, run_id="a"), now_ns=0)
    det.observe(ev("RUN_START", 0, run_id="b"), now_ns=10 * S)
    assert summary(det.tick(300 * S)) == [("silent_run", "FIRING", "p/a/1")]
    det.observe(ev("HEARTBEAT", 0, run_id="b"), now_ns=305 * S)
    out = det.observe(ev("RUN_START", 0, run_id="c"), now_ns=320 * S)
    assert summary(out) == [("silent_run", "RESOLVED", "p/a/1")] and "no longer tracked" in out[0]["summary"]
    assert sorted(state) == ["p/b/1", "p/c/1"] and det.evicted == 1 and det.tracked == 2
    assert list(book_state) == []


def test_restart_grace_measures_ages_from_the_processor_restart():
    state = {"p/r1/1": {"project": "p", "run_id": "r1", "attempt": 1, "step_count": 3, "increased_ns": 0, "seen_ns": 0}}
    det = StallDetector(state, AlertBook({}), 900, 300, resumed_ns=5000 * S)
    assert det.tick(5000 * S) == []
    assert det.tick(5300 * S - 1) == []
    assert summary(det.tick(5300 * S)) == [("silent_run", "FIRING", "p/r1/1")]


def test_state_values_are_replaced_not_mutated():
    det, state, _ = detector()
    det.observe(ev("RUN_START", 0), now_ns=0)
    before = state["p/r1/1"]
    snapshot = dict(before)
    det.observe(ev("STEP", 1, step=0), now_ns=5 * S)
    assert before == snapshot and state["p/r1/1"] is not before


def test_an_episode_fired_again_from_the_same_state_keeps_its_first_seen():
    """A crash lost the write that recorded the FIRING (it was published): a detector restarted
    from the state before it fires again, later, and the sink must see the same episode."""
    import copy

    det, state, book_state = detector(stall_after=900, silent_after=300)
    det.observe(ev("RUN_START", 0), now_ns=0)
    det.observe(ev("STEP", 1, step=0), now_ns=100 * S)
    saved = copy.deepcopy(state), copy.deepcopy(book_state)
    [silent] = det.tick(400 * S)
    again_state, again_book = saved
    restarted = StallDetector(again_state, AlertBook(again_book), 900, 300, resumed_ns=700 * S)
    assert restarted.tick(999 * S) == []  # silence counts from the restart
    [again] = restarted.tick(1000 * S)
    assert (again["rule"], again["state"]) == ("silent_run", "FIRING")
    assert again["first_seen_ns"] == silent["first_seen_ns"] == 400 * S  # the last report plus silent_after
    det2, state2, book2 = detector(stall_after=900, silent_after=300)
    det2.observe(ev("RUN_START", 0), now_ns=0)
    for t in range(15, 900, 15):
        det2.observe(ev("HEARTBEAT", 0), now_ns=t * S)
    [stalled] = det2.tick(900 * S)
    restarted = StallDetector(copy.deepcopy(state2), AlertBook({}), 900, 300, resumed_ns=950 * S)
    for t in range(960, 1850, 15):
        assert restarted.observe(ev("HEARTBEAT", 0), now_ns=t * S) == []
    [again] = restarted.tick(1850 * S)  # stall_after from the restart
    assert (again["rule"], again["state"]) == ("first_step_stalled", "FIRING")
    assert again["first_seen_ns"] == stalled["first_seen_ns"] == 900 * S  # the last increase plus stall_after

