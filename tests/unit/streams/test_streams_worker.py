"""The streams worker driven through the harness (rlpulse.streams.testing.WorkerHarness): real Avro
messages at offsets, and what Faust's consumer does wrong injected on purpose: offsets it takes as
read without handing them over, a catch-up that makes no progress, ticks that arrive late, a
crash and the replay of what was not committed. Each test asserts the exact outputs."""

from __future__ import annotations

import logging

import pytest

from rlpulse.schemas.catalogue import (ALERTS_TOPIC, GRADER_FAILURES_TOPIC, GRADER_WINDOWS_TOPIC, HARDWARE_TOPIC,
                                       REWARD_HISTOGRAMS_TOPIC, SPANS_TOPIC, STEP_STATS_TOPIC, STEPS_TOPIC)
from rlpulse.base.settings import AlertThresholds
from rlpulse.streams.commits import STUCK_S, TICK_LATE_S, TopicPartition
from rlpulse.streams.runs import RunConfig
from rlpulse.streams.testing import NS, WorkerHarness

T0 = 1_700_000_000 * NS  # event times, well before the harness clock
IDLE_S = 5.0
CONFIG = RunConfig(window_s=10, lateness_s=2, idle_s=IDLE_S, retention_s=30, stall_after_s=900, silent_after_s=300,
                   thresholds=AlertThresholds(reward_zero_fraction=0.5))
SPANS_TP = TopicPartition("t.spans", 0)


class Job:
    """The records one SDK writer publishes, every field its schema requires (they travel as Avro)."""

    def __init__(self) -> None:
        self.seq = {SPANS_TOPIC: 0, STEPS_TOPIC: 0}

    def _base(self, topic: str, t_s: float) -> dict:
        self.seq[topic] += 1
        return dict(project="p", run_id="r1", attempt=1, time_ns=T0 + int(t_s * NS), writer_id="w1",
                    sequence_id=self.seq[topic])

    def grader(self, t_s: float, outcome: str = "ok") -> dict:
        r = self._base(SPANS_TOPIC, t_s)
        return dict(r, trace_id=b"t" * 16, span_id=r["sequence_id"].to_bytes(8, "big"), name="grade", kind="GRADER",
                    term="judge", outcome=outcome, step=0, start_time_ns=r["time_ns"] - NS, end_time_ns=r["time_ns"],
                    status="OK")

    def rollout(self, t_s: float, step: int, reward: float) -> dict:
        r = self._base(SPANS_TOPIC, t_s)
        return dict(r, trace_id=b"t" * 16, span_id=r["sequence_id"].to_bytes(8, "big"), name="rollout",
                    kind="ROLLOUT", step=step, reward=reward, clipped=False, term_shares={"judge": reward},
                    completion_tokens=100, start_time_ns=r["time_ns"] - NS, end_time_ns=r["time_ns"], status="OK")

    def step(self, t_s: float, type_: str, step: int = -1, count: int = 0) -> dict:
        return dict(self._base(STEPS_TOPIC, t_s), type=type_, trainer="rl", step=step, step_count=count)


def windows(outputs) -> list[tuple[str, int, int, float]]:
    """(cause or 'window', failures, graded, seconds after the harness's start) of each window record."""
    out = []
    for o in outputs:
        if o.topic in (GRADER_FAILURES_TOPIC, GRADER_WINDOWS_TOPIC):
            r = o.record
            out.append((r.get("cause", "window"), r["failures"], r["graded"], (r["emitted_at_ns"] - START) / NS))
    return out


START = WorkerHarness().now_ns


def closed(failures: int, graded: int, at_s: float) -> list[tuple[str, int, int, float]]:
    """The records of the one window (10 s from T0) closing at ``at_s``: a row per failure cause, then the window."""
    causes = [("error", 0), ("timeout", failures), ("unavailable", 0), ("ungradable", 0), ("unreadable", 0)]
    return [(c, n, graded, at_s) for c, n in causes] + [("window", failures, graded, at_s)]


def test_offsets_the_consumer_skipped_are_read_first_in_order_then_the_message(caplog) -> None:
    h, job = WorkerHarness(CONFIG), Job()
    h.feed(SPANS_TOPIC, [job.grader(1)])  # offset 0
    h.drop_next(SPANS_TOPIC, 2)  # Faust takes 1 and 2 as read without handing them over
    h.append(SPANS_TOPIC, [job.grader(2, "timeout")])
    h.append(SPANS_TOPIC, [job.grader(3, "timeout")])
    assert h.deliver(SPANS_TOPIC) == [] and h.reads == []  # nothing reveals the gap yet
    h.feed(SPANS_TOPIC, [job.grader(4)])  # offset 3: after 1, which this worker never got
    assert h.reads == [(SPANS_TP, 1, 3)]
    assert "offset 3 came after 1, which this worker never got: reading offsets 1 to 2" in caplog.text
    # In order: read after offset 3, offsets 1 and 2 would have been replays by their sequence ids.
    p = h.stage.processor
    assert (p.applied, p.duplicates, p.sequence_gaps) == (4, 0, 0)
    # idle from the first tick: the one that fixed the catch-up's target, and so was still behind
    assert windows(h.advance(IDLE_S + 1)) == closed(failures=2, graded=4, at_s=0.5 + IDLE_S)
    assert h.commit()[SPANS_TP] == 4


def test_a_stuck_catch_up_has_its_tail_read_once(caplog) -> None:
    h, job = WorkerHarness(CONFIG), Job()
    h.feed(SPANS_TOPIC, [job.grader(1)])
    h.advance(1)
    assert h.commit()[SPANS_TP] == 1
    h.crash()
    h.append(SPANS_TOPIC, [job.grader(2, "timeout")])  # published while no worker ran: offsets 1 and 2
    h.append(SPANS_TOPIC, [job.grader(3, "timeout")])
    h.drop_next(SPANS_TOPIC, 2)  # Faust's recovery skip takes the tail, and no later message reveals it
    assert h.deliver() == []
    # Not caught up: no wall-clock work (the run is not idle, its messages are still in Kafka).
    assert h.advance(STUCK_S) == [] and h.reads == []
    out = h.advance(1.0)  # no progress for STUCK_S since the tick that fixed the target: read what is missing
    assert h.reads == [(SPANS_TP, 1, 3)] and out == []
    assert "no progress towards" in caplog.text and "reading what is missing" in caplog.text
    # The target was fixed by the first tick after the restart (1.5 s) and the catch-up stood still
    # from the next (2 s), so the read came at 2 + STUCK_S. Caught up then; idle counts from there,
    # and the window holds all three.
    assert windows(h.advance(IDLE_S + 1)) == closed(failures=2, graded=3, at_s=2 + STUCK_S + IDLE_S)
    assert h.reads == [(SPANS_TP, 1, 3)]  # once


def test_a_stuck_catch_up_the_log_no_longer_holds_is_read_once_then_given_up(caplog) -> None:
    h, job = WorkerHarness(CONFIG), Job()
    h.feed(SPANS_TOPIC, [job.grader(1)])
    h.advance(1)
    h.commit()
    h.crash()
    h.append(SPANS_TOPIC, [job.grader(2, "timeout")])
    h.append(SPANS_TOPIC, [job.grader(3, "timeout")])
    h.drop_next(SPANS_TOPIC, 2)
    h.broker.log_start[SPANS_TP] = 3  # retention removed offsets 1 and 2 meanwhile: the read finds nothing
    assert h.advance(STUCK_S + 1) == [] and h.reads == [(SPANS_TP, 1, 3)]
    assert h.advance(STUCK_S - 1) == []
    with caplog.at_level(logging.WARNING):
        out = h.advance(1 + IDLE_S)  # no progress for another STUCK_S: given up, not read again
    assert "counting them as caught up" in caplog.text and h.reads == [(SPANS_TP, 1, 3)]
    # read at 2 + STUCK_S (as above), given up STUCK_S later; idle from the last tick still behind
    assert windows(out) == closed(failures=0, graded=1, at_s=2 + 2 * STUCK_S - 0.5 + IDLE_S)


def test_a_late_tick_makes_the_partition_catch_up_again_before_an_idle_close() -> None:
    h, job = WorkerHarness(CONFIG), Job()
    h.feed(SPANS_TOPIC, [job.grader(1)])
    h.feed(SPANS_TOPIC, [job.grader(2, "timeout")])
    assert h.advance(1) == []  # caught up; the window is open
    # The broker is out of reach for twice idle_s: the worker's ticks queue in its producer, and
    # the job's SDK buffers its next span, published once the broker is back.
    h.advance(2 * IDLE_S, cut_off=True)
    h.append(SPANS_TOPIC, [job.grader(3, "timeout")])
    # The queued ticks arrive first, sent up to 10 s ago: late, so the partition catches up again
    # to the log's end as seen now. No idle close, though no message came for longer than idle_s.
    assert h.advance(TICK_LATE_S) == []
    assert h.deliver(SPANS_TOPIC) == []  # the buffered span, counted in the open window
    # idle from the delivery, the end of the second catch-up
    assert windows(h.advance(IDLE_S + 1)) == closed(failures=2, graded=3, at_s=1 + 2 * IDLE_S + TICK_LATE_S + IDLE_S)


def test_a_gap_between_ticks_longer_than_tick_late_s_is_a_cut_off_too() -> None:
    h, job = WorkerHarness(CONFIG), Job()
    h.feed(SPANS_TOPIC, [job.grader(1, "timeout")])
    h.advance(1)
    h.broker.now_ns += int(2 * IDLE_S * NS)  # no tick at all for 10 s (the worker stalled)
    h.append(SPANS_TOPIC, [job.grader(2, "timeout")])
    assert h.advance(1) == []  # on time, but long after the last: catch up again first
    assert h.deliver(SPANS_TOPIC) == []
    assert windows(h.advance(IDLE_S + 1)) == closed(failures=2, graded=2, at_s=1 + 2 * IDLE_S + 1 + IDLE_S)


def workload(job: Job) -> list[tuple[str, list[dict]]]:
    """A run of two steps of four rollouts (step 1 collapses: rewards 0) with grader spans, then its end."""
    messages: list[tuple[str, list[dict]]] = [(STEPS_TOPIC, [job.step(0, "RUN_START")])]
    t = 1.0
    for s, rewards in enumerate([(0.5, 0.7, 1.0, 0.9), (0.0, 0.0, 0.0, 0.4)]):
        for reward in rewards:
            t += 0.5
            messages.append((SPANS_TOPIC, [job.rollout(t, s, reward), job.grader(t, "ok" if reward else "timeout")]))
        messages.append((STEPS_TOPIC, [job.step(t + 0.1, "STEP", step=s, count=s + 1)]))
    return messages + [(STEPS_TOPIC, [job.step(t + 0.5, "RUN_END", count=2)])]


def gpu_sample(t_s: float, xids: int) -> dict:
    return dict(project="p", run_id="r1", attempt=1, time_ns=T0 + int(t_s * NS), hw_id="GPU-1", index=0, host="h",
                power_w=300.0, temperature_c=60.0, gpu_utilization=0.9, memory_used_bytes=1, memory_total_bytes=2,
                memory_utilization=0.5, memory_activity=0.4, sm_clock_mhz=1500.0, throttle_reasons=0,
                xid_errors=xids, xid_last=79 if xids else None)


def play(h: WorkerHarness, messages: list[tuple[str, list[dict]]], crash_after: int | None = None,
         lose_last_write: bool = False) -> tuple[list, int, int]:
    """Feed ``messages`` 0.2 s apart (each with a GPU sample), committing after the third; with
    ``crash_after``, the worker dies after that message and the new one is handed what was not
    committed. Returns what the replay emitted, and the records it applied and skipped as replays."""
    replayed: tuple[list, int, int] = ([], 0, 0)
    for i, (topic, records) in enumerate(messages):
        h.feed(topic, records)
        h.feed(HARDWARE_TOPIC, [gpu_sample(i, xids=int(i >= 2))])
        h.advance(0.2)
        if i == 2:
            h.commit()
        if i == crash_after:
            h.crash(lose_last_write)
            replayed = (h.deliver(), h.stage.processor.applied, h.stage.processor.duplicates)
    h.advance(2 * IDLE_S)
    return replayed


def rows(h: WorkerHarness) -> dict:
    """What ClickHouse keeps of each derived topic, emission times aside (a restart shifts wall-clock work)."""
    topics = (GRADER_FAILURES_TOPIC, GRADER_WINDOWS_TOPIC, STEP_STATS_TOPIC, REWARD_HISTOGRAMS_TOPIC)
    return {t: {k: {f: v for f, v in r.items() if f != "emitted_at_ns"} for k, r in h.latest(t).items()}
            for t in topics} | {ALERTS_TOPIC: h.alert_rows()}


@pytest.mark.parametrize("lose_last_write", [False, True])
def test_a_crash_and_the_replay_of_what_was_not_committed_change_no_output(lose_last_write: bool) -> None:
    reference = WorkerHarness(CONFIG)
    play(reference, workload(Job()))
    # the run's end resolves its reward collapse; the GPU's XID follows its own rule and stays open
    assert reference.alert_rows() == [("xid", "GPU-1", "FIRING"), ("reward_collapse", "p/r1/1", "FIRING"),
                                      ("reward_collapse", "p/r1/1", "RESOLVED")]
    assert len(reference.latest(STEP_STATS_TOPIC)) == 2 and len(reference.latest(GRADER_WINDOWS_TOPIC)) == 1

    h = WorkerHarness(CONFIG)
    # messages 3 to 7 (9 records) and their GPU samples were not committed: handed over again
    replayed, applied, duplicates = play(h, workload(Job()), crash_after=7, lose_last_write=lose_last_write)
    assert h.reads == []  # a replay is no gap
    # (``applied`` counts the records handed to the processor, replays included)
    if lose_last_write:  # the state write of message 7 (a rollout and its grader span) was lost: applied again
        assert (replayed, applied, duplicates) == ([], 9, 7)
    else:  # all in the restored state: skipped by their sequence marks (and the samples by their time)
        assert (replayed, applied, duplicates) == ([], 9, 9)
    assert rows(h) == rows(reference)


def test_outputs_go_out_one_container_per_topic_key_and_record_type() -> None:
    h, job = WorkerHarness(CONFIG), Job()
    h.feed(STEPS_TOPIC, [job.step(0, "RUN_START")])
    h.feed(SPANS_TOPIC, [job.rollout(1, 0, 0.5), job.rollout(1.5, 0, 0.9)])
    h.feed(STEPS_TOPIC, [job.step(2, "STEP", step=0, count=1)])
    h.advance(2 * IDLE_S)
    assert [(topic, key, schema) for topic, key, schema, _ in h.broker.containers] == [
        ("step-stats", "p/r1", "StepStats"), ("reward-histograms", "p/r1", "RewardHistogram"),
        ("step-terms", "p/r1", "StepTermStats"), ("length-histograms", "p/r1", "CompletionLengthHistogram")]
    assert [n for *_, n in h.broker.containers] == [1, len(h.emissions(REWARD_HISTOGRAMS_TOPIC)), 1, 1]
    assert len(h.emissions(REWARD_HISTOGRAMS_TOPIC)) == 2  # "total" and the "judge" term, in one container
