import json

import pytest

from schemas.codec import MAGIC, Codec, DecodeError, UnknownSchemaError

STEP = dict(project="p", run_id="r1", attempt=1, time_ns=123, type="STEP", trainer="rl", step=3, step_count=4)


def test_single_object_header_and_round_trip():
    codec = Codec()
    data = codec.encode("Step", STEP)
    assert data[:2] == MAGIC
    assert data[2:10] == codec.fingerprint("Step")
    decoded = codec.decode(data)
    assert decoded.name == "rlpulse.v1.Step"
    assert decoded.record["step_count"] == 4 and decoded.record["mfu"] is None and decoded.record["stage"] == ""


def test_fingerprint_is_crc64_avro_little_endian():
    # Avro spec: CRC-64-AVRO of the canonical form "string" is 0x8f014872634503c7 (-8142146995180207161).
    codec = Codec()
    fp = codec.add_schema('"string"')
    assert fp == (0x8F014872634503C7).to_bytes(8, "little")


def test_reader_resolves_an_older_writer_schema_with_defaults():
    codec = Codec()
    old = json.loads(codec.canonical("Step"))
    old["fields"] = [f for f in old["fields"] if f["name"] not in ("dropped_events", "mfu")]
    old_writer = Codec.__new__(Codec)
    old_writer.__init__()  # a second codec, taught the older schema as its writer
    fp = old_writer.add_schema(json.dumps(old))
    import fastavro, io
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(old), {k: v for k, v in dict(STEP, stage="", tokens=0, duration_s=0.0, throughput=0.0).items()})
    data = MAGIC + fp + body.getvalue()
    with pytest.raises(UnknownSchemaError):
        codec.decode(data)
    codec.add_schema(json.dumps(old))
    record = codec.decode(data).record
    assert record["dropped_events"] == 0 and record["mfu"] is None and record["step_count"] == 4


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "too short"),
        (b"\x00\x01" + b"\x00" * 12, "not Avro single-object"),
        (MAGIC + b"\x01" * 8 + b"x", "unknown writer schema"),
    ],
)
def test_undecodable_input_names_the_reason(data, reason):
    with pytest.raises(DecodeError, match=reason):
        Codec().decode(data)


def test_corrupt_body_and_trailing_bytes():
    codec = Codec()
    data = codec.encode("Step", STEP)
    with pytest.raises(DecodeError, match="corrupt Step body"):
        codec.decode(data[:12])
    with pytest.raises(DecodeError, match="trailing bytes"):
        codec.decode(data + b"\x00\x00")


def test_encode_rejects_a_record_that_does_not_fit():
    with pytest.raises(ValueError, match="Step record does not match its schema"):
        Codec().encode("Step", dict(STEP, type="NAP"))
    with pytest.raises(ValueError, match="no schema named 'Nope'"):
        Codec().encode("Nope", {})
