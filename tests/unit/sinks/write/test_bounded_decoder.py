"""The one bounded container decoder (``rlpulse.schemas.limits``) against hostile containers (anyone
who can write to a raw topic can send them): each is refused quickly, with a reason naming the bound,
by the sink's checks and the streams' decode alike."""

from __future__ import annotations

import io
import json
import logging
import os
import time
import zlib
from types import SimpleNamespace

import fastavro
import pytest

from rlpulse.schemas.catalogue import TABLES
from rlpulse.schemas.codec import Codec, DecodeError, load_schemas
from rlpulse.schemas.limits import Limits, check_container
from rlpulse.sinks.store.avro_sql import Plans
from rlpulse.sinks.write.message_checks import check_message
from rlpulse.streams.inputs import Inputs

SPAN = load_schemas()["rlpulse.v1.Span"]
STEP = load_schemas()["rlpulse.v1.Step"]
CODEC = Codec()


def varint(n: int) -> bytes:
    """An Avro long (zig-zag varint)."""
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n & ~0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def container(schema: dict, blocks: list[tuple[int, bytes]], codec: str = "null") -> bytes:
    """A container with this writer schema and these (record count, block bytes) blocks, as given."""
    sync = os.urandom(16)
    meta = [(b"avro.schema", json.dumps(schema).encode()), (b"avro.codec", codec.encode())]
    out = bytearray(b"Obj\x01" + varint(len(meta)))
    for k, v in meta:
        out += varint(len(k)) + k + varint(len(v)) + v
    out += varint(0) + sync
    for count, body in blocks:
        out += varint(count) + varint(len(body)) + body + sync
    return bytes(out)


def span(seq: int = 1) -> dict:
    return dict(project="p", run_id="r", attempt=1, stage="train", time_ns=seq, trace_id=bytes(16),
                span_id=seq.to_bytes(8, "big"), parent_span_id=None, name="rollout", kind="ROLLOUT", start_time_ns=0,
                end_time_ns=seq, status="OK", status_message="", rollout_id="r1", attempt_id="a1", sequence_id=seq,
                writer_id="w1", step=1, attributes={}, term=None, outcome=None, score=None, judge_input_tokens=None,
                judge_output_tokens=None, reward=0.5, term_shares={}, completion_tokens=1, max_tokens=2,
                clipped=False, sample_id="s")


def record_bytes(schema: dict, record: dict) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), record)
    return buf.getvalue()


def endless_span() -> bytes:
    """A Span writer schema ending in an extra array of null, one block claiming 2**62 items."""
    schema = dict(SPAN, fields=SPAN["fields"] + [{"name": "x", "type": {"type": "array", "items": "null"}, "default": []}])
    body = record_bytes(SPAN, span()) + varint(2 ** 62) + varint(0)  # the array: one block of 2**62 nulls, then its end
    return container(schema, [(1, body)])


def deflate_bomb(decoded: int = 200 * 1024 * 1024) -> bytes:
    """A deflate bomb: a Step container whose one deflate block inflates to ``decoded`` bytes."""
    step = record_bytes(STEP, dict(project="p", run_id="r", attempt=1, stage="x", time_ns=1, type="STEP", trainer="rl",
                                   step=1, step_count=1, tokens=1, duration_s=1.0, throughput=1.0, mfu=None,
                                   dropped_events=0, writer_id="w", sequence_id=1))
    z = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = bytes(1 << 20)
    body = z.compress(step) + b"".join(z.compress(chunk) for _ in range(decoded >> 20)) + z.flush()
    return container(STEP, [(1, body)], codec="deflate")


def many_records(n: int = 500_000) -> bytes:
    """500,000 Span records in one message (one block)."""
    return container(SPAN, [(n, record_bytes(SPAN, span()) * n)])


HOSTILE = {
    "endless": (endless_span, "array of items that take no bytes"),
    "bomb": (deflate_bomb, f"over the sink's limit of {Limits().max_message_bytes} a message"),
    "records": (many_records, f"500000 records, over the sink's limit of {Limits().max_message_records} a message"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_each_hostile_container_is_refused_quickly_with_its_reason(name: str) -> None:
    make, reason = HOSTILE[name]
    data = make()
    started = time.perf_counter()
    with pytest.raises(DecodeError, match=reason):
        check_container(data, Limits())
    assert time.perf_counter() - started < 1.0  # the bomb inflates at most 16 MiB, counted not kept


def test_the_finding_1_message_is_small() -> None:
    assert 2000 < len(endless_span()) < 5000  # the 2.7 KB of the report, and the fields the schema gained since


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_the_sink_and_the_streams_refuse_the_same_message_with_the_same_reason(name: str, caplog) -> None:
    make, reason = HOSTILE[name]
    data = make()
    short = "spans" if name != "bomb" else "steps"
    msg = SimpleNamespace(topic=f"t.{short}", partition=0, offset=7, key=None, value=data)
    plans = Plans({table: [] for table in TABLES.values()})
    with pytest.raises(DecodeError, match=reason):
        check_message(msg, {f"t.{short}": short}, plans, Limits())
    inputs = Inputs(Codec())
    with caplog.at_level(logging.WARNING):
        assert inputs.decode(short, data, f"t.{short}[0]@7") == []
    assert inputs.skipped == 1
    assert any(reason in r.getMessage() or reason.replace("\\", "") in r.getMessage() for r in caplog.records)


def test_blocks_nesting_and_codecs_are_bounded() -> None:
    one = record_bytes(SPAN, span())
    with pytest.raises(DecodeError, match="over the sink's limit of 3 blocks a message"):
        check_container(container(SPAN, [(1, one)] * 4), Limits(max_blocks=3))
    deep: dict = {"type": "record", "name": "rlpulse.v1.Span", "fields": [{"name": "a", "type": "long"}]}
    inner: object = "long"
    for _ in range(40):
        inner = {"type": "array", "items": inner}
    deep["fields"].append({"name": "deep", "type": inner})
    with pytest.raises(DecodeError, match="nests deeper than the sink's limit of 32 levels"):
        check_container(container(deep, []), Limits())
    with pytest.raises(DecodeError, match="codec 'bzip2' is not one of null, deflate, snappy"):
        check_container(container(SPAN, [(1, one)], codec="bzip2"), Limits())


def test_a_good_container_passes_with_its_counts_and_decodes() -> None:
    data = CODEC.encode("Span", [span(i) for i in range(1, 11)])
    checked = check_container(data, Limits())
    assert checked.records == 10 and checked.decoded_bytes == 10 * len(record_bytes(SPAN, span()))
    assert len(Inputs(CODEC).decode("spans", data, "t.spans[0]@0")) == 10
    deflated = io.BytesIO()
    fastavro.writer(deflated, fastavro.parse_schema(SPAN), [span(i) for i in range(1, 4)], codec="deflate")
    assert check_container(deflated.getvalue(), Limits()).records == 3


def test_a_dead_letter_too_big_for_the_broker_is_kept_truncated_with_its_size_and_digest() -> None:
    import hashlib

    from rlpulse.sinks.write.dlq import MAX_LETTER_BYTES, ORIGINAL_SHA256, ORIGINAL_SIZE, TRUNCATED, build_letter

    value = os.urandom(1024) * (20 * 1024)  # 20 MiB
    letter = build_letter(SimpleNamespace(topic="t.steps", partition=1, offset=9, key=b"p/r", value=value), "too big")
    headers = dict(letter.headers)
    assert len(letter.value) + len(letter.key) == MAX_LETTER_BYTES and value.startswith(letter.value)
    assert headers[ORIGINAL_SIZE] == str(len(value)).encode() and headers[TRUNCATED] == b"value"
    assert headers[ORIGINAL_SHA256] == hashlib.sha256(value).hexdigest().encode()
    small = build_letter(SimpleNamespace(topic="t.steps", partition=1, offset=9, key=b"p/r", value=b"abc"), "bad")
    assert small.value == b"abc" and ORIGINAL_SIZE not in dict(small.headers)


def test_an_insert_past_its_limit_dead_letters_only_the_slow_message_and_close_never_waits_on_it() -> None:
    """The sink's writer (``rlpulse.sinks.write.writer``) with a backend that hangs on one message and
    ignores being stopped for 0.6 s, over an insert limit of 0.2 s: the checkpoint's messages go
    one at a time, each waiting while the given-up insert still runs; only the slow one is
    dead-lettered. Then a backend stuck for good: close() leaves it behind at once."""
    import asyncio
    import threading

    from rlpulse.schemas.codec import read_header
    from rlpulse.sinks.write.writer import Backoff, Entry, Inserter, InsertTimeout, TableWriter

    release = threading.Event()
    hang = {"s": 0.6}
    sent: list[bytes] = []

    class Stuck(Inserter):
        def _send(self, plan, data, dedup_token) -> None:  # noqa: ANN001 - the base class's signature
            if b"slow-one" in data:
                release.wait(hang["s"])  # deaf to the stop, as chDB skipping 2**62 items was
                raise RuntimeError("Code: 159. TIMEOUT_EXCEEDED at last")
            sent.append(data)

    class OnePlan:
        def plan(self, *args: object) -> None:
            return None

    inserter = Stuck(store=None, limit_s=0.2)  # type: ignore[arg-type]
    inserter.STOP_GRACE_S = 0.1
    letters: list[tuple[int, str]] = []

    async def dead_letter(msg: object, reason: str) -> None:
        letters.append((msg.offset, reason))  # type: ignore[attr-defined]

    def entry(offset: int, name: str) -> Entry:
        value = CODEC.encode("Span", [dict(span(offset + 1), name=name)])
        return Entry(SimpleNamespace(topic="t.spans", partition=0, offset=offset, key=None, value=value),
                     read_header(value), 1)

    writer = TableWriter("spans", inserter, OnePlan(), dead_letter, Backoff(first=0.05, cap=0.1))  # type: ignore[arg-type]
    started = time.monotonic()
    asyncio.run(writer.write([entry(0, "ok"), entry(1, "slow-one"), entry(2, "ok")]))
    assert [offset for offset, _ in letters] == [1]
    assert "spans insert stopped: insert ran past its limit of 0.2s" in letters[0][1]
    assert writer.rows == 2 and len(sent) == 2 and time.monotonic() - started < 5

    hang["s"] = 30  # stuck for good
    with pytest.raises(InsertTimeout):
        asyncio.run(inserter.run(None, entry(3, "slow-one").msg.value, "t"))  # type: ignore[arg-type]
    closing = time.monotonic()
    assert inserter.close(wait_s=0.2) is False  # left behind: a stop never waits on it
    assert time.monotonic() - closing < 1
    release.set()
    for thread in threading.enumerate():  # the threads left behind end now: none may outlive the test
        if thread.name == "rlpulse-insert":
            thread.join(5)


# -- structured fuzzing: hostile framing against the bounded check, the sink's and the streams' ---------
from hypothesis import HealthCheck, given, settings  # noqa: E402 - the fuzzing section's own imports
from hypothesis import strategies as st  # noqa: E402

FUZZ = settings(max_examples=int(os.environ.get("RLPULSE_FUZZ_EXAMPLES", "200")), deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
SMALL = Limits(max_message_records=50, max_message_bytes=64 * 1024, max_blocks=8)


@st.composite
def hostile_containers(draw: st.DrawFn) -> bytes:
    """A Span container whose blocks claim any count and hold any bytes, raw or deflated, under the
    reader's schema or one with an extra array (of nulls: endless; of longs: bounded by its bytes)."""
    items = draw(st.sampled_from(["null", "long"]))
    schema = draw(st.sampled_from([SPAN, dict(SPAN, fields=SPAN["fields"] + [
        {"name": "x", "type": {"type": "array", "items": items}, "default": []}])]))
    codec = draw(st.sampled_from(["null", "deflate"]))
    blocks = []
    for _ in range(draw(st.integers(0, 10))):
        count = draw(st.one_of(st.integers(0, 100), st.just(2 ** 62), st.integers(0, 2 ** 63 - 1)))
        body = draw(st.one_of(st.binary(max_size=200), st.just(record_bytes(SPAN, span())),
                              st.just(bytes(draw(st.integers(0, 200_000))))))
        if codec == "deflate":
            z = zlib.compressobj(9, zlib.DEFLATED, -15)
            body = z.compress(body) + z.flush()
        blocks.append((count, body))
    data = container(schema, blocks, codec)
    cut = draw(st.one_of(st.none(), st.integers(0, len(data))))
    return data if cut is None else data[:cut]


@FUZZ
@given(data=hostile_containers())
def test_fuzzed_containers_are_checked_within_bounds_or_refused_with_a_reason(data: bytes) -> None:
    started = time.perf_counter()
    msg = SimpleNamespace(topic="t.spans", partition=0, offset=7, key=None, value=data)
    plans = Plans({table: [] for table in TABLES.values()})
    try:
        checked = check_container(data, SMALL)
    except DecodeError as exc:
        assert str(exc)
        with pytest.raises(DecodeError, match=".+"):  # the sink's checks refuse it too, with a reason
            check_message(msg, {"t.spans": "spans"}, plans, SMALL)
    else:
        assert checked.records <= SMALL.max_message_records and checked.decoded_bytes <= SMALL.max_message_bytes
        records = Inputs(CODEC, SMALL).decode("spans", data, "t.spans[0]@0")  # what passes decodes, or is skipped
        assert len(records) <= checked.records
        try:  # the sink plans it for insertion, or names why not (its schema does not resolve)
            check_message(msg, {"t.spans": "spans"}, plans, SMALL)
        except DecodeError as exc:
            assert "does not resolve" in str(exc) or "no value" in str(exc), exc
    assert time.perf_counter() - started < 2.0  # a bound on hangs, not a speed figure


@pytest.mark.parametrize("codec", ["null", "deflate"])
def test_bytes_after_a_blocks_records_are_ignored_by_the_sink_and_both_streams_paths_alike(codec: str) -> None:
    """A block holding more than its count says: the sink's check passes it (ClickHouse inserts the
    count's records) and the streams decode the same records, on the C path (null codec) and fastavro's
    (deflate): never rows in the raw tables that no figure counts."""
    body = record_bytes(SPAN, span(1)) + record_bytes(SPAN, span(2)) + b"\x00" * 7
    if codec == "deflate":
        z = zlib.compressobj(9, zlib.DEFLATED, -15)
        body = z.compress(body) + z.flush()
    data = container(SPAN, [(1, body)], codec)
    msg = SimpleNamespace(topic="t.spans", partition=0, offset=7, key=None, value=data)
    plans = Plans({"spans": {"project": "String", "run_id": "String", "sequence_id": "Int64"}})
    table, entry = check_message(msg, {"t.spans": "spans"}, plans, Limits())
    assert (table, entry.records) == ("spans", 1)
    inputs = Inputs(Codec())
    assert [r["sequence_id"] for r in inputs.decode("spans", data, "t.spans[0]@7")] == [1]
    assert inputs.skipped == 0
