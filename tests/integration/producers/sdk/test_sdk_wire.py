"""What the SDK puts on the wire, read back from the real broker with the codec.

Each test publishes under its own topic prefix, with a partition count no broker defaults to,
and never creates the topics itself: the SDK must.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from rlpulse.producers import TrainingTelemetry
from rlpulse.producers.sdk.sender import SenderConfig
from rlpulse.base.settings import Settings
from rlpulse.schemas.codec import Codec, record_count
from rlpulse.schemas.topics import partition_counts_async, read_topic

pytestmark = pytest.mark.integration
PARTITIONS = 3


@pytest.fixture
def wire_settings(backend: dict[str, str]) -> Settings:
    return Settings.load(env={"RLPULSE_TOPIC_PREFIX": f"wire{uuid.uuid4().hex[:10]}",
                              "RLPULSE_KAFKA_BOOTSTRAP": backend["kafka_bootstrap"],
                              "RLPULSE_PARTITIONS": str(PARTITIONS), "RLPULSE_HEARTBEAT_INTERVAL": "1h"})


def read(settings: Settings, short: str) -> list[Any]:
    messages = asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic(short)))
    return sorted(messages, key=lambda m: (m.partition, m.offset))


def records_of(messages: list[Any]) -> list[dict[str, Any]]:
    codec = Codec()
    return [r for m in messages for r in codec.decode(m.value).records]


def test_containers_of_one_run_key_with_writer_and_contiguous_sequences(wire_settings: Settings) -> None:
    s = wire_settings
    tel = TrainingTelemetry(project="p", run_id="wire", settings=s, sender_config=SenderConfig(batch_records=400))
    rollouts = 700
    # Queued before the sender starts, so it finds full batches waiting.
    for i in range(rollouts):
        tel.grader(step=i // 100, rollout_id=f"r{i}", term="judge", outcome="ok" if i % 5 else "timeout",
                   duration_s=0.5, score=0.5)
        tel.rollout(step=i // 100, rollout_id=f"r{i}", reward=0.5, term_shares={"judge": 0.5},
                    completion_tokens=100, max_tokens=1024, sample_id=f"p{i // 4}")
        if i % 100 == 99:
            tel.step_completed(step=i // 100, tokens=1000, duration_s=1.0)
    with tel:
        pass  # RUN_START, then RUN_END and a flush
    assert tel.pending == 0 and tel.dropped == 0 and tel.delivered == 2 * rollouts + 7 + 2

    counts = asyncio.run(partition_counts_async(s, ("spans", "steps", "hardware")))
    assert set(counts.values()) == {PARTITIONS}, counts  # created by the SDK, not auto-created with 1

    spans, steps = read(s, "spans"), read(s, "steps")
    for messages in (spans, steps):
        assert {m.key for m in messages} == {b"p/wire"}
        assert len({m.partition for m in messages}) == 1  # every event of the run on one partition
    assert [record_count(m.value) for m in spans] == [400, 400, 400, 200]  # containers of up to batch_records
    span_records, step_records = records_of(spans), records_of(steps)
    assert {r["writer_id"] for r in span_records + step_records} == {tel.writer_id}
    assert [r["writer_sequence"] for r in span_records] == list(range(1, 2 * rollouts + 1))  # publish order
    assert [r["sequence_id"] for r in step_records] == list(range(1, 7 + 2 + 1))
    assert [r["type"] for r in step_records] == ["STEP"] * 7 + ["RUN_START", "RUN_END"]
    assert [r["rollout_id"] for r in span_records[:4]] == ["r0", "r0", "r1", "r1"]
    assert span_records[0]["outcome"] == "timeout" and span_records[1]["term_shares"] == {"judge": 0.5}


def test_a_record_too_large_for_any_message_is_refused_and_the_rest_delivered(wire_settings: Settings) -> None:
    with TrainingTelemetry(project="p", run_id="big", settings=wire_settings) as tel:
        tel.rollout(step=0, rollout_id="before", reward=0.1)
        # 20 attributes of 60,000 characters: each under the 64 KiB value limit, 1.2 MB together
        with pytest.raises(ValueError, match=r"attributes\['blob\d+'\] is \d+ bytes"):
            tel.rollout(step=0, rollout_id="huge", reward=0.1, attributes={f"blob{i}": "x" * 60_000 for i in range(20)})
        tel.rollout(step=0, rollout_id="after", reward=0.2)
        tel.grader(step=0, rollout_id="after", term="judge", outcome="ok", duration_s=0.1)
        assert tel.flush(30) == 0
    records = records_of(read(wire_settings, "spans"))
    assert [(r["rollout_id"], r["writer_sequence"]) for r in records] == [("before", 1), ("after", 2), ("after", 3)]


def test_writers_of_one_run_share_its_partition_and_number_their_own_events(wire_settings: Settings) -> None:
    writers = [TrainingTelemetry(project="p", run_id="multi", settings=wire_settings) for _ in range(2)]
    for tel in writers:
        tel.start()
    for i in range(50):
        for w, tel in enumerate(writers):
            tel.rollout(step=0, rollout_id=f"w{w}-{i}", reward=0.5)
    # The OpenTelemetry exporter publishes through the same queue and sequence.
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(writers[0].span_exporter()))
    with provider.get_tracer("t").start_as_current_span("chat", attributes={"rlpulse.kind": "LLM"}):
        pass
    writers[0].publish_hardware("Placement", "GPU-x", dict(project="p", run_id="multi", attempt=1, time_ns=1,
                                                             role="trainer", rank=0, hw_id="GPU-x"))
    for tel in writers:
        assert tel.close(30) == 0
    spans = read(wire_settings, "spans")
    assert len({m.partition for m in spans}) == 1 and {m.key for m in spans} == {b"p/multi"}
    records = records_of(spans)
    for w, tel in enumerate(writers):
        mine = [r for r in records if r["writer_id"] == tel.writer_id]
        assert [r["writer_sequence"] for r in mine] == list(range(1, 50 + 1 + (w == 0)))
    assert [r["kind"] for r in records if r["writer_id"] == writers[0].writer_id][-1] == "LLM"
    [hardware] = read(wire_settings, "hardware")
    assert hardware.key == b"GPU-x" and records_of([hardware])[0]["hw_id"] == "GPU-x"


def test_an_idle_sender_sleeps_and_one_event_goes_out_after_the_linger(wire_settings: Settings) -> None:
    import time

    with TrainingTelemetry(project="p", run_id="idle", settings=wire_settings) as tel:
        assert tel.flush(30) == 0
        queue = tel.sender.queue
        takes = []
        take = queue.take
        queue.take = lambda limit: takes.append(limit) or take(limit)  # each pass of the sender's loop takes once
        time.sleep(1.0)
        assert takes == []  # asleep, not polling
        started = time.monotonic()
        tel.rollout(step=0, rollout_id="one", reward=0.5)
        while tel.delivered < 2 and time.monotonic() - started < 10:
            time.sleep(0.005)
        assert tel.delivered == 2 and time.monotonic() - started < 2.0  # linger 50 ms, then the broker's ack
        assert len(takes) == 1
