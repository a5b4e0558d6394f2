"""Avro Object Container Files: one Kafka message = one container of records of one type.

A container carries its writer schema in its header, so a message decodes on its own with no
registry: Apache avro, fastavro and ClickHouse's ``Avro`` input format all read it. Readers
resolve the writer schema into their own reader schema of the same full name (Avro schema
resolution): a field added with a default reads both ways, and an enum symbol a reader does
not know reads as the enum's default.

Parsed writer schemas are cached by the header's schema bytes. A writer schema equal to the
reader's needs no resolution: its uncompressed blocks are read by the C extension
``rlpulse.schemas._blockdecode`` (about 1.4 µs per Span record against fastavro's 9.5), which can also
skip the fields a caller does not want. Anything else (an older or newer writer, a compressed
block, no extension built) is read by fastavro with full schema resolution.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterable

import fastavro
from fastavro.schema import to_parsing_canonical_form
from rlpulse.base.errors import Error

try:
    from rlpulse.schemas._blockdecode import BlockDecodeError, compile_schema, decode_block
except ImportError:  # the optional extension was not built: fastavro reads everything
    compile_schema = None
try:
    from rlpulse.schemas._blockencode import compile_encoder, encode_records
except ImportError:  # nor this one: fastavro writes everything
    compile_encoder = None

SCHEMA_DIR = Path(__file__).parent
NAMESPACE = "rlpulse.v1"
MAGIC = b"Obj\x01"
SYNC_SIZE = 16


class DecodeError(Error, ValueError):
    """The bytes are not a decodable Avro container of a known record type; the message says why."""


@dataclass(frozen=True)
class Decoded:
    name: str  # full name of the writer's record type, e.g. rlpulse.v1.Span
    records: list[dict[str, Any]]


@dataclass(frozen=True)
class Header:
    """What :func:`read_header` found at the start of a container."""

    schema_json: bytes  # the writer schema exactly as the header carries it
    codec: str
    sync: bytes
    end: int  # offset of the first block
    name: str  # the writer's record full name


@dataclass(frozen=True)
class _Schema:
    name: str
    parsed: Any
    canonical: str
    header: bytes = b""  # a container header carrying this schema (with the codec's sync marker)


def full_name(name: str) -> str:
    return name if "." in name else f"{NAMESPACE}.{name}"


def short_name(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _load(raw: dict[str, Any]) -> _Schema:
    # keeps fastavro's parsed marker: no re-parse on every write; a named record parses to a dict
    parsed: dict[str, Any] = fastavro.parse_schema(raw)  # type: ignore[assignment]
    return _Schema(name=parsed["name"], parsed=parsed, canonical=to_parsing_canonical_form(parsed))


def load_schemas(schema_dir: Path = SCHEMA_DIR) -> dict[str, dict[str, Any]]:
    """Every ``*.avsc`` of ``schema_dir`` as JSON, by record full name (the source of truth)."""
    out = {}
    for path in sorted(schema_dir.glob("*.avsc")):
        try:
            raw = json.loads(path.read_text())
            out[full_name(f"{raw.get('namespace', NAMESPACE)}.{raw['name']}")] = raw
        except Exception as exc:  # a broken .avsc is a packaging bug: say which file
            raise ValueError(f"{path.name}: invalid Avro schema: {exc}") from exc
    return out


# -- reading the container framing without decoding records -----------------------------------
def _read_long(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    """Avro zig-zag varint at ``pos``; returns (value, next position)."""
    shift = result = 0
    while True:
        if pos >= len(data):
            raise DecodeError("truncated Avro container (varint runs past the end)")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            if result >> 64:  # an Avro long has 64 bits; more would overflow the C decoder's count
                raise DecodeError("corrupt Avro container (varint beyond 64 bits)")
            return (result >> 1) ^ -(result & 1), pos
        shift += 7
        if shift > 63:
            raise DecodeError("corrupt Avro container (varint longer than 10 bytes)")


_NAMES: dict[bytes, str] = {}  # header schema bytes -> record full name: parsed once, not per message
# The metadata bytes of headers parsed before (everything up to the sync marker) with what they
# said: a writer's containers repeat them byte for byte and only the sync marker differs, so a
# container starting with the same bytes parses the same. Parsing them took ~19 us a message, some
# 4% of the streams' CPU. Few writer schemas exist; bogus headers are never kept (only a full
# successful parse adds one) and the list is bounded.
_PREFIXES: list[tuple[bytes, bytes, str, str]] = []  # (metadata bytes, schema_json, codec, name)
_PREFIXES_MAX = 32
_PREFIX_MAX_BYTES = 64 * 1024  # our headers are ~4 KB; a bigger one is parsed each time, never kept


def read_header(data: bytes) -> Header:
    """Parse a container's header (magic, metadata, sync marker); raises DecodeError if it is not one."""
    if data is None or len(data) < len(MAGIC) + SYNC_SIZE + 1:
        raise DecodeError(f"message too short for an Avro container ({0 if data is None else len(data)} bytes)")
    if isinstance(data, bytes):
        for prefix, known_schema, known_codec, known_name in _PREFIXES:
            if data.startswith(prefix):
                end = len(prefix) + SYNC_SIZE
                if end <= len(data):  # else the full parse below says it is cut short
                    return Header(schema_json=known_schema, codec=known_codec, sync=data[len(prefix):end], end=end,
                                  name=known_name)
                break
    if data[:4] != MAGIC:
        raise DecodeError(f"not an Avro container: starts with {bytes(data[:4]).hex()}, not 4f626a01 ('Obj' 1)")
    meta: dict[str, bytes] = {}
    pos = 4
    while True:
        count, pos = _read_long(data, pos)
        if count == 0:
            break
        if count < 0:  # a block with its byte size: skip the size
            count = -count
            _, pos = _read_long(data, pos)
        for _ in range(count):
            klen, pos = _read_long(data, pos)
            # a negative length would move pos backwards: the same bytes read for ever
            if klen < 0 or pos + klen > len(data):  # a cut message or a bad length: the bytes cannot tell
                raise DecodeError("truncated or corrupt Avro container header (a metadata key runs past the end)")
            key = bytes(data[pos:pos + klen]).decode("utf-8", "replace")
            pos += klen
            vlen, pos = _read_long(data, pos)
            if vlen < 0 or pos + vlen > len(data):
                raise DecodeError("truncated or corrupt Avro container header (a metadata value runs past the end)")
            meta[key] = bytes(data[pos:pos + vlen])
            pos += vlen
    if pos + SYNC_SIZE > len(data):
        raise DecodeError("truncated Avro container header")
    schema_json = meta.get("avro.schema")
    if not schema_json:
        raise DecodeError("Avro container header has no avro.schema")
    name = _NAMES.get(schema_json)
    if name is None:
        try:
            schema = json.loads(schema_json)
            name = schema["name"]
            if "." not in name:
                name = full_name(f"{schema.get('namespace', NAMESPACE)}.{name}")
        except Exception:
            raise DecodeError("Avro container header's schema is not a named record") from None
        if len(_NAMES) > 1000:  # writer schemas are few; bogus headers must not grow it
            _NAMES.clear()
        _NAMES[schema_json] = name
    # not UTF-8: an unknown codec name that fastavro refuses, never an exception of another kind
    codec = meta.get("avro.codec", b"null").decode("utf-8", "replace")
    if isinstance(data, bytes) and pos <= _PREFIX_MAX_BYTES:  # read before the schema's bounds are checked
        if len(_PREFIXES) >= _PREFIXES_MAX:
            _PREFIXES.clear()
        _PREFIXES.append((data[:pos], schema_json, codec, name))
    return Header(schema_json=schema_json, codec=codec, sync=bytes(data[pos : pos + SYNC_SIZE]), end=pos + SYNC_SIZE, name=name)


def blocks(data: bytes, header: Header) -> Iterable[tuple[int, memoryview]]:
    """The (record count, block bytes) of each block, checking every sync marker."""
    view = memoryview(data)
    pos = header.end
    while pos < len(data):
        count, pos = _read_long(view, pos)
        size, pos = _read_long(view, pos)
        if count < 0 or size < 0 or pos + size + SYNC_SIZE > len(data):
            raise DecodeError(f"corrupt Avro container: block of {size} bytes runs past the end")
        body = view[pos : pos + size]
        pos += size
        if view[pos : pos + SYNC_SIZE] != header.sync:
            raise DecodeError("corrupt Avro container: sync marker mismatch after a block")
        pos += SYNC_SIZE
        yield count, body


def _min_size(schema: Any, named: dict[str, Any], seen: frozenset[str] = frozenset()) -> int:
    """The fewest bytes a value of a (fastavro-parsed) ``schema`` can take: 0 for null or a record of nothing."""
    if isinstance(schema, list):
        return 1  # the branch index
    if isinstance(schema, str):
        if schema in named:
            return 1 if schema in seen else _min_size(named[schema], named, seen | {schema})
        return {"null": 0, "float": 4, "double": 8}.get(schema, 1)
    t = schema["type"]
    if t == "record":
        return sum(_min_size(f["type"], named, seen | {schema["name"]}) for f in schema["fields"])
    if t == "fixed":
        return schema["size"]
    if t in ("enum", "array", "map"):
        return 1  # an index, a block count
    return _min_size(t, named, seen)


def _endless(schema: Any) -> str | None:
    """Why a writer schema could make a few bytes decode into endless values, or None.

    An array whose items take no bytes (nulls, empty records) holds as many as its count says
    at no cost in bytes: a count of 2**62 in a message of a few bytes would have the decoder
    build values until memory runs out. The same for a record type that takes no bytes, in a
    block's record count. Readers decode nothing of such a schema.
    """
    named: dict[str, Any] = {}

    def collect(s: Any) -> None:
        if isinstance(s, list):
            for branch in s:
                collect(branch)
        elif isinstance(s, dict):
            if s.get("type") in ("record", "enum", "fixed") and "name" in s:
                named[s["name"]] = s
            for f in s.get("fields", ()):
                collect(f["type"])
            for key in ("items", "values"):
                if key in s:
                    collect(s[key])

    collect(schema)
    if _min_size(schema, named) == 0:
        return "its records take no bytes"
    stack = [schema]
    while stack:
        s = stack.pop()
        if isinstance(s, list):
            stack += s
        elif isinstance(s, dict):
            if s.get("type") == "array" and _min_size(s["items"], named) == 0:
                return "it has an array of items that take no bytes"
            stack += [f["type"] for f in s.get("fields", ())] + [s[k] for k in ("items", "values") if k in s]
    return None


# Public: ``rlpulse.schemas.limits`` refuses such a writer schema from a container's header, before any block is read.
endless = _endless


def record_count(data: bytes) -> int:
    """Records in a container, from its block headers (no decoding)."""
    header = read_header(data)
    return sum(count for count, _ in blocks(data, header))


def _long_bytes(n: int) -> bytes:
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n & ~0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def concat(messages: list[bytes], headers: list[Header] | None = None) -> bytes:
    """One container holding the records of ``messages``, which share one writer schema and codec.

    Blocks are copied as they are, under the first message's header and sync marker, so this
    costs a memory copy, not a decode (the sink hands the result to ClickHouse in one insert).
    ``headers``, when the caller has already read them, saves reading them again.
    """
    if len(messages) == 1:
        return messages[0]
    headers = headers or [read_header(data) for data in messages]
    first = headers[0]
    out = bytearray(messages[0][: first.end])
    for data, header in zip(messages, headers):
        if header.schema_json != first.schema_json or header.codec != first.codec:
            raise ValueError("concat needs containers with one writer schema and codec")
        for count, body in blocks(data, header):
            out += _long_bytes(count) + _long_bytes(len(body)) + body + first.sync
    return bytes(out)


def _bytes_field(b: bytes) -> bytes:
    return _long_bytes(len(b)) + b


def _container_header(raw: dict[str, Any], sync: bytes) -> bytes:
    """Magic, the metadata map (the writer schema as the .avsc has it, codec null), the sync marker."""
    schema_json = json.dumps(raw, separators=(",", ":")).encode()
    meta = (
        _long_bytes(2)
        + _bytes_field(b"avro.schema")
        + _bytes_field(schema_json)
        + _bytes_field(b"avro.codec")
        + _bytes_field(b"null")
        + _long_bytes(0)
    )
    return MAGIC + meta + sync


class Codec:
    """Encodes records with this process's schemas; decodes containers of any writer schema.

    Writing builds the container from a header made once per schema and one block of
    schemaless-encoded records: fastavro's container writer costs ~23 µs of set-up per call,
    which for the streams' one-record outputs was most of the cost. The producer compresses.
    """

    def __init__(self, schema_dir: Path = SCHEMA_DIR):
        self._sync = os.urandom(SYNC_SIZE)  # one marker per codec: readers only compare it with the header's
        self._readers: dict[str, _Schema] = {}
        for name, raw in load_schemas(schema_dir).items():
            schema = _load(raw)
            self._readers[name] = dataclasses.replace(schema, header=_container_header(raw, self._sync))
        self._writers: dict[bytes, tuple[_Schema, bool]] = {}  # header schema bytes -> (parsed, same as reader)
        self._compiled: dict[tuple[str, frozenset[str] | None], Any] = {}  # (name, fields) -> block decoder tree
        self._encoders: dict[str, Any] = {}  # local schema name -> block encoder tree (None: fastavro writes it)
        self._lock = threading.Lock()

    def reader(self, name: str) -> _Schema:
        try:
            return self._readers[full_name(name)]
        except KeyError:
            raise ValueError(f"no schema named {name!r}; known: {sorted(map(short_name, self._readers))}") from None

    def names(self) -> list[str]:
        return sorted(self._readers)

    def schema(self, name: str) -> Any:
        """The parsed reader schema of ``name`` (fastavro form)."""
        return self.reader(name).parsed

    # -- writing ---------------------------------------------------------------------------
    def encode(self, name: str, records: list[dict[str, Any]]) -> bytes:
        """One container of ``records`` under the local schema ``name``; a record that does not fit raises ValueError."""
        schema = self.reader(name)
        if not records:
            return schema.header
        data = self._fast_body(name, schema, records)
        if data is None:  # not for the fast path: fastavro writes it, and says what is wrong with it
            body = io.BytesIO()
            write, parsed = fastavro.schemaless_writer, schema.parsed
            try:
                for record in records:
                    write(body, parsed, record, strict_allow_default=True)
            except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
                raise ValueError(f"{short_name(schema.name)} record does not match its schema: {exc}") from None
            data = body.getvalue()
        return b"".join((schema.header, _long_bytes(len(records)), _long_bytes(len(data)), data, self._sync))

    def _fast_body(self, name: str, schema: _Schema, records: list[dict[str, Any]]) -> bytes | None:
        """The block body from the compiled encoder (``schemas/_blockencode.pyx``), the same bytes
        fastavro writes; None where that encoder is not built, cannot take the schema, or declines
        a record (any record not exactly as the schema says: fastavro then has the last word)."""
        if compile_encoder is None:
            return None
        if name not in self._encoders:
            try:
                node = compile_encoder(schema.parsed)
            except (ValueError, KeyError):
                node = None
            with self._lock:
                self._encoders[name] = node
        node = self._encoders[name]
        if node is None:
            return None
        try:
            return encode_records(node, records)
        except (ValueError, TypeError, OverflowError, UnicodeError):
            return None

    # -- reading ---------------------------------------------------------------------------
    def _writer(self, header: Header) -> tuple[_Schema, bool]:
        cached = self._writers.get(header.schema_json)
        if cached is None:
            try:
                writer = _load(json.loads(header.schema_json))
                endless = _endless(writer.parsed)
            except Exception as exc:
                raise DecodeError(f"unreadable writer schema in the container header: {exc}") from None
            if endless:
                raise DecodeError(f"writer schema {writer.name} refused: {endless}")
            reader = self._readers.get(writer.name)
            cached = (writer, reader is not None and reader.canonical == writer.canonical)
            with self._lock:
                if len(self._writers) > 1000:  # bounded: writer schemas are few; bogus headers must not grow it
                    self._writers.clear()
                self._writers[header.schema_json] = cached
        return cached

    def decode(self, data: bytes, expect: tuple[str, ...] | None = None, fields: frozenset[str] | None = None,
               header: Header | None = None) -> Decoded:
        """Decode a container into the local reader schema of the writer's record name.

        ``expect`` (full names) limits the record types accepted. ``fields`` is a hint: records
        may hold only those fields (when the fast path reads them) or all of them. ``header``:
        ``read_header(data)`` where the caller has it already (the bounds check reads it). Raises
        DecodeError saying why.
        """
        if header is None:
            header = read_header(data)
        writer, same = self._writer(header)
        if expect is not None and writer.name not in expect:
            raise DecodeError(f"record type {writer.name} is not one of {', '.join(expect)}")
        reader = self._readers.get(writer.name)
        if reader is None:
            raise DecodeError(f"unknown record type {writer.name}")
        if same and compile_schema is not None and header.codec == "null":
            node = self._compiled.get((writer.name, fields))
            if node is None:
                node = self._compiled[(writer.name, fields)] = compile_schema(reader.parsed, fields)
            records: list[dict[str, Any]] = []
            try:
                for count, body in blocks(data, header):
                    records += decode_block(node, body, count)
            except (BlockDecodeError, UnicodeDecodeError) as exc:
                raise DecodeError(f"corrupt {short_name(writer.name)} container: {exc}") from None
            return Decoded(name=writer.name, records=records)
        # The framing first (block sizes, sync markers): fastavro stops quietly at some damage,
        # so the records it returns are checked against the counts of the blocks.
        expected = sum(count for count, _ in blocks(data, header))
        try:
            it = fastavro.reader(io.BytesIO(data), reader_schema=None if same else reader.parsed)
            records = list(it)  # type: ignore[arg-type]  # a record schema yields dicts
        except Exception as exc:  # fastavro raises many types on corrupt bodies
            raise DecodeError(f"corrupt {short_name(writer.name)} container: {type(exc).__name__}: {exc}") from None
        if len(records) != expected:
            raise DecodeError(
                f"corrupt {short_name(writer.name)} container: {len(records)} records decoded, its blocks say {expected}"
            )
        return Decoded(name=writer.name, records=records)
