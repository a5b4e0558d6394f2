from streams.windows import NS, GraderFailures, closes_at, window_start

W = 60 * NS


def grader(t_ns, outcome="ok", term="judge", run_id="r1", attempt=1):
    return dict(kind="GRADER", project="p", run_id=run_id, attempt=attempt, term=term, outcome=outcome, time_ns=t_ns)


def test_window_arithmetic_edges():
    assert window_start(0, W) == 0
    assert window_start(W - 1, W) == 0
    assert window_start(W, W) == W  # a window is [start, start + size)
    assert window_start(7 * W + 5, W) == 7 * W
    assert closes_at(W, W, 10 * NS) == 2 * W + 10 * NS


def test_counts_per_cause_and_graded_total():
    agg = GraderFailures({}, window_s=60, lateness_s=10)
    outcomes = ["ok", "timeout", "timeout", "unavailable", "unreadable", "ungradable", "ok"]
    for offset, outcome in enumerate(outcomes):
        assert agg.add(grader(W + offset * NS, outcome), partition=0, offset=offset, now_ns=W + 30 * NS) == "added"
    [(key, value)] = agg.closed(now_ns=2 * W + 10 * NS)
    records = {r["cause"]: r for r in agg.records(value, emitted_at_ns=1)}
    assert {c: r["failures"] for c, r in records.items()} == {"timeout": 2, "unavailable": 1, "unreadable": 1, "ungradable": 1}
    assert all(r["graded"] == 7 and r["window_start_ns"] == W and r["window_end_ns"] == 2 * W for r in records.values())


def test_window_closes_by_wall_clock_only_after_lateness():
    agg = GraderFailures({}, window_s=60, lateness_s=10)
    agg.add(grader(W), partition=0, offset=0, now_ns=W)
    assert agg.closed(now_ns=2 * W + 10 * NS - 1) == []
    assert len(agg.closed(now_ns=2 * W + 10 * NS)) == 1


def test_replayed_offset_is_not_counted_twice_and_late_event_is_counted_as_dropped():
    state = {}
    agg = GraderFailures(state, window_s=60, lateness_s=10)
    assert agg.add(grader(W, "timeout"), partition=1, offset=5, now_ns=W) == "added"
    assert agg.add(grader(W, "timeout"), partition=1, offset=5, now_ns=W) == "duplicate"
    assert agg.add(grader(W, "timeout"), partition=1, offset=4, now_ns=W) == "duplicate"
    # inside the allowed lateness: still counted
    assert agg.add(grader(W + NS, "timeout"), partition=1, offset=6, now_ns=2 * W + 9 * NS) == "added"
    # after window end + lateness: dropped and counted
    assert agg.add(grader(W + 2 * NS, "timeout"), partition=1, offset=7, now_ns=2 * W + 10 * NS) == "late"
    assert agg.dropped_late == 1
    [(_, value)] = agg.closed(now_ns=3 * W)
    assert value["causes"]["timeout"] == 2 and value["graded"] == 2


def test_partitions_terms_and_runs_are_separate_windows():
    agg = GraderFailures({}, window_s=60, lateness_s=0)
    agg.add(grader(W, term="judge"), partition=0, offset=0, now_ns=W)
    agg.add(grader(W, term="format"), partition=0, offset=1, now_ns=W)
    agg.add(grader(W, run_id="r2"), partition=1, offset=0, now_ns=W)
    agg.add(grader(W + W, run_id="r2"), partition=1, offset=1, now_ns=W)
    assert len(agg.closed(now_ns=10 * W)) == 4


def test_non_grader_spans_are_ignored():
    agg = GraderFailures({}, window_s=60, lateness_s=0)
    assert agg.add(dict(grader(W), kind="ROLLOUT"), partition=0, offset=0, now_ns=W) == "ignored"
    assert agg.closed(now_ns=10 * W) == []


def test_terms_per_run_and_window_are_capped_and_unknown_outcomes_counted():
    from streams.windows import MAX_TERMS, OTHER_TERM

    agg = GraderFailures({}, window_s=60, lateness_s=0)
    for i in range(MAX_TERMS + 10):
        agg.add(grader(W, "timeout", term=f"t{i}"), partition=0, offset=i, now_ns=W)
    agg.add(grader(W, "exploded", term="t0"), partition=0, offset=999, now_ns=W)
    windows = dict((v["term"], v) for _, v in agg.closed(now_ns=3 * W))
    assert len(windows) == MAX_TERMS + 1 and agg.folded_terms == 10
    assert windows[OTHER_TERM]["causes"]["timeout"] == 10 and windows[OTHER_TERM]["graded"] == 10
    assert windows["t0"]["causes"] == {"timeout": 1, "unavailable": 0, "unreadable": 0, "ungradable": 0, "unknown": 1}
