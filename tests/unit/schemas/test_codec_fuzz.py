"""Fuzzing the container decoder: whatever the bytes, ``Codec.decode`` returns records or raises
DecodeError, never another exception and never a crash of the C extension, and it never returns
fewer records than the blocks it accepted say they hold. Both the C block decoder and the
fastavro path (another writer's schema, a compressed block, no extension built) are fuzzed."""

from __future__ import annotations

import contextlib
import copy
import io
import os

import fastavro
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlpulse.schemas.codec as codec_module
from rlpulse.schemas.codec import MAGIC, Codec, DecodeError, load_schemas, record_count
from rlpulse.streams.runs import SPAN_FIELDS
from tests.conftest import unavailable

PATHS = ["c-extension", "fastavro"]
# RLPULSE_FUZZ_EXAMPLES: more examples for a longer search than the test suite runs
FUZZ = settings(max_examples=int(os.environ.get("RLPULSE_FUZZ_EXAMPLES", "300")), deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])  # no example database left in the checkout


@contextlib.contextmanager
def path(name: str):
    """Decode with the C extension (where it is built) or, as without it, with fastavro alone."""
    saved = codec_module.compile_schema
    if name == "c-extension" and saved is None:
        unavailable("the C extension rlpulse.schemas._blockdecode is not built (pip install -e . builds it)")
    codec_module.compile_schema = saved if name == "c-extension" else None
    try:
        yield
    finally:
        codec_module.compile_schema = saved


def span(i: int) -> dict:
    return dict(project="p", run_id="r", attempt=1, time_ns=i, trace_id=b"t" * 16, span_id=os.urandom(8),
                parent_span_id=None if i % 2 else b"p" * 8, name="rollout", kind="ROLLOUT", start_time_ns=0,
                end_time_ns=i, status="OK", sequence_id=i + 1, writer_id="w", step=i // 3,
                attributes={"s": "x", "b": True, "l": 2**40, "d": 0.25}, reward=0.5, term_shares={"judge": 0.5},
                completion_tokens=100 + i, max_tokens=1000, clipped=False, sample_id=f"s{i}")


STEP = dict(project="p", run_id="r", attempt=1, time_ns=5, type="HEARTBEAT", trainer="rl", step=3, step_count=4,
            writer_id="w", sequence_id=9)


def newer_step_container(n: int, codec: str) -> bytes:
    """Steps from a newer writer (an extra field, an extra enum symbol), as fastavro writes them."""
    raw = copy.deepcopy(load_schemas()["rlpulse.v1.Step"])
    raw["fields"].append({"name": "extra", "type": ["null", "string"], "default": None})
    buf = io.BytesIO()
    fastavro.writer(buf, fastavro.parse_schema(raw), [dict(STEP, sequence_id=i + 1, extra="x") for i in range(n)],
                    codec=codec, sync_interval=64)  # small blocks: several per container
    return buf.getvalue()


def containers() -> list[bytes]:
    codec = Codec()
    return [codec.encode("Span", [span(i) for i in range(7)]),
            codec.encode("Step", [dict(STEP, sequence_id=i + 1) for i in range(5)]),
            newer_step_container(6, "null"), newer_step_container(6, "deflate")]


VALID = containers()


def check(data: bytes, fields=None) -> None:
    """The property: records or DecodeError; accepted records number what the accepted blocks say."""
    try:
        decoded = Codec().decode(data, fields=fields)
    except DecodeError:
        return
    assert len(decoded.records) == record_count(data)
    assert all(isinstance(r, dict) for r in decoded.records)


@pytest.mark.parametrize("which", PATHS)
@FUZZ
@given(data=st.binary(max_size=2048))
def test_arbitrary_bytes_are_records_or_a_decode_error(which, data):
    with path(which):
        check(data)
        check(MAGIC + data)


EDGES = [2**63 - 1, -2**63, 2**62, 2**31, 2**31 - 1, -1, 0, 1, 2**16, -2**31]


@st.composite
def mutated(draw):
    """A valid container with a few random byte changes, insertions, deletions, and a truncation."""
    data = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(0, 4))):
        op, at = draw(st.sampled_from(["flip", "set", "insert", "delete", "varint"])), draw(st.integers(0, len(data) - 1))
        if op == "varint":  # a length or count at the edges of what a long holds, over as many bytes
            encoded = codec_module._long_bytes(draw(st.sampled_from(EDGES) | st.integers(-2**63, 2**63 - 1)))
            data[at:at + len(encoded)] = encoded  # block sizes stay right: the decoder meets it
        elif op == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif len(data) > 1:
            del data[at:at + draw(st.integers(1, 8))]
    if draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data)))]
    return bytes(data)


@pytest.mark.parametrize("which", PATHS)
@FUZZ
@given(data=mutated())
def test_mutated_and_truncated_containers_are_records_or_a_decode_error(which, data):
    with path(which):
        check(data)
        check(data, fields=SPAN_FIELDS)  # the projection the streams decode spans with


@pytest.mark.parametrize("which", PATHS)
def test_the_unmutated_containers_decode_whole(which):
    with path(which):
        for data in VALID:
            assert len(Codec().decode(data).records) == record_count(data) > 0


@pytest.mark.parametrize("which", PATHS)
def test_a_block_that_says_more_records_than_it_holds_is_an_error_not_a_short_list(which):
    codec = Codec()
    data = codec.encode("Step", [STEP, STEP])
    header_end = len(codec.reader("Step").header)
    assert data[header_end] == 4  # zig-zag 2: the block's record count
    lying = data[:header_end] + bytes([6]) + data[header_end + 1:]  # says 3
    with path(which), pytest.raises(DecodeError):
        Codec().decode(lying)


def test_a_writer_schema_whose_values_can_take_no_bytes_is_refused():
    """An array of nulls costs no bytes per item: its count alone could have the reader build
    values until memory runs out (2**20 here, 2**62 in an attack). Refused by the schema."""
    raw = copy.deepcopy(load_schemas()["rlpulse.v1.Step"])
    raw["fields"].append({"name": "pad", "type": {"type": "array", "items": "null"}, "default": []})
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(raw), dict(STEP, pad=[]))
    record = body.getvalue()[:-1] + codec_module._long_bytes(2**20) + b"\x00"  # the empty array's end, now 2**20 nulls
    sync = b"s" * 16
    data = codec_module._container_header(raw, sync) + codec_module._long_bytes(1) + \
        codec_module._long_bytes(len(record)) + record + sync
    assert len(fastavro.reader(io.BytesIO(data)).__next__()["pad"]) == 2**20  # what a reader without the check builds
    with pytest.raises(DecodeError, match="array of items that take no bytes"):
        Codec().decode(data)


@pytest.mark.parametrize("which", PATHS)
def test_a_block_count_beyond_64_bits_is_a_decode_error(which):
    codec = Codec()
    data = codec.encode("Step", [STEP])
    header_end = len(codec.reader("Step").header)
    huge = b"\xfe" + b"\xff" * 8 + b"\x7f"  # ten bytes, 70 bits, zig-zag positive: no Avro long
    with path(which), pytest.raises(DecodeError, match="beyond 64 bits"):
        Codec().decode(data[:header_end] + huge + data[header_end + 1:])


@pytest.mark.parametrize("which", PATHS)
def test_a_length_near_2_to_the_63_is_a_decode_error_not_a_segfault(which):
    """A string length of 2**63 - 1 overflowed the C decoder's bounds check (p + n): it read
    outside the block and killed the worker, and every restart replayed the message. Run in a
    child process, so a regression fails this test instead of ending the test run."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import rlpulse.schemas.codec as codec_module
        from rlpulse.schemas.codec import Codec, DecodeError, _long_bytes
        if {which!r} == "fastavro":
            codec_module.compile_schema = None
        header = Codec().reader("Step").header
        body = _long_bytes(2**63 - 1) + b"x" * 40  # the project string's length
        data = header + _long_bytes(1) + _long_bytes(len(body)) + body + header[-16:]
        try:
            Codec().decode(data)
        except DecodeError as exc:
            print("DecodeError:", exc)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"the decoder died ({done.returncode}): {done.stderr[-500:]}"
    assert done.stdout.startswith("DecodeError:"), done.stdout + done.stderr
