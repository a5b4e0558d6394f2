"""The compiled block encoder (schemas/_blockencode.pyx) writes fastavro's bytes, or declines.

``Codec.encode`` takes the compiled path for records exactly as their schema says and falls back
to fastavro for anything else, so containers and errors are fastavro's either way. Here every
record type of the catalogue is encoded both ways, from random records that walk its schema
(nulls, missing fields with defaults, non-ASCII text, 64-bit edges, NaN), and records that are
not well-formed must be declined, not written differently.
"""

from __future__ import annotations

import io
import math
import random
import time
from typing import Any

import fastavro
import pytest

from bench.workload import WorkloadConfig, messages
from rlpulse.schemas import codec as codec_module
from rlpulse.schemas.codec import Codec
from tests.conftest import unavailable



@pytest.fixture(autouse=True)
def _built() -> None:
    if codec_module.compile_encoder is None:
        unavailable("the C extension rlpulse.schemas._blockencode is not built (pip install -e . builds it)")

CODEC = Codec()
RECORDS = sorted(name for name in CODEC._readers)  # noqa: SLF001 - every local record type
TEXT = ["", "a", "grader/judge", "é→日本語", "\x00nul", "x" * 300]
LONGS = [0, 1, -1, 63, 64, -65, 2**31 - 1, -(2**31), 2**53 + 1, 2**63 - 1, -(2**63), 1796413539849829453]
DOUBLES = [0.0, -0.0, 0.1 + 0.2, 1e308, -1e-308, math.inf, -math.inf, 3, -7]


def fastavro_body(name: str, records: list[dict[str, Any]]) -> bytes:
    schema = CODEC.reader(name)
    body = io.BytesIO()
    for record in records:
        fastavro.schemaless_writer(body, schema.parsed, record, strict_allow_default=True)
    return body.getvalue()


def compiled_body(name: str, records: list[dict[str, Any]]) -> bytes | None:
    return CODEC._fast_body(name, CODEC.reader(name), records)  # noqa: SLF001 - the path under test


def value(rng: random.Random, schema: Any, named: dict[str, Any]) -> Any:
    """A random value that fits ``schema`` (fastavro-parsed)."""
    if isinstance(schema, list):
        return value(rng, rng.choice(schema), named)
    if isinstance(schema, str):
        if schema in named:
            return value(rng, named[schema], named)
        schema = {"type": schema}
    t = schema["type"]
    if t == "null":
        return None
    if t == "boolean":
        return rng.random() < 0.5
    if t == "int":
        return rng.choice([0, 1, -1, 2**31 - 1, -(2**31), rng.randint(-1000, 1000)])
    if t == "long":
        return rng.choice(LONGS + [rng.randint(-(2**40), 2**40)])
    if t in ("double", "float"):
        return rng.choice(DOUBLES + [rng.uniform(-1e6, 1e6)])
    if t == "string":
        return rng.choice(TEXT)
    if t == "bytes":
        return rng.randbytes(rng.randint(0, 40))
    if t == "fixed":
        named[schema["name"]] = schema
        return rng.randbytes(schema["size"])
    if t == "enum":
        named[schema["name"]] = schema
        return rng.choice(schema["symbols"])
    if t == "map":
        return {rng.choice(TEXT) + str(i): value(rng, schema["values"], named) for i in range(rng.randint(0, 4))}
    if t == "array":
        return [value(rng, schema["items"], named) for _ in range(rng.randint(0, 4))]
    assert t == "record", t
    named[schema["name"]] = schema
    out = {}
    for field in schema["fields"]:
        if "default" in field and rng.random() < 0.2:
            continue  # left to its default
        out[field["name"]] = value(rng, field["type"], named)
    return out


@pytest.mark.parametrize("name", RECORDS)
def test_random_records_encode_to_fastavros_bytes(name: str) -> None:
    rng = random.Random(name)
    parsed = CODEC.reader(name).parsed
    for _ in range(40):
        records = [value(rng, parsed, {}) for _ in range(rng.randint(1, 6))]
        assert compiled_body(name, records) == fastavro_body(name, records)
        decoded = CODEC.decode(CODEC.encode(name, records)).records
        assert len(decoded) == len(records)


def test_the_bench_workload_encodes_to_fastavros_bytes() -> None:
    batch = list(messages(WorkloadConfig(runs=3), time.time_ns()))
    assert {m.record for m in batch} == {"Span", "Step", "EngineSample"}
    for m in batch:
        assert compiled_body(m.record, m.records) == fastavro_body(m.record, m.records)


def _span() -> dict[str, Any]:
    return next(m.records[0] for m in messages(WorkloadConfig(runs=1), time.time_ns()) if m.record == "Span")


@pytest.mark.parametrize("change", [
    pytest.param(lambda r: r.update(surprise=1), id="an extra field"),
    pytest.param(lambda r: r.pop("run_id"), id="a missing field without a default"),
    pytest.param(lambda r: r.update(step="3"), id="text for a long"),
    pytest.param(lambda r: r.update(attempt=True), id="a boolean for an int"),
    pytest.param(lambda r: r.update(sequence_id=2**64), id="a long past 64 bits"),
    pytest.param(lambda r: r.update(kind="NOT_A_KIND"), id="an unknown enum symbol"),
    pytest.param(lambda r: r.update(attributes={1: "x"}), id="a map key that is not text"),
    pytest.param(lambda r: r.update(project=b"p"), id="bytes for a string"),
])
def test_what_is_not_well_formed_is_declined_and_fastavro_decides(change: Any) -> None:
    record = _span()
    change(record)
    assert compiled_body("Span", [record]) is None
    try:
        expected: bytes | str = fastavro_body("Span", [record])
    except Exception as exc:  # noqa: BLE001 - fastavro's verdict, whatever its type
        expected = f"refused: {type(exc).__name__}"
    try:
        got: bytes | str = CODEC.encode("Span", [record])
    except ValueError as exc:
        assert "Span record does not match its schema" in str(exc)
        got = "refused"
    if isinstance(expected, bytes):  # fastavro takes it (it coerces some values): so does encode, with its bytes
        assert isinstance(got, bytes) and expected in got
    else:
        assert got == "refused"


def test_nan_is_written_as_fastavro_writes_it() -> None:
    record = _span()
    record["reward"] = math.nan
    assert compiled_body("Span", [record]) == fastavro_body("Span", [record])


def test_a_bytearray_in_a_union_of_fixed_and_bytes_takes_the_branch_fastavro_takes() -> None:
    """No catalogue record has a fixed type yet; the encoder must still agree with fastavro's
    compiled validator, which takes a bytearray of the right size as the fixed branch."""
    parsed = fastavro.parse_schema({"type": "record", "name": "T", "fields": [
        {"name": "id", "type": [{"type": "fixed", "name": "Id", "size": 4}, "bytes"]}]})
    node = codec_module.compile_encoder(parsed)
    for datum in (bytearray(b"abcd"), b"abcd", bytearray(b"abc"), b"abcdef"):
        body = io.BytesIO()
        fastavro.schemaless_writer(body, parsed, {"id": datum})
        assert codec_module.encode_records(node, [{"id": datum}]) == body.getvalue(), datum
