"""The run processor through the harness: exact figures under replays, crashes and backlogs."""

from __future__ import annotations

import random

import pytest

from rlpulse.streams.runs import RunConfig
from rlpulse.streams.stage import load_state
from rlpulse.streams.testing import NS, Harness

T0 = 1_700_000_000 * NS  # event times: a fixed epoch, well before the harness clock
CONFIG = RunConfig(window_s=10, lateness_s=2, idle_s=5, retention_s=30, stall_after_s=900, silent_after_s=300)


class Job:
    """Builds the records one SDK writer would publish: per-topic sequence ids, one writer id."""

    def __init__(self, run_id: str = "r1", project: str = "p", attempt: int = 1, writer: str = "w1"):
        self.ident = {"project": project, "run_id": run_id, "attempt": attempt, "stage": ""}
        self.writer = writer
        self.seq = {"spans": 0, "steps": 0}

    def _next(self, topic: str) -> int:
        self.seq[topic] += 1
        return self.seq[topic]

    def grader(self, t_s: float, outcome: str = "ok", term: str = "judge", duration_s: float = 1.0, step: int = 0) -> dict:
        t = T0 + int(t_s * NS)
        return {**self.ident, "time_ns": t, "kind": "GRADER", "term": term, "outcome": outcome, "step": step,
                "start_time_ns": t - int(duration_s * NS), "end_time_ns": t, "writer_id": self.writer,
                "sequence_id": self._next("spans")}

    def rollout(self, t_s: float, step: int, reward: float, clipped: bool = False, sample: str | None = None,
                tokens: int = 100) -> dict:
        t = T0 + int(t_s * NS)
        return {**self.ident, "time_ns": t, "kind": "ROLLOUT", "step": step, "reward": reward, "clipped": clipped,
                "term_shares": {"judge": reward / 2}, "completion_tokens": tokens, "sample_id": sample,
                "writer_id": self.writer, "sequence_id": self._next("spans")}

    def step(self, t_s: float, type_: str, step: int = -1, count: int = 0) -> dict:
        return {**self.ident, "time_ns": T0 + int(t_s * NS), "type": type_, "trainer": "rl", "step": step,
                "step_count": count, "writer_id": self.writer, "sequence_id": self._next("steps")}


def workload(job: Job, steps: int = 4, per_step: int = 10) -> tuple[list[tuple[str, list[dict]]], dict]:
    """Messages (topic, records) of a small run and its truth: failures per (term, cause, window), rollouts per step."""
    rng = random.Random(7)
    messages: list[tuple[str, list[dict]]] = [("steps", [job.step(0, "RUN_START")])]
    failures: dict[tuple, int] = {}
    rollouts: dict[int, tuple[int, int]] = {}
    t = 1.0
    for s in range(steps):
        spans = []
        for i in range(per_step):
            t += 0.7
            clipped = rng.random() < 0.3
            spans.append(job.rollout(t, s, round(rng.random(), 3), clipped=clipped, sample=f"s{i // 2}"))
            n, c = rollouts.get(s, (0, 0))
            rollouts[s] = (n + 1, c + int(clipped))
            outcome = rng.choice(["ok", "ok", "timeout", "unavailable"])
            spans.append(job.grader(t, outcome, step=s))
            if outcome != "ok":
                start = (T0 + int(t * NS)) // (10 * NS) * (10 * NS)
                failures[("judge", outcome, start)] = failures.get(("judge", outcome, start), 0) + 1
        messages += [("spans", spans[:len(spans) // 2]), ("spans", spans[len(spans) // 2:])]
        messages.append(("steps", [job.step(t + 0.1, "STEP", step=s, count=s + 1)]))
    messages.append(("steps", [job.step(t + 0.5, "RUN_END", count=steps)]))
    return messages, {"failures": failures, "rollouts": rollouts}


def figures(h: Harness) -> dict:
    failures = {(k[3], k[4], k[5]): r["failures"] for k, r in h.latest("grader-failures").items() if r["failures"]}
    rollouts = {k[3]: (r["rollouts"], r["clipped"]) for k, r in h.latest("step-stats").items()}
    return {"failures": failures, "rollouts": rollouts}


def run_all(h: Harness, messages: list[tuple[str, list[dict]]]) -> None:
    for topic, records in messages:
        h.feed(topic, records)
        h.advance(0.2)
    h.advance(10)  # the run has gone idle: what is still open closes by the wall clock


def test_figures_equal_the_truth_and_windows_close_on_event_time():
    h = Harness(CONFIG)
    messages, truth = workload(Job())
    for topic, records in messages[:7]:
        h.feed(topic, records)  # no wall-clock time passes: only event time can close anything
    # step 0 ended at its STEP event; both writers' streams (spans, steps) have passed that + lateness
    assert list(h.latest("step-stats")) == [("p", "r1", 1, 0)]
    run_all(h, messages[7:])
    assert figures(h) == truth
    hist = h.latest("reward-histograms")[("p", "r1", 1, 0, "total")]
    assert hist["count"] == 10 and sum(hist["bucket_counts"]) == 10


def test_a_replay_changes_no_figure():
    h = Harness(CONFIG)
    messages, truth = workload(Job())
    for topic, records in messages:
        h.feed(topic, records)
    h.replay(last=len(messages))  # every message delivered twice
    h.advance(10)
    assert figures(h) == truth
    assert h.stage.processor.duplicates == sum(len(r) for _, r in messages)


def test_a_message_the_worker_never_saw_is_counted_as_a_sequence_gap_and_logged(caplog):
    h = Harness(CONFIG)
    messages, _ = workload(Job())
    spans = [i for i, (topic, _) in enumerate(messages) if topic == "spans"]
    skipped = spans[1]  # as a consumer that skipped offsets would: the records after it still come
    for i, (topic, records) in enumerate(messages):
        if i != skipped:
            h.feed(topic, records)
    assert h.stage.processor.sequence_gaps == len(messages[skipped][1])
    assert h.stage.processor.duplicates == 0
    assert "records never reached this worker" in caplog.text


@pytest.mark.parametrize("lose_last_write", [False, True])
def test_a_crash_then_replay_of_the_uncommitted_messages_gives_exact_figures(lose_last_write):
    h = Harness(CONFIG)
    messages, truth = workload(Job())
    for topic, records in messages[:6]:
        h.feed(topic, records)
    h.crash(lose_last_write=lose_last_write)  # between the state write and the commit, or before the write
    h.replay(last=3)  # the offsets after the last commit come again
    for topic, records in messages[6:]:
        h.feed(topic, records)
    h.advance(10)
    assert figures(h) == truth


def test_a_restart_never_emits_a_partial_step_or_window_over_a_complete_one():
    h = Harness(CONFIG)
    messages, truth = workload(Job())
    run_all(h, messages)
    h.crash()
    h.replay(last=len(messages))  # the whole range again, after everything was emitted
    h.advance(60)
    assert figures(h) == truth


def test_an_out_of_order_backlog_of_two_writers_processed_long_after_is_exact():
    """Two writers of one attempt interleaved out of time order, processed hours later in one burst."""
    a, b = Job(writer="wa"), Job(writer="wb")
    msgs_a, truth_a = workload(a, steps=3)
    msgs_b, truth_b = workload(b, steps=3)
    h = Harness(CONFIG, now_ns=T0 + 3 * 3600 * NS)  # the worker starts three hours after the jobs ran
    # writer b runs two messages ahead of writer a, and each writer's steps come after its spans
    order = [msgs_b[0], msgs_a[0], msgs_b[1], msgs_b[2]]
    for i in range(1, len(msgs_a)):
        order += [m for m in (msgs_b[i + 2:i + 3] + msgs_a[i:i + 1])]
    order += msgs_b[len(msgs_a) + 2:]
    assert sorted(map(str, order)) == sorted(map(str, msgs_a + msgs_b))
    for topic, records in order:
        h.feed(topic, records)
    h.advance(10)
    want_failures: dict = {}
    for k, n in list(truth_a["failures"].items()) + list(truth_b["failures"].items()):
        want_failures[k] = want_failures.get(k, 0) + n
    want_rollouts = {s: (truth_a["rollouts"][s][0] + truth_b["rollouts"][s][0],
                         truth_a["rollouts"][s][1] + truth_b["rollouts"][s][1]) for s in truth_a["rollouts"]}
    assert figures(h) == {"failures": want_failures, "rollouts": want_rollouts}
    assert not [r for r in h.emissions("grader-failures") if r["failures"] < want_failures.get(
        (r["term"], r["cause"], r["window_start_ns"]), 0)], "no window was emitted before all of its spans were in"


def test_late_data_for_a_retained_step_updates_it_and_rules_see_the_step_once():
    h = Harness(CONFIG)
    job = Job()
    h.feed("spans", [job.rollout(1, 0, 0.0), job.rollout(1.5, 0, 0.0)])
    h.feed("steps", [job.step(2, "STEP", step=0, count=1)])
    h.feed("spans", [job.rollout(5, 1, 1.0)])
    h.feed("steps", [job.step(5, "HEARTBEAT", count=1)])  # both streams pass step 0's end + lateness
    [first] = [r for r in h.emissions("step-stats") if r["step"] == 0]
    assert first["rollouts"] == 2 and ("reward_collapse", "p/r1/1", "FIRING") in h.alerts()
    h.feed("spans", [job.rollout(3, 0, 1.0)])  # late, but retained: re-emitted with it
    assert h.latest("step-stats")[("p", "r1", 1, 0)]["rollouts"] == 3
    assert h.alerts().count(("reward_collapse", "p/r1/1", "FIRING")) == 1


def test_data_older_than_the_retention_is_counted_not_turned_into_a_partial_row():
    h = Harness(CONFIG)
    job = Job()
    h.feed("spans", [job.grader(1, "timeout")])
    h.feed("spans", [job.grader(100, "ok")])  # progress far past the first window and its retention
    assert h.latest("grader-failures")[("p", "r1", 1, "judge", "timeout", T0)]["failures"] == 1
    h.feed("spans", [job.grader(2, "unavailable")])  # for the retired window
    rows = h.latest("grader-failures")
    assert rows[("p", "r1", 1, "judge", "timeout", T0)]["failures"] == 1
    assert rows[("p", "r1", 1, "judge", "unavailable", T0)]["failures"] == 0  # no partial row replaced it
    [run] = map(load_state, h.table.values())
    assert run["late_dropped"] == 1


def test_stall_fires_and_resolves_once_across_a_crash():
    h = Harness(RunConfig(window_s=10, lateness_s=2, idle_s=5, stall_after_s=20, silent_after_s=300))
    job = Job()
    h.feed("steps", [job.step(0, "RUN_START")])
    for i in range(10):
        h.advance(3)
        h.feed("steps", [job.step(3 * i, "HEARTBEAT", count=0)])
    assert h.alerts() == [("first_step_stalled", "p/r1/1", "FIRING")]  # no step completed yet
    h.crash()
    h.advance(3)
    h.feed("steps", [job.step(40, "STEP", step=0, count=1)])
    assert h.alerts() == [("first_step_stalled", "p/r1/1", "FIRING"), ("first_step_stalled", "p/r1/1", "RESOLVED")]


def test_every_state_and_alert_key_includes_the_project():
    h = Harness(CONFIG)
    for project in ("p", "q"):  # one run id in two projects: two runs
        job = Job(project=project)
        h.feed("spans", [job.rollout(1, 0, 0.0)])
        h.feed("steps", [job.step(2, "STEP", step=0, count=1), job.step(2.5, "RUN_END", count=1)])
    h.advance(10)
    assert sorted(h.table) == ["p/r1", "q/r1"]
    # reward collapse, once per project, resolved by each run's end
    assert sorted(h.alerts()) == [(rule, f"{p}/r1/1", state) for p in "pq" for rule, state in
                                  (("reward_collapse", "FIRING"), ("reward_collapse", "RESOLVED"))]


@pytest.mark.parametrize("first", ["steps", "spans"])
def test_one_topic_read_to_its_end_before_the_other_is_exact(first):
    """In a backlog the spans and steps topics are read independently: one may be far ahead."""
    h = Harness(CONFIG)
    messages, truth = workload(Job(), steps=6)
    for topic, records in sorted(messages, key=lambda m: m[0] != first):  # stable: each topic keeps its order
        h.feed(topic, records)
        h.advance(0.5)  # wall clock moves on while the other topic is still being read
    h.advance(10)
    assert figures(h) == truth
    [run] = map(load_state, h.table.values())
    assert run["late_dropped"] == 0


def test_a_run_whose_writer_ended_and_whose_spans_are_all_in_closes_at_once():
    """RUN_END names the last span sequence id: no wall-clock wait once that span is applied."""
    h = Harness(CONFIG)
    job = Job()
    messages, truth = workload(job, steps=3)
    *body, (_, [end]) = messages
    end["spans_sent"] = job.seq["spans"]
    last_spans = max(i for i, (topic, _) in enumerate(body) if topic == "spans")
    for topic, records in body[:last_spans] + body[last_spans + 1:]:  # the last span message is held back
        h.feed(topic, records)
    h.feed("steps", [end])
    assert figures(h) != truth  # the RUN_END is in, but not every span it names: still open
    h.feed(*body[last_spans])
    assert figures(h) == truth  # no tick, no wall clock: closed because everything is in


def test_sparse_spans_with_the_steps_topic_far_ahead_are_exact():
    """In a big backlog a run's span messages can be seconds apart while its steps topic races ahead."""
    h = Harness(CONFIG)
    job = Job()
    messages, truth = workload(job, steps=6)
    spans = [m for m in messages if m[0] == "spans"]
    steps = [m for m in messages if m[0] == "steps"]
    for message in steps[:-1]:  # every STEP (not yet RUN_END) is in before most spans: far ahead
        h.feed(*message)
    ahead = steps[-2][1][0]["time_ns"]
    for message in spans:
        h.feed(*message)
        for wait in (4, 2):  # the run's next span message is 6 s away; its heartbeats keep coming
            h.advance(wait)
            h.feed("steps", [dict(job.step(0, "HEARTBEAT", count=6), time_ns=ahead)])
    h.feed(*steps[-1])
    h.advance(10)
    assert figures(h) == truth
    [run] = map(load_state, h.table.values())
    assert run["late_dropped"] == 0


# -- restarts: what Faust's at-least-once does to outputs and state -------------------------------
# Outputs and the changelog write of a message are sent before its offset is committed, in no
# guaranteed order: after a SIGKILL the restored state can be older than what was already
# published, the uncommitted messages come again, and the dead worker's partitions only move to
# the new one after its session times out (10 s), while ticks keep coming.

def test_a_restart_neither_closes_a_step_early_nor_finds_a_live_run_silent_before_the_replay():
    h = Harness(RunConfig(window_s=10, lateness_s=2, idle_s=5, retention_s=30, stall_after_s=900, silent_after_s=3))
    job = Job()
    h.feed("steps", [job.step(0, "RUN_START")])
    h.feed("spans", [job.rollout(1, 0, 0.0, clipped=True), job.rollout(1.2, 0, 0.0)])
    h.feed("spans", [job.rollout(1.5, 0, 0.9, clipped=True), job.rollout(1.7, 0, 0.9)])
    h.crash(lose_last_write=True)  # step 0 restored with 2 of its 4 rollouts, both rewards 0
    h.advance(12)  # the rebalance, ticks running: idle and silent by the clock, but messages are waiting
    h.replay(last=1)
    h.feed("steps", [job.step(2, "STEP", step=0, count=1), job.step(2.5, "HEARTBEAT", count=1)])
    for t in range(3, 8):
        h.feed("spans", [job.rollout(t, 1, 0.9)])
        h.feed("steps", [job.step(t + 0.5, "HEARTBEAT", count=1)])
        h.advance(1)
    h.feed("steps", [job.step(8, "RUN_END", count=2)])
    h.advance(10)
    # step 0 emitted once, whole: never its restored half (zero fraction 1.0, a false reward collapse)
    assert [(r["step"], r["rollouts"], r["clipped"]) for r in h.emissions("step-stats")] == [(0, 4, 2), (1, 5, 0)]
    assert h.alerts() == []  # and the run, reporting all along, never looked silent


def test_an_alert_fired_again_after_its_state_write_was_lost_is_the_same_episode():
    h = Harness(CONFIG)
    job = Job()
    h.feed("spans", [job.rollout(1, 0, 0.0), job.rollout(1.5, 0, 0.0)])
    h.feed("steps", [job.step(2, "STEP", step=0, count=1)])
    h.feed("spans", [job.rollout(5, 1, 0.0)])  # closes step 0: reward collapse fires, the output is sent
    h.crash(lose_last_write=True)  # ... but the state write that recorded it never reached the changelog
    h.replay(last=1)  # fires again: the same episode (first_seen_ns is step 0's time, not the clock)
    h.feed("spans", [job.rollout(6, 1, 0.9), job.rollout(9, 2, 0.9)])  # step 1: 1 of 2 at 0, resolves
    h.feed("steps", [job.step(9.5, "RUN_END", count=3)])
    h.advance(10)
    fired = [o.record for o in h.outputs if o.topic == "alerts" and o.record["state"] == "FIRING"]
    assert len(fired) == 2 and fired[0]["first_seen_ns"] == fired[1]["first_seen_ns"] == T0 + int(1.5 * NS)
    assert h.alert_rows() == [("reward_collapse", "p/r1/1", "FIRING"), ("reward_collapse", "p/r1/1", "RESOLVED")]


def test_a_silence_fired_again_after_the_tick_write_was_lost_is_the_same_episode():
    h = Harness(RunConfig(window_s=10, lateness_s=2, idle_s=5, stall_after_s=900, silent_after_s=3))
    job = Job()
    h.feed("steps", [job.step(0, "RUN_START")])
    h.advance(3.5)  # silent: the tick fires and writes the alert into the state
    assert h.alerts() == [("silent_run", "p/r1/1", "FIRING")]
    h.crash(lose_last_write=True)  # the tick's write is lost; the alert was published
    h.replay(last=1)
    h.advance(4)  # silent again by the restored state: fired again, as the same episode
    h.feed("steps", [job.step(1, "HEARTBEAT", count=0)])
    assert h.alerts() == [("silent_run", "p/r1/1", "FIRING")] * 2 + [("silent_run", "p/r1/1", "RESOLVED")]
    assert h.alert_rows() == [("silent_run", "p/r1/1", "FIRING"), ("silent_run", "p/r1/1", "RESOLVED")]


def test_a_crashed_attempts_silence_resolves_once_when_the_next_attempt_starts():
    h = Harness(RunConfig(window_s=10, lateness_s=2, idle_s=5, stall_after_s=900, silent_after_s=3))
    first, second = Job(attempt=1, writer="w1"), Job(attempt=2, writer="w2")
    h.feed("steps", [first.step(0, "RUN_START")])
    h.feed("steps", [first.step(1, "HEARTBEAT", count=0)])
    h.advance(4)  # attempt 1 died without RUN_END
    h.feed("steps", [second.step(10, "RUN_START")])
    h.feed("steps", [first.step(1.5, "HEARTBEAT", count=0)])  # a straggler of the dead attempt
    for t in range(11, 16):
        h.advance(1)
        h.feed("steps", [second.step(t, "HEARTBEAT", count=0)])
    h.replay(last=7)  # and all of it again
    h.advance(1)
    assert h.alerts() == [("silent_run", "p/r1/1", "FIRING"), ("silent_run", "p/r1/1", "RESOLVED")]
    [resolved] = [o.record for o in h.outputs if o.topic == "alerts" and o.record["state"] == "RESOLVED"]
    assert "superseded by attempt 2" in resolved["summary"]


def test_a_poison_rollout_is_skipped_and_logged_without_touching_its_step(caplog):
    h = Harness(CONFIG)
    job = Job()
    good = job.rollout(1, 0, 0.5, clipped=True)
    bad = [dict(job.rollout(1.1, 0, 0.5), reward=float("nan")), dict(job.rollout(1.2, 0, 0.5), completion_tokens=-1),
           dict(job.rollout(1.3, 0, 0.5), term_shares={"judge": float("inf")}),
           dict(job.rollout(1.4, 5, 0.5), reward=float("-inf"))]
    h.feed("spans", [good] + bad + [job.rollout(1.5, 0, 0.7)])
    h.feed("steps", [job.step(2, "STEP", step=0, count=1), job.step(3, "RUN_END", count=1)])
    h.advance(10)
    [stats] = h.emissions("step-stats")  # no row for step 5: its only rollout was invalid
    assert (stats["step"], stats["rollouts"], stats["clipped"], stats["reward_mean"]) == (0, 2, 1, 0.6)
    assert h.latest("reward-histograms")[("p", "r1", 1, 0, "judge")]["count"] == 2
    [run] = map(load_state, h.table.values())
    assert run["rejected"] == 4
    reasons = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(reasons) == 4 and "reward nan is not finite" in reasons[0] and "negative" in reasons[1]


def test_poison_messages_between_good_ones_are_skipped_logged_and_change_no_figure(caplog):
    """As the agents decode: each message through rlpulse.streams.inputs, the good ones into the processor."""
    from rlpulse.schemas.codec import Codec
    from rlpulse.streams.inputs import Inputs

    codec, inputs, h, job = Codec(), Inputs(Codec()), Harness(CONFIG), Job()
    messages, truth = workload(job, steps=3)

    def wire(r: dict) -> dict:  # the span fields the processor does not read
        return {
            "trace_id": b"t" * 16,
            "span_id": b"s" * 8,
            "name": "x",
            "status": "OK",
            "start_time_ns": r["time_ns"],
            "end_time_ns": r["time_ns"],
            **r,
        }

    good = [
        (topic, codec.encode("Span", [wire(r) for r in records]) if topic == "spans" else codec.encode("Step", records))
        for topic, records in messages
    ]
    nan = codec.encode("Span", [wire(dict(job.rollout(0.5, 0, 0.5), reward=float("nan"), sequence_id=10_000))])
    poison = [
        ("spans", b"\x00garbage that is not Avro", "not an Avro container"),
        ("spans", good[2][1][:-30], "runs past the end"),
        ("spans", good[0][1], "rlpulse.v1.Step is not one of rlpulse.v1.Span"),  # a Step on the spans topic
        (
            "steps",
            codec.encode(
                "GpuSample",
                [
                    dict(
                        time_ns=1,
                        hw_id="GPU-1",
                        index=0,
                        power_w=1.0,
                        temperature_c=1.0,
                        gpu_utilization=0.0,
                        memory_used_bytes=0,
                        memory_total_bytes=1,
                        memory_utilization=0.0,
                        memory_activity=0.0,
                        sm_clock_mhz=1.0,
                        throttle_reasons=0,
                    )
                ],
            ),
            "GpuSample is not one of rlpulse.v1.Step",
        ),
        ("spans", None, "too short"),
    ]  # a tombstone
    stream = []
    for i, message in enumerate(good):
        stream.append(message)
        if i < len(poison):
            stream.append(poison[i][:2])
    stream.append(("spans", nan))  # decodes, but its only record is invalid
    for offset, (topic, value) in enumerate(stream):
        records = inputs.decode(topic, value, f"t.{topic}[0]@{offset}")
        if records:
            h.feed(topic, records)
        h.advance(0.2)
    h.advance(10)
    assert figures(h) == truth
    assert inputs.skipped == len(poison)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    for (_, _, reason), line in zip(poison, [w for w in warnings if "undecodable" in w]):
        assert reason in line
    assert any("reward nan is not finite" in w for w in warnings)


def test_after_a_restore_each_partitions_tick_works_on_that_partitions_runs_only():
    """Restored state is bytes no Run was built from yet: a tick reads each value's partition and
    leaves the others' runs (another partition's, or a standby copy) as they are."""
    h = Harness(partitions=2)
    for partition, job in enumerate((Job("ra"), Job("rb"))):
        h.feed("steps", [job.step(0, "RUN_START")], partition=partition)
        h.feed("spans", [job.grader(1.0)], partition=partition)
        h.feed("steps", [job.step(2.0, "RUN_END")], partition=partition)
    h.crash()
    later = h.now_ns + 48 * 3600 * NS  # every window emitted and retired, both runs long over
    closed = h.stage.on_tick(0, later)
    assert sorted(h.table) == ["p/rb"]  # the run of partition 0 expired; partition 1's is untouched
    assert {o.record["run_id"] for o in closed} == {"ra"}
    assert {o.record["run_id"] for o in h.stage.on_tick(1, later)} == {"rb"}
    assert h.table == {}


def test_failed_rollouts_count_as_attempted_and_in_no_reward_figure() -> None:
    """A ROLLOUT span with status ERROR (it raised, or returned a failed status) is attempted, not scored."""
    job = Job()
    h = Harness(RunConfig(window_s=10, lateness_s=0))
    scored = job.rollout(1.0, step=0, reward=0.5)  # (made in publish order: the streams skip a lower sequence as a replay)
    failed = {**job.rollout(1.0, step=0, reward=1.0), "status": "ERROR"}  # even with a reward: not counted in it
    raised = {**job.rollout(1.5, step=0, reward=0.0), "status": "ERROR", "reward": None}
    h.feed("spans", [scored, failed, raised, job.rollout(2.0, step=0, reward=0.25)])
    h.feed("steps", [job.step(3.0, "STEP", step=0, count=1)])
    h.feed("spans", [job.rollout(10.0, step=1, reward=0.0)])  # the spans' event time passes step 0's end
    [stats] = [r for r in h.latest("step-stats").values() if r["step"] == 0]
    assert (stats["rollouts"], stats["rollouts_failed"], stats["rollouts_attempted"]) == (2, 2, 4)
    assert stats["reward_mean"] == 0.375 and stats["reward_max"] == 0.5


def test_an_otlp_writer_numbered_by_kafka_position_is_deduplicated_and_its_jumps_are_no_gap():
    """Records translated from OTLP carry (offset + 1) << 16 | index (rlpulse.producers.otlp.ingest.number):
    a replayed message is skipped like an SDK writer's replay, and the jumps between messages are not
    counted as records that never arrived."""
    from rlpulse.schemas.catalogue import OTLP_WRITER_PREFIX

    h = Harness(CONFIG)
    job = Job(writer=OTLP_WRITER_PREFIX + "job-0@1")
    first = [dict(job.rollout(1.0, 0, 0.5), sequence_id=(4 << 16) | i) for i in range(2)]
    second = [dict(job.rollout(2.0, 0, 1.0), sequence_id=(9 << 16))]
    for records in (first, second, first):  # the last: a replay of the first message
        h.feed("spans", records)
    processor = h.stage.processor
    assert (processor.sequence_gaps, processor.duplicates) == (0, 2)
