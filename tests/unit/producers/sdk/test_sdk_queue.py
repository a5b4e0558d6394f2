"""The SDK's queue without a broker: sequence ids, drop accounting, records built by the sender."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from rlpulse.producers import TrainingTelemetry
from rlpulse.producers.sdk.sender import SenderConfig
from rlpulse.base.settings import Settings
from rlpulse.schemas.codec import Codec, record_count

SETTINGS = Settings.load({"RLPULSE_TOPIC_PREFIX": "q"})


def make(**kwargs) -> TrainingTelemetry:
    return TrainingTelemetry(project="p", run_id="r", settings=SETTINGS, **kwargs)  # never started


def by_topic(tel: TrainingTelemetry) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for topic, _, record in tel.sender.queued_records():
        out.setdefault(topic, []).append(record)
    return out


def test_sequence_ids_per_writer_per_topic_under_eight_threads():
    tel = make()
    per_thread = 300
    start = threading.Barrier(8)

    def work(t: int) -> None:
        start.wait()
        for i in range(per_thread):
            tel.rollout(step=i, rollout_id=f"t{t}-{i}", reward=0.5, term_shares={"judge": 0.5})
            tel.grader(step=i, rollout_id=f"t{t}-{i}", term="judge", outcome="ok", duration_s=0.1, score=1.0)
            if i % 10 == 0:
                tel.step_completed(step=i)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    topics = by_topic(tel)
    spans, steps = topics["q.spans"], topics["q.steps"]
    # In queue order (the order they reach Kafka) the ids are 1, 2, 3, ... with no gap or repeat,
    # each topic numbered on its own.
    assert [r["writer_sequence"] for r in spans] == list(range(1, 8 * per_thread * 2 + 1))
    assert [r["sequence_id"] for r in steps] == list(range(1, 8 * (per_thread // 10) + 1))
    # step_count was taken in the same step as the sequence id, so it rises with it
    assert [r["step_count"] for r in steps] == list(range(1, len(steps) + 1))
    assert {r["writer_id"] for r in spans + steps} == {tel.writer_id}
    assert {key for _, key, _ in tel.sender.queued_records()} == {"p/r"}
    assert tel.pending == len(spans) + len(steps) and tel.dropped == 0


def test_each_writer_has_its_own_id_and_sequences():
    a, b = make(), make()
    assert a.writer_id != b.writer_id and len(a.writer_id) == 16
    for tel in (a, b):
        tel.heartbeat()
        tel.rollout(step=0, rollout_id="x", reward=0.0)
    for tel in (a, b):
        queued = tel.sender.queued_records()
        assert [(t, r.get("writer_sequence") or r["sequence_id"]) for t, _, r in queued] == [("q.steps", 1), ("q.spans", 1)]


def test_full_buffer_drops_counts_and_logs_once(caplog):
    tel = make(buffer_bytes=5_000)
    with caplog.at_level(logging.WARNING, logger="rlpulse.producers.sdk.queue"):
        for i in range(500):
            tel.grader(step=0, rollout_id=f"r{i}", term="judge", outcome="timeout", duration_s=0.1)
    accepted = tel.pending
    assert 0 < accepted < 500 and tel.dropped == 500 - accepted
    assert len([r for r in caplog.records if "buffer full" in r.getMessage()]) == 1  # at most every 10 s
    # Dropped events take no sequence id: what was accepted is numbered without gaps.
    assert [r["writer_sequence"] for _, _, r in tel.sender.queued_records()] == list(range(1, accepted + 1))


def test_delivery_frees_the_budget():
    tel = make(buffer_bytes=5_000)
    queue = tel.sender.queue
    while tel.dropped == 0:
        tel.heartbeat()
    items = queue.take(10_000)
    queue.done(len(items), 0, sum(size for _, _, size, _ in items))
    assert tel.pending == 0 and tel.delivered == len(items)
    tel.heartbeat()  # room again
    assert tel.pending == 1 and tel.dropped == 1


# Ids and names are at most 256 characters and attribute values 64 KiB (tests/unit/streams/test_input_limits.py),
# so what can outgrow a message is many large attributes.
@pytest.mark.parametrize("call, kwargs, field", [
    ("rollout", dict(step=1, rollout_id="x", reward=0.5, attributes={"ok": 1, **{f"blob{i}": "b" * 60_000 for i in range(20)}}),
     r"attributes\['blob\d+'\]"),
    ("rollout", dict(step=1, rollout_id="x", reward=0.5, attributes={f"k{i}": "é" * 30_000 for i in range(20)}),
     r"attributes\['k\d+'\]"),  # 600,000 characters, 1.2 MB in UTF-8
])
def test_a_record_that_can_never_fit_is_refused_at_the_call(call, kwargs, field):
    tel = make()
    with pytest.raises(ValueError, match=rf"{field} is \d+ bytes: a Span record must fit in one Kafka message"):
        getattr(tel, call)(**kwargs)
    assert tel.pending == 0  # nothing queued, so nothing can block the events after it


def test_a_large_record_that_fits_is_accepted_and_encodes_below_the_limit():
    tel = make()
    # 600 KB: near, not over
    tel.rollout(step=1, rollout_id="x", reward=0.5, attributes={f"k{i}": "é" * 30_000 for i in range(10)})
    [(_, _, record)] = tel.sender.queued_records()
    containers, lost = tel.sender.encoder.encode(tel.sender.queue.take(10))
    assert not lost and len(containers) == 1 and len(containers[0].value) < 1024 * 1024
    assert Codec().decode(containers[0].value).records[0]["attributes"] == record["attributes"]


def test_message_limit_is_a_setting():
    tel = make(sender_config=SenderConfig(max_message_bytes=64 * 1024))
    with pytest.raises(ValueError, match=r"attributes\['a'\] is \d+ bytes"):
        tel.rollout(step=1, rollout_id="x", reward=0.5, attributes={"a": "s" * 60_000, "b": "s" * 10_000})


def test_encoder_groups_and_splits_by_count_and_bytes():
    tel = make(sender_config=SenderConfig(max_message_bytes=64 * 1024, batch_records=100))
    for i in range(450):
        tel.rollout(step=i, rollout_id=f"r{i}", reward=0.5, attributes={"note": "n" * (500 if i % 7 == 0 else 5)})
        if i % 50 == 0:
            tel.heartbeat()
    containers, lost = tel.sender.encoder.encode(tel.sender.queue.take(10_000))
    assert not lost
    spans = [c for c in containers if c.topic == "q.spans"]
    assert all(c.key == b"p/r" and len(c.value) + len(c.key) < 64 * 1024 for c in containers)
    assert all(record_count(c.value) <= 100 for c in spans) and len(spans) >= 5
    codec = Codec()
    ids = [r["writer_sequence"] for c in spans for r in codec.decode(c.value).records]
    assert ids == list(range(1, 451))  # every record, in order, once
    assert [r["type"] for c in containers if c.topic == "q.steps" for r in codec.decode(c.value).records] == ["HEARTBEAT"] * 9


def test_queued_records_are_what_the_sdk_documents():
    tel = make(stage="rl", clock=lambda: 5_000_000_000)
    tel.grader(step=3, rollout_id="x", term="judge", outcome="timeout", duration_s=2.0, score=0.9, input_tokens=7)
    tel.rollout(
        step=3,
        rollout_id="x",
        reward=1,
        term_shares={"judge": 0, "format": 0.25},
        completion_tokens=1024,
        max_tokens=1024,
        sample_id="prompt-17",
        duration_s=1,
    )
    tel.step_completed(step=3, tokens=1000, duration_s=4.0, mfu=0.4)
    (t1, k1, grader), (t2, _, rollout), (t3, _, step) = tel.sender.queued_records()
    assert (t1, t2, t3, k1) == ("q.spans", "q.spans", "q.steps", "p/r")
    assert (grader["kind"], grader["outcome"], grader["score"], grader["status"], grader["status_message"]) == (
        "GRADER",
        "timeout",
        None,
        "ERROR",
        "timeout",
    )  # a failed score is no score, whatever the call said
    assert grader["start_time_ns"] == 3_000_000_000 and grader["judge_input_tokens"] == 7
    assert grader["parent_span_id"] == rollout["span_id"] and grader["trace_id"] == rollout["trace_id"]
    assert (rollout["reward"], rollout["term_shares"], rollout["clipped"], rollout["sample_id"]) == (
        1.0,
        {"judge": 0.0, "format": 0.25},
        True,
        "prompt-17",
    )
    assert type(rollout["reward"]) is float and all(type(x) is float for x in rollout["term_shares"].values())
    assert (step["type"], step["step_count"], step["throughput"], step["mfu"], step["stage"]) == ("STEP", 1, 250.0, 0.4, "rl")
    Codec().encode("Span", [grader, rollout])
    Codec().encode("Step", [step])


def test_the_caller_may_reuse_its_dicts():
    tel = make()
    shares, attrs = {"judge": 0.5}, {"a": 1}
    tel.rollout(step=0, rollout_id="x", reward=0.5, term_shares=shares, attributes=attrs)
    shares["judge"], attrs["a"] = 0.9, 2
    [(_, _, record)] = tel.sender.queued_records()
    assert record["term_shares"] == {"judge": 0.5} and record["attributes"] == {"a": 1}


def test_hardware_records_are_checked_at_the_call():
    tel = make()
    placement = dict(project="p", run_id="r", attempt=1, time_ns=1, role="trainer", rank=0, hw_id="GPU-a")
    assert tel.publish_hardware("Placement", "GPU-a", placement)
    with pytest.raises(ValueError, match="rank"):
        tel.publish_hardware("Placement", "GPU-a", dict(placement, rank="zero"))
    [(topic, key, record)] = tel.sender.queued_records()
    assert (topic, key, record["hw_id"]) == ("q.hardware", "GPU-a", "GPU-a") and "sequence_id" not in record


def test_publish_span_takes_this_writers_identity_and_sequence():
    tel = make()
    fields = dict(
        time_ns=2,
        trace_id=b"t" * 16,
        span_id=b"s" * 8,
        name="chat",
        kind="LLM",
        start_time_ns=1,
        end_time_ns=2,
        project="other",
        sequence_id=99,
        attributes={"k": "v"},
    )
    assert tel.publish_span(fields)
    with pytest.raises(ValueError, match="kind must be one of"):
        tel.publish_span(dict(fields, kind="BOGUS"))
    with pytest.raises(ValueError, match=r"attributes\['k'\] is"):
        tel.publish_span(dict(fields, attributes={"k": "v" * 2_000_000}))
    [(_, _, record)] = tel.sender.queued_records()
    # the writer's identity and publish order; a sequence_id given (a tracer's start order) is kept
    assert (record["project"], record["writer_sequence"], record["sequence_id"], record["writer_id"]) == \
        ("p", 1, 99, tel.writer_id)
    Codec().encode("Span", [record])


def test_the_queue_wakes_the_sender_once_per_arming():
    from rlpulse.producers.sdk.queue import SPANS, Channel, EventQueue

    queue = EventQueue(buffer_bytes=10**6, batch_records=3)
    woken: list[int] = []
    queue.set_waker(lambda: woken.append(len(queue)))
    channel = Channel("t", "k", "Span", lambda seq, args: args)
    queue.put(SPANS, channel, {}, 10)
    assert woken == []  # nobody asked
    queue.take(10)
    assert queue.arm(1)  # the sender sleeps on an empty queue
    for _ in range(2):
        queue.put(SPANS, channel, {}, 10)
    assert woken == [1]  # the first event wakes it, once
    assert queue.arm(3)  # it lingers for a batch
    queue.put(SPANS, channel, {}, 10)
    queue.put(SPANS, channel, {}, 10)
    assert woken == [1, 3]
    assert not queue.arm(3)  # a batch is already there: no sleeping


def test_producer_is_idempotent_compressed_and_batches_large():
    from aiokafka import AIOKafkaProducer

    kwargs = make().sender.transport.producer_kwargs()
    assert (kwargs["acks"], kwargs["enable_idempotence"], kwargs["compression_type"]) == ("all", True, "lz4")
    assert kwargs["max_batch_size"] == 1024 * 1024 and 0 < kwargs["linger_ms"] <= 10

    async def construct() -> None:
        AIOKafkaProducer(**kwargs)  # raises when the lz4 codec (cramjam) is missing

    asyncio.run(construct())


def test_a_record_that_does_not_encode_is_isolated_and_dropped_not_retried(caplog):
    from rlpulse.producers.sdk.queue import SPANS

    tel = make()
    span = dict(time_ns=2, trace_id=b"t" * 16, span_id=b"s" * 8, name="chat", kind="LLM", start_time_ns=1, end_time_ns=2)
    for i in range(9):
        tel.publish_span(dict(span, step=i))
        if i == 3:  # a record the calls would refuse, as a bug in a builder would make it: queued directly
            tel.sender.queue.put(SPANS, tel._span_channel, dict(span, step="three"), 100)
    with caplog.at_level(logging.ERROR, logger="rlpulse.producers.sdk.containers"):
        containers, lost = tel.sender.encoder.encode(tel.sender.queue.take(100))
    records = [r for c in containers for r in Codec().decode(c.value).records]
    assert [r["step"] for r in records] == list(range(9)) and len(lost) == 1
    assert "could not be sent" in caplog.text and "step" in caplog.text


def test_a_full_buffer_holds_no_more_memory_than_its_bound():
    import tracemalloc

    budget = 2_000_000
    tel = make(buffer_bytes=budget)
    tel.rollout(step=0, rollout_id="warm", reward=0.5, term_shares={"judge": 0.1, "format": 0.1})
    tracemalloc.start()
    try:
        i = 0
        while tel.dropped == 0:  # ids made per call, as a training loop does, kept alive by the queue only
            tel.rollout(
                step=i,
                rollout_id=f"rollout-{i}",
                reward=0.5 + i,
                term_shares={"judge": 0.1 + i, "format": 0.1},
                completion_tokens=100 + i,
                max_tokens=1024,
                sample_id=f"prompt-{i}",
            )
            tel.grader(step=i, rollout_id=f"rollout-{i}", term="judge", outcome="ok", duration_s=0.5 + i, score=0.5 + i)
            tel.step_completed(step=i, tokens=1000 + i, duration_s=1.0 + i)
            i += 1
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert tel.pending > 3000 and held <= budget * 1.1, f"{held} bytes held for a {budget}-byte bound"
