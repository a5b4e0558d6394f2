"""The ingest's publish order and containers: spans and steps numbered by their OTLP message's Kafka
position (a replay repeats the numbers), other records untouched; containers within the bound."""

from __future__ import annotations

from rlpulse.producers.otlp.identity import Out
from rlpulse.producers.otlp.ingest import containers, number
from rlpulse.schemas.codec import Codec


def step(writer: str, n: int) -> dict:
    return dict(project="p", run_id="r", attempt=1, stage="", time_ns=n, type="HEARTBEAT", trainer="rl", step=n,
                step_count=n, tokens=0, duration_s=0.0, throughput=0.0, mfu=None, dropped_events=0, writer_id=writer,
                sequence_id=0, spans_sent=0, metrics={}, status=None)


def test_a_span_gets_its_writer_sequence() -> None:
    span = Out("spans", "p/r", "Span", {"writer_id": "otlp/a", "writer_sequence": 1, "sequence_id": 77})
    number([span], partition=0, offset=5)
    assert (span.record["writer_sequence"], span.record["sequence_id"], span.record["writer_id"]) == (6 << 16, 77, "otlp/a@0")


def test_spans_and_steps_are_numbered_by_kafka_position_and_a_replay_repeats_them() -> None:
    outs = [Out("steps", "p/r", "Step", step("otlp/job-1", 0)), Out("hardware", "gpu", "Placement", {"x": 1}),
            Out("steps", "p/r", "Step", step("job-2", 1))]
    number(outs, partition=3, offset=41)
    assert [o.record.get("sequence_id") for o in outs] == [42 << 16, None, (42 << 16) | 1]
    assert [o.record.get("writer_id") for o in outs] == ["otlp/job-1@3", None, "otlp/job-2@3"]
    again = [Out("steps", "p/r", "Step", step("otlp/job-1", 0))]
    number(again, partition=3, offset=41)
    assert again[0].record["sequence_id"] == outs[0].record["sequence_id"]
    later = [Out("steps", "p/r", "Step", step("otlp/job-1", 0))]
    number(later, partition=3, offset=42)
    assert later[0].record["sequence_id"] > outs[2].record["sequence_id"]


def test_consecutive_records_share_a_container_within_the_bound() -> None:
    codec = Codec()
    outs = [Out("steps", "p/r", "Step", step("otlp/w", n)) for n in range(10)]
    outs.insert(5, Out("steps", "p/q", "Step", step("otlp/w", 99)))
    messages = containers(codec, outs)
    assert [(t, k) for t, k, _ in messages] == [("steps", b"p/r"), ("steps", b"p/q"), ("steps", b"p/r")]
    assert [len(codec.decode(v).records) for _, _, v in messages] == [5, 1, 5]
    bound = len(codec.encode("Step", [o.record for o in outs[:2]]))  # two records fit, three do not
    small = containers(codec, outs[:5], max_bytes=bound)  # halved until each fits
    assert [len(codec.decode(v).records) for _, _, v in small] == [2, 1, 2]
    assert all(len(v) <= bound for _, _, v in small)
