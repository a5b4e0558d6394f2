"""The container codec: one Avro Object Container File per message, read by more than one implementation."""

from __future__ import annotations

import io
import json
import os

import fastavro
import pytest

import rlpulse.schemas.codec as codec_module
from rlpulse.schemas.codec import Codec, DecodeError, concat, load_schemas, read_header, record_count

STEP = dict(project="p", run_id="r", attempt=1, time_ns=5, type="STEP", trainer="rl", step=3, step_count=4,
            writer_id="w", sequence_id=9)


def span(i: int) -> dict:
    return dict(project="p", run_id="r", attempt=1, time_ns=i, trace_id=b"t" * 16, span_id=os.urandom(8),
                parent_span_id=None if i % 2 else b"p" * 8, name="grader judge", kind="GRADER", start_time_ns=0,
                end_time_ns=i, status="ERROR", status_message="timeout", sequence_id=i, writer_id="w", step=i // 10,
                attributes={"s": "x", "b": True, "l": 2**40, "d": 0.25}, term="judge", outcome="timeout",
                score=0.0, term_shares={"judge": 0.5})


def test_a_message_is_a_container_holding_its_writer_schema_and_many_records():
    data = Codec().encode("Span", [span(i) for i in range(50)])
    header = read_header(data)
    assert data[:4] == b"Obj\x01" and header.name == "rlpulse.v1.Span" and header.codec == "null"
    assert json.loads(header.schema_json) == load_schemas()["rlpulse.v1.Span"]  # the .avsc as it is, defaults and docs too
    assert record_count(data) == 50
    # fastavro reads it with no registry, from the header alone
    assert [r["sequence_id"] for r in fastavro.reader(io.BytesIO(data))] == list(range(50))


def test_the_fast_block_decoder_equals_fastavro_for_every_record_type():
    codec = Codec()
    data = codec.encode("Span", [span(i) for i in range(20)])
    assert codec.decode(data).records == list(fastavro.reader(io.BytesIO(data)))
    wanted = frozenset({"kind", "term", "sequence_id"})
    assert codec.decode(data, fields=wanted).records[3] == {"kind": "GRADER", "term": "judge", "sequence_id": 3}
    step = codec.encode("Step", [STEP])
    assert codec.decode(step).records == list(fastavro.reader(io.BytesIO(step)))


def test_without_the_extension_fastavro_reads_the_same(monkeypatch):
    data = Codec().encode("Span", [span(i) for i in range(5)])
    fast = Codec().decode(data).records
    monkeypatch.setattr(codec_module, "compile_schema", None)  # as where the C extension was not built
    assert Codec().decode(data).records == fast


def test_an_older_writer_resolves_into_the_reader_schema_with_defaults():
    raw = load_schemas()["rlpulse.v1.Step"]
    old = dict(raw, fields=[f for f in raw["fields"] if f["name"] not in ("writer_id", "sequence_id")])
    buf = io.BytesIO()
    fastavro.writer(buf, fastavro.parse_schema(old), [{k: v for k, v in STEP.items() if k not in ("writer_id", "sequence_id")}])
    [record] = Codec().decode(buf.getvalue()).records
    assert (record["writer_id"], record["sequence_id"], record["step_count"]) == ("", 0, 4)


def test_a_newer_writers_enum_symbol_reads_as_the_default():
    raw = load_schemas()["rlpulse.v1.Step"]
    fields = [dict(f, type=dict(f["type"], symbols=f["type"]["symbols"] + ["PAUSE"])) if f["name"] == "type" else f
              for f in raw["fields"]]
    buf = io.BytesIO()
    fastavro.writer(buf, fastavro.parse_schema(dict(raw, fields=fields)), [dict(STEP, type="PAUSE")])
    [record] = Codec().decode(buf.getvalue()).records
    assert record["type"] == "HEARTBEAT"  # the enum's default symbol


@pytest.mark.parametrize("data, reason", [
    (b"", "too short"),
    (b"\x00\x01 this is not Avro at all, no", "not an Avro container"),
])
def test_undecodable_input_names_the_reason(data, reason):
    with pytest.raises(DecodeError, match=reason):
        Codec().decode(data)


def test_a_truncated_or_corrupt_container_is_a_decode_error():
    data = Codec().encode("Step", [STEP] * 3)
    with pytest.raises(DecodeError, match="runs past the end"):
        Codec().decode(data[:-20])
    with pytest.raises(DecodeError, match="sync marker"):
        Codec().decode(data[:-1] + bytes([data[-1] ^ 1]))


def test_a_record_type_not_expected_on_a_topic_is_refused():
    data = Codec().encode("Step", [STEP])
    with pytest.raises(DecodeError, match="rlpulse.v1.Step is not one of rlpulse.v1.Span"):
        Codec().decode(data, expect=("rlpulse.v1.Span",))


def test_encode_refuses_a_record_that_does_not_fit_naming_the_type():
    with pytest.raises(ValueError, match="Step record does not match its schema"):
        Codec().encode("Step", [dict(STEP, type="NAP")])
    with pytest.raises(ValueError, match="no schema named 'Nope'"):
        Codec().encode("Nope", [{}])


def test_concat_joins_containers_without_decoding():
    codec = Codec()
    parts = [codec.encode("Step", [dict(STEP, sequence_id=i)] * 2) for i in range(3)]
    joined = concat(parts)
    assert record_count(joined) == 6
    assert [r["sequence_id"] for r in codec.decode(joined).records] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="one writer schema"):
        concat([parts[0], codec.encode("Span", [span(1)])])


def test_every_enum_has_a_default_symbol():
    for name, raw in load_schemas().items():
        for field in raw["fields"]:
            t = field["type"]
            if isinstance(t, dict) and t.get("type") == "enum":
                assert t.get("default") in t["symbols"], f"{name}.{field['name']} has no default symbol"


@pytest.mark.full
def test_a_string_like_the_one_before_reads_as_its_own_value() -> None:
    # The fast decoder hands a field the str of the record before when the bytes are the same:
    # values of equal length that differ, longer than the kept 64 bytes, empty, or after a block
    # boundary must still read as they were written.
    values = ["judge", "judgf", "judge", "", "x" * 64, "x" * 63 + "y", "é" * 40, "é" * 40, "z" * 100, "z" * 99 + "w"]
    records = [{**span(i), "run_id": v, "writer_id": v[::-1], "term": v or None} for i, v in enumerate(values)]
    codec = Codec()
    for data in (codec.encode("Span", records), concat([codec.encode("Span", [r]) for r in records])):
        got = codec.decode(data, fields=frozenset({"run_id", "writer_id", "term"})).records
        assert [(r["run_id"], r["writer_id"], r["term"]) for r in got] == [
            (v, v[::-1], v or None) for v in values]
    twice = {**records[0], "run_id": "RUN-ID-1"}
    bad = bytearray(codec.encode("Span", [twice, twice]))
    bad[bad.rindex(b"RUN-ID-1")] = 0xFF  # the second record's run_id: the first's length, not valid UTF-8
    with pytest.raises(DecodeError, match="corrupt Span container.*utf-8"):
        codec.decode(bytes(bad), fields=frozenset({"run_id"}))


@pytest.mark.full
def test_a_header_seen_before_reads_the_same_with_its_own_sync_marker(monkeypatch):
    monkeypatch.setattr(codec_module, "_PREFIXES", [])
    codec = Codec()
    first = codec.encode("Span", [span(1)])
    a = read_header(first)  # parsed, and its metadata bytes kept
    second = codec.encode("Span", [span(2)]).replace(a.sync, b"S" * 16)  # another writer: its own sync marker
    assert len(codec_module._PREFIXES) == 1
    b = read_header(second)  # known: only the sync marker read
    monkeypatch.setattr(codec_module, "_PREFIXES", [])
    assert b == read_header(second)  # what a full parse says
    assert b.sync == second[b.end - 16:b.end] and b.sync != a.sync
    assert (b.schema_json, b.codec, b.name, b.end) == (a.schema_json, a.codec, a.name, a.end)
    # a known header cut inside its sync marker is still refused, and a different schema parsed on its own
    with pytest.raises(DecodeError, match="truncated Avro container header"):
        read_header(second[:b.end - 1])
    assert read_header(codec.encode("Step", [STEP])).name == "rlpulse.v1.Step"
    assert len(codec_module._PREFIXES) == 2


@pytest.mark.full
def test_a_header_over_64_kib_is_parsed_each_time_and_never_kept(monkeypatch):
    monkeypatch.setattr(codec_module, "_PREFIXES", [])
    schema = dict(load_schemas()["rlpulse.v1.Step"], doc="x" * 70_000)
    buf = io.BytesIO()
    fastavro.writer(buf, fastavro.parse_schema(schema), [STEP])
    assert read_header(buf.getvalue()).name == "rlpulse.v1.Step"
    assert codec_module._PREFIXES == []
