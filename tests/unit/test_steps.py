"""Per-step figures: stage 1 partials (per source partition, replay-safe) and stage 2 merging."""

import json

from streams.merge import GraderWindowMerger, StepMerger
from streams.steps import StepPartials, histogram_records, length_record, merge, step_stats

S = 1_000_000_000


def rollout(step, reward, clipped=False, tokens=100, sample=None, shares=None, run_id="r"):
    return dict(kind="ROLLOUT", project="p", run_id=run_id, attempt=1, step=step, reward=reward, clipped=clipped,
                completion_tokens=tokens, sample_id=sample, term_shares=shares or {})


def test_partials_skip_replayed_offsets_and_merge_exactly():
    state = {}
    stage1 = StepPartials(state, retention_s=60)
    assert stage1.add(rollout(0, 1.0, sample="a", shares={"judge": 0.7}), partition=0, offset=0, now_ns=0) == "added"
    assert stage1.add(rollout(0, 0.0, clipped=True, tokens=1024, sample="a"), partition=0, offset=1, now_ns=0) == "added"
    assert stage1.add(rollout(0, 0.0, clipped=True, tokens=1024, sample="a"), partition=0, offset=1, now_ns=0) == "duplicate"
    assert stage1.add(rollout(0, 0.5, sample="b"), partition=1, offset=7, now_ns=0) == "added"
    assert stage1.add(rollout(0, 0.5, sample="b"), partition=1, offset=8, now_ns=0) == "added"
    assert stage1.add(dict(rollout(0, 1.0), kind="GRADER"), partition=1, offset=9, now_ns=0) == "ignored"
    merged = merge(json.loads(StepPartials.record(v, 1)["state"]) for v in state.values())
    stats = step_stats(merged, complete=True, emitted_at_ns=5)
    assert (stats["rollouts"], stats["clipped"], stats["clipped_ratio"]) == (4, 1, 0.25)
    assert stats["reward_mean"] == 0.5 and stats["reward_zero_fraction"] == 0.25
    assert (stats["samples"], stats["samples_same_reward"]) == (2, 1)  # b: 0.5 and 0.5
    assert stats["sample_reward_spread_mean"] == 0.25  # a: std of (1, 0) is 0.5; b: 0
    assert (stats["completion_min"], stats["completion_max"], stats["completion_mean"]) == (100, 1024, 331.0)
    hists = {h["term"]: h for h in histogram_records(merged, 5)}
    assert hists["total"]["bucket_counts"] == [1, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 1, 0, 0, 0]
    assert hists["judge"]["count"] == 1 and hists["judge"]["bucket_counts"][7] == 1  # 0.7 in (0.6, 0.7]
    lengths = length_record(merged, 5)
    assert lengths["count"] == 4 and sum(lengths["bucket_counts"]) == 4 and lengths["max"] == 1024.0


def test_forgotten_step_takes_no_late_rollouts():
    state = {}
    stage1 = StepPartials(state, retention_s=10)
    stage1.add(rollout(3, 1.0), partition=0, offset=0, now_ns=0)
    assert stage1.expired(now_ns=11 * S, partition=1) == []
    [key] = stage1.expired(now_ns=11 * S, partition=0)
    stage1.forget(key)
    assert stage1.add(rollout(3, 1.0), partition=0, offset=1, now_ns=12 * S) == "late"
    assert stage1.add(rollout(4, 1.0), partition=0, offset=2, now_ns=12 * S) == "added"
    assert stage1.dropped_late == 1


def partial(step, src, rewards, run_id="r"):
    state = {}
    stage1 = StepPartials(state, retention_s=60)
    for offset, reward in enumerate(rewards):
        stage1.add(rollout(step, reward, run_id=run_id), partition=src, offset=offset, now_ns=0)
    [value] = state.values()
    return StepPartials.record(value, 0)


def step_event(type_, step=-1, run_id="r"):
    return dict(type=type_, project="p", run_id=run_id, attempt=1, step=step)


def test_step_completes_on_its_step_event_after_settling_and_partials_replace():
    merger = StepMerger({}, settle_s=1, lateness_s=30, retention_s=60)
    merger.on_partial(partial(0, 0, [1.0, 0.0]), now_ns=0)
    merger.on_partial(partial(0, 0, [1.0, 0.0]), now_ns=0)  # sent again after a restart: replaces
    merger.on_partial(partial(0, 1, [0.5]), now_ns=0)
    assert merger.tick(now_ns=5 * S) == []  # no STEP event, not yet late
    merger.on_step_event(step_event("STEP", 0), now_ns=5 * S)
    [(merged, first)] = merger.tick(now_ns=5 * S)  # quiet for 5 s already
    assert first and merged["rollouts"] == 3
    assert merger.tick(now_ns=6 * S) == []
    merger.on_partial(partial(0, 1, [0.5, 0.25]), now_ns=7 * S)  # a late rollout: emitted again, not first
    assert merger.tick(now_ns=7 * S) == []
    [(merged, first)] = merger.tick(now_ns=8 * S)
    assert not first and merged["rollouts"] == 4


def test_partials_after_run_end_still_complete_their_steps():
    merger = StepMerger({}, settle_s=1, lateness_s=30, retention_s=60)
    merger.on_step_event(step_event("STEP", 0), now_ns=0)
    merger.on_step_event(step_event("RUN_END"), now_ns=0)
    assert merger.tick(now_ns=2 * S) == []
    merger.on_partial(partial(0, 0, [1.0]), now_ns=3 * S)
    merger.on_partial(partial(1, 0, [1.0]), now_ns=3 * S)
    done = merger.tick(now_ns=5 * S)
    assert [(m["step"], first) for m, first in done] == [(0, True), (1, True)]
    assert merger.forgotten == []
    merger.tick(now_ns=100 * S)  # steps emitted and quiet past retention, run ended long ago: all forgotten
    assert merger.state == {} and merger.forgotten == [("p", "r", 1)]


def test_step_completes_when_the_next_step_begins_or_by_wall_clock():
    merger = StepMerger({}, settle_s=1, lateness_s=30, retention_s=60)
    merger.on_partial(partial(0, 0, [1.0]), now_ns=0)
    merger.on_partial(partial(1, 0, [1.0]), now_ns=0)
    assert [m["step"] for m, _ in merger.tick(now_ns=2 * S)] == [0]
    assert [m["step"] for m, _ in merger.tick(now_ns=30 * S)] == [1]


def test_steps_are_emitted_in_numeric_order():
    merger = StepMerger({}, settle_s=0, lateness_s=0, retention_s=60)
    for step in (10, 2, 1):
        merger.on_partial(partial(step, 0, [1.0]), now_ns=0)
    assert [m["step"] for m, _ in merger.tick(now_ns=S)] == [1, 2, 10]


def test_grader_windows_sum_partitions_once_settled():
    from streams.histograms import ExpHistogram

    def durations(*seconds):
        h = ExpHistogram()
        for x in seconds:
            h.add(x)
        return json.dumps(h.to_dict())

    merger = GraderWindowMerger({}, settle_s=1, retention_s=60)
    row = dict(project="p", run_id="r", attempt=1, term="judge", window_start_ns=0, window_end_ns=60 * S,
               duration_histogram=durations(*[2.0] * 5))
    merger.on_row(dict(row, source_partition=0, cause="timeout", failures=2, graded=5), now_ns=0)
    merger.on_row(dict(row, source_partition=0, cause="unreadable", failures=1, graded=5), now_ns=0)
    row = dict(row, duration_histogram=durations(30.0, 30.0, 30.0))
    merger.on_row(dict(row, source_partition=1, cause="timeout", failures=1, graded=3), now_ns=0)
    merger.on_row(dict(row, source_partition=1, cause="timeout", failures=1, graded=3), now_ns=0)  # re-sent
    assert merger.tick(now_ns=0) == []
    [window] = merger.tick(now_ns=S)
    assert (window["failures"], window["graded"], window["failure_rate"]) == (4, 8, 0.5)
    # durations 2 s x5 and 30 s x3: the median is 2 s and the top ranks 30 s (min and max are exact)
    assert (window["duration_p50_s"], window["duration_p99_s"], window["duration_max_s"]) == (2.0, 30.0, 30.0)
    assert merger.tick(now_ns=2 * S) == []
