"""The benchmark workload: the records it generates and the ground truth counted from them."""

from __future__ import annotations

from collections import Counter, defaultdict

from bench.workload import NS, LiveRuns, Message, Truth, WorkloadConfig, messages, span_record, Writer
from rlpulse.schemas.catalogue import run_key
from rlpulse.schemas.codec import Codec

NOW = 1_800_000_000 * NS
SMALL = WorkloadConfig(project="p", runs=3, steps=5, rollouts=4, terms=("judge", "format"), steps_per_container=2, seed=3,
                       traced_every=0, trainer_metrics=0, engine_samples=False)  # rollouts and graders only
MIXED = WorkloadConfig(project="p", runs=2, steps=3, rollouts=10, steps_per_container=2, seed=5)  # the bench's mix


def _all() -> list[Message]:
    return list(messages(SMALL, NOW))


def test_event_counts_and_container_shapes() -> None:
    out = _all()
    assert SMALL.events_per_run == 5 * 4 * 3 + 5 + 2
    assert sum(len(m.records) for m in out) == SMALL.events
    chunks = 3  # steps 0-1, 2-3, 4
    assert [m.short for m in out] == ["spans", "steps"] * (SMALL.runs * chunks)
    spans = [m for m in out if m.short == "spans"]
    assert sorted(Counter(len(m.records) for m in spans).items()) == [(12, 3), (24, 6)]
    for m in out:
        assert {run_key(r["project"], r["run_id"]) for r in m.records} == {m.key}  # one run per container
    # runs are interleaved: the first chunk of every run comes before any run's second chunk
    assert [m.key for m in spans[:3]] == [run_key("p", f"r{i:05d}") for i in range(3)]


def test_every_record_encodes_and_decodes_with_the_schemas() -> None:
    codec = Codec()
    for m in _all():
        assert codec.decode(codec.encode(m.record, m.records)).records == m.records


def test_sequences_strictly_increase_per_writer_and_topic_and_writers_differ_per_run() -> None:
    last: dict[tuple[str, str], int] = {}
    writers = defaultdict(set)
    for m in _all():
        for r in m.records:
            writers[r["run_id"]].add(r["writer_id"])
            mark = (r["writer_id"], m.short)
            assert r["sequence_id"] > last.get(mark, 0)
            last[mark] = r["sequence_id"]
    assert all(len(w) == 1 for w in writers.values())
    assert len({next(iter(w)) for w in writers.values()}) == SMALL.runs
    # each topic has its own sequence from 1 without gaps
    assert sorted(n for (_, short), n in last.items() if short == "steps") == [SMALL.steps + 2] * SMALL.runs


def test_each_run_starts_steps_and_ends_in_time_order_in_the_past() -> None:
    by_run = defaultdict(list)
    times = defaultdict(list)
    for m in _all():
        for r in m.records:
            times[(r["run_id"], m.short)].append(r["time_ns"])
            if m.short == "steps":
                by_run[r["run_id"]].append((r["type"], r["step"], r["step_count"]))
    expected = [("RUN_START", -1, 0)] + [("STEP", s, s + 1) for s in range(5)] + [("RUN_END", -1, 5)]
    assert all(events == expected for events in by_run.values()) and len(by_run) == 3
    for series in times.values():
        assert series == sorted(series)
        assert NOW - (SMALL.span_s + SMALL.end_ago_s + 10) * NS <= series[0] and series[-1] <= NOW - SMALL.end_ago_s * NS


def test_truth_matches_an_independent_count_and_the_generator_is_deterministic() -> None:
    truth = Truth()
    for m in _all():
        truth.add(m)
    failures, graded, steps = Counter(), Counter(), defaultdict(lambda: [0, 0])
    for m in _all():  # the same seed gives the same records
        for r in m.records:
            if m.short == "spans" and r["term"] is not None:
                graded[(r["run_id"], r["term"])] += 1
                failures[(r["run_id"], r["term"], r["outcome"])] += r["status"] == "ERROR"
            elif m.short == "spans":
                steps[(r["run_id"], r["step"])][0] += 1
                steps[(r["run_id"], r["step"])][1] += r["completion_tokens"] >= r["max_tokens"]
    assert truth.failures == +Counter({k: v for k, v in failures.items() if k[2] != "ok"})
    assert truth.graded == graded and sum(graded.values()) == 3 * 5 * 4 * 2
    assert truth.step_stats() == {k: tuple(v) for k, v in steps.items()}
    assert set(k[2] for k in truth.failures) <= {"timeout", "unavailable", "unreadable", "ungradable"}
    summary = truth.summary()
    assert summary["span_events"] + summary["step_events"] == SMALL.events
    assert summary["rollouts"] == 3 * 5 * 4 and summary["span_messages"] == 9


def test_truth_of_hand_written_records() -> None:
    w = Writer.__new__(Writer)
    w.writer_id, w._seq = "w", {"spans": 0, "steps": 0}  # noqa: SLF001
    common = dict(trace_id=b"t" * 16, span_id=b"s" * 8, parent=None, rollout_id="x")
    records = [
        span_record("p", "r", w, kind="GRADER", time_ns=1, step=0, term="judge", outcome="timeout", **common),
        span_record("p", "r", w, kind="GRADER", time_ns=2, step=0, term="judge", outcome="ok", **common),
        span_record("p", "r", w, kind="GRADER", time_ns=3, step=1, term="judge", outcome="timeout", **common),
        span_record("p", "r", w, kind="ROLLOUT", time_ns=4, step=0, reward=1.0, clipped=True, **common),
        span_record("p", "r", w, kind="ROLLOUT", time_ns=5, step=0, reward=0.0, clipped=False, **common),
    ]
    truth = Truth()
    truth.add(Message("spans", "p/r", "Span", records))
    assert truth.failures == Counter({("r", "judge", "timeout"): 2})
    assert truth.graded == Counter({("r", "judge"): 3})
    assert truth.step_stats() == {("r", 0): (2, 1)}
    assert [r["sequence_id"] for r in records] == [1, 2, 3, 4, 5]
    assert records[0]["status"] == "ERROR" and records[1]["status"] == "OK"


def test_live_runs_stamp_now_and_complete_steps() -> None:
    live = LiveRuns(SMALL, runs=2, per_message=6)  # 6 records = 2 rollouts of 3 spans each
    starts = live.starts(NOW)
    assert [m.records[0]["type"] for m in starts] == ["RUN_START", "RUN_START"]
    out = [m for i in range(4) for m in live.spans(NOW + i)]
    spans = [m for m in out if m.short == "spans"]
    assert [m.key for m in spans] == ["p/live0000", "p/live0001"] * 2  # round robin
    assert all(r["time_ns"] in (NOW + i, NOW + i + 1_000_000) for i, m in enumerate(spans) for r in m.records)
    # 4 rollouts per step: each run completes step 0 on its second container
    assert [(m.key, m.records[0]["type"], m.records[0]["step_count"]) for m in out if m.short == "steps"] == [
        ("p/live0000", "STEP", 1), ("p/live0001", "STEP", 1)]
    seqs = [r["sequence_id"] for m in spans if m.key == "p/live0000" for r in m.records]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert [m.records[0]["step_count"] for m in live.ends(NOW)] == [1, 1]


def test_the_bench_mix_has_traced_calls_trainer_metrics_and_engine_samples() -> None:
    out = list(messages(MIXED, NOW))
    truth = Truth()
    for m in out:
        truth.add(m)
    # per run: 3 steps x (10 rollouts x 2 spans + 2 traced rollouts x (LLM + TOOL)) + 3 STEP + start + end + 3 samples
    assert MIXED.events_per_run == 3 * (10 * 2 + 2 * 2) + 3 + 2 + 3
    assert sum(len(m.records) for m in out) == MIXED.events == sum(truth.events.values())
    assert truth.kinds == {"GRADER": 60, "ROLLOUT": 60, "LLM": 12, "TOOL": 12}
    assert truth.events["hardware"] == 6 and truth.metrics == 2 * 3 * 8
    codec = Codec()
    for m in out:  # every record type encodes and decodes with the schemas
        assert codec.decode(codec.encode(m.record, m.records)).records == m.records
    llm = next(r for m in out if m.short == "spans" for r in m.records if r["kind"] == "LLM")
    rollout = next(r for m in out if m.short == "spans" for r in m.records
                   if r["kind"] == "ROLLOUT" and r["rollout_id"] == llm["rollout_id"] and r["step"] == llm["step"])
    assert llm["parent_span_id"] == rollout["span_id"] and llm["trace_id"] == rollout["trace_id"]
    assert llm["attributes"]["gen_ai.request.model"] == "policy"
    steps = [r for m in out if m.short == "steps" for r in m.records if r["type"] == "STEP"]
    assert all(len(r["metrics"]) == 8 and "loss" in r["metrics"] for r in steps)
