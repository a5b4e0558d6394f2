"""The wire format as another Avro implementation sees it: Apache avro reads a spans message."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import avro.datafile
import avro.io
import avro.schema
import pytest

from rlpulse.producers import TrainingTelemetry
from rlpulse.schemas.topics import read_topic

pytestmark = pytest.mark.integration

SPAN_AVSC = Path(__file__).resolve().parents[4] / "schemas" / "span.avsc"


def test_apache_avro_decodes_a_spans_message_from_the_topic_with_span_avsc_as_reader(settings) -> None:
    with TrainingTelemetry(project="wire", run_id="w1", settings=settings) as tel:
        for i in range(5):
            tel.rollout(step=0, rollout_id=f"r{i}", reward=0.25 * i, term_shares={"judge": 0.1}, completion_tokens=10,
                        max_tokens=20, sample_id="s0", attributes={"model": "m", "temperature": 0.7, "n": 3, "ok": True})
        tel.grader(step=0, rollout_id="r0", term="judge", outcome="timeout", duration_s=2.0)
        assert tel.flush(30) == 0
    messages = asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic("spans")))
    assert messages and all(m.key == b"wire/w1" for m in messages)
    reader_schema = avro.schema.parse(SPAN_AVSC.read_text())
    records = []
    for message in messages:
        with avro.datafile.DataFileReader(io.BytesIO(message.value), avro.io.DatumReader(readers_schema=reader_schema)) as r:
            records += list(r)
    assert [r["rollout_id"] for r in records if r["kind"] == "ROLLOUT"] == [f"r{i}" for i in range(5)]
    rollout = next(r for r in records if r["kind"] == "ROLLOUT")
    assert rollout["attributes"] == {"model": "m", "temperature": 0.7, "n": 3, "ok": True}
    assert (rollout["project"], rollout["run_id"], rollout["sample_id"], rollout["reward"]) == ("wire", "w1", "s0", 0.0)
    [grader] = [r for r in records if r["kind"] == "GRADER"]
    assert (grader["term"], grader["outcome"], grader["status"]) == ("judge", "timeout", "ERROR")
    seqs = [r["writer_sequence"] for r in records]  # publish order; sequence_id is start order, unique too
    assert len({r["sequence_id"] for r in records}) == len(records)
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) and len({r["writer_id"] for r in records}) == 1
