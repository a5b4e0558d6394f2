"""The bounds every reader of a container applies before it decodes a record (raw topics are untrusted input).

Anyone who can reach a raw topic can write any bytes to it, so a container is checked against
one :class:`Limits` by :func:`check_container` before anything is decoded: the sink before it
buffers a message for ClickHouse (``rlpulse.sinks.write.message_checks``), the streams before they decode one
(``rlpulse.streams.inputs``). The same numbers give the same outcome for the same message everywhere: a
message over a bound is refused with a reason naming the bound (the sink dead-letters it, the
streams count it, log it and leave it out of every figure).

Only the framing is read: the header, each block's count and size, the sync markers. Compressed
blocks are inflated by a streaming decompressor with a maximum output, so a deflate bomb is
never inflated beyond the limit (and its output is counted, not kept). A writer schema that lets
a few bytes claim endless values (an array of nulls whose block says 2**62 items:
``rlpulse.schemas.codec.endless``) or that nests deeper than the limit is refused from the header alone.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

import fastavro

from rlpulse.schemas.codec import DecodeError, Header, blocks, endless, read_header
from rlpulse.schemas.compression import refusal

# Container codecs every reader decodes with a bounded decompressor (and ClickHouse's Avro input reads).
CODECS = ("null", "deflate", "snappy")
_CHUNK = 64 * 1024  # compressed bytes fed to the inflater at a time: no copy of a whole bomb's tail per step


@dataclass(frozen=True)
class Limits:
    """What one message may hold. The SDK writes containers of at most 1,000 records in one block
    below the broker's 1 MiB ``message.max.bytes``; a bigger one still arrives through producer
    compression (the broker limits the compressed batch), a topic whose ``max.message.bytes`` was
    raised, or a deflate or snappy container that decompresses far beyond its size on the wire."""

    max_message_records: int = 100_000
    max_message_bytes: int = 16 * 1024 * 1024  # the records' Avro bytes, decompressed
    max_blocks: int = 4096  # blocks in one container (the SDK writes one)
    max_nesting: int = 32  # depth of the writer schema (records, arrays, maps, unions inside each other)

    def describe(self) -> str:
        return (f"{self.max_message_records} records, {self.max_message_bytes} decoded bytes, "
                f"{self.max_blocks} blocks, schema nesting {self.max_nesting}")


@dataclass(frozen=True)
class Checked:
    """A container within the limits: its header, its records and their decoded size."""

    header: Header
    records: int
    decoded_bytes: int


def decoded_size(codec: str, body: memoryview | bytes, budget: int) -> int:
    """Bytes of a block's records once decompressed; counting stops a little past ``budget``, so a
    bomb is never inflated whole (nor kept: only its length is counted)."""
    if codec == "null":
        return len(body)
    if codec == "snappy":  # the block opens with its uncompressed length, a varint (then data, then a CRC)
        n = 0
        for i, b in enumerate(bytes(body[:5])):
            n |= (b & 0x7F) << (7 * i)
            if b < 0x80:
                return n
        raise DecodeError("corrupt snappy block: no length")
    if codec != "deflate":
        raise DecodeError(f"Avro container codec {codec!r} is not one of {', '.join(CODECS)}")
    inflate = zlib.decompressobj(-15)  # Avro's deflate is raw deflate, no zlib header
    size = 0
    try:
        for start in range(0, len(body), _CHUNK):
            data = bytes(body[start:start + _CHUNK])
            while data and size <= budget:
                size += len(inflate.decompress(data, min(1 << 20, budget - size + 1)))
                data = inflate.unconsumed_tail
            if size > budget:
                break
    except zlib.error as exc:
        raise DecodeError(f"corrupt deflate block: {exc}") from None
    return size


def _depth(schema: Any, level: int = 0, limit: int = 64) -> int:
    """Nesting depth of a writer schema as JSON (stops counting past ``limit``)."""
    if level > limit:
        return level
    if isinstance(schema, list):
        return max((_depth(s, level + 1, limit) for s in schema), default=level)
    if isinstance(schema, dict):
        inner = [f.get("type") for f in schema.get("fields", ()) if isinstance(f, dict)]
        inner += [schema[k] for k in ("items", "values") if k in schema]
        if isinstance(schema.get("type"), (dict, list)):
            inner.append(schema["type"])
        return max((_depth(s, level + 1, limit) for s in inner), default=level)
    return level


_REFUSALS: dict[tuple[bytes, int], str | None] = {}  # (writer schema bytes, nesting limit) -> why refused, or None


def schema_refusal(schema_json: bytes, limits: Limits) -> str | None:
    """Why a header's writer schema is refused before any block is read, or None."""
    key = (schema_json, limits.max_nesting)
    if key in _REFUSALS:
        return _REFUSALS[key]
    try:
        raw = json.loads(schema_json)
        depth = _depth(raw, limit=limits.max_nesting)
        if depth > limits.max_nesting:
            why: str | None = f"writer schema nests deeper than the sink's limit of {limits.max_nesting} levels"
        else:
            parsed = fastavro.parse_schema(raw, _write_hint=False)
            reason = endless(parsed)
            why = f"writer schema refused: {reason} (a block could claim endless items)" if reason else None
    except RecursionError:
        why = f"writer schema nests deeper than the sink's limit of {limits.max_nesting} levels"
    except Exception as exc:  # noqa: BLE001 - any unparsable schema is a refusal with its reason
        why = f"unreadable writer schema in the container header: {type(exc).__name__}: {str(exc)[:200]}"
    if len(_REFUSALS) > 1000:  # writer schemas are few; bogus headers must not grow it
        _REFUSALS.clear()
    _REFUSALS[key] = why
    return why


def check_container(data: bytes | None, limits: Limits) -> Checked:
    """The container's header, records and decoded size; DecodeError naming the bound it breaks.

    Stops at the first bound broken: a block claiming 2**62 records is refused at that block, a
    deflate bomb after at most ``max_message_bytes`` of output.
    """
    if data is None:  # a tombstone
        raise DecodeError("message too short for an Avro container (0 bytes)")
    why = refusal(data)  # the stand-in for a compressed batch refused before it was inflated (rlpulse.schemas.compression)
    if why:
        raise DecodeError(why)
    header = read_header(data)  # refuses short values with their size
    if header.codec not in CODECS:
        raise DecodeError(f"Avro container codec {header.codec!r} is not one of {', '.join(CODECS)}")
    why = schema_refusal(header.schema_json, limits)
    if why:
        raise DecodeError(why)
    records = size = n_blocks = 0
    for count, body in blocks(data, header):  # walks every sync marker
        n_blocks += 1
        if n_blocks > limits.max_blocks:
            raise DecodeError(f"container holds over {limits.max_blocks} blocks, over the sink's limit of "
                              f"{limits.max_blocks} blocks a message")
        records += count
        if records > limits.max_message_records:
            raise DecodeError(f"container holds {records} records, over the sink's limit of "
                              f"{limits.max_message_records} a message")
        size += decoded_size(header.codec, body, limits.max_message_bytes - size)
        if size > limits.max_message_bytes:
            raise DecodeError(f"container's records take over {limits.max_message_bytes} bytes decoded "
                              f"({len(data)} on the wire), over the sink's limit of {limits.max_message_bytes} a message")
    return Checked(header=header, records=records, decoded_bytes=size)
