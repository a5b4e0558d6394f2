"""Avro single-object encoding: ``C3 01`` + 8-byte little-endian CRC-64-AVRO fingerprint + body.

Readers resolve the writer schema by its fingerprint and read the body into their own reader
schema of the same full name (Avro schema resolution), so a field added with a default reads
both ways. Writer schemas this process has never seen are added with :meth:`Codec.add_schema`
(see ``schemas.registry`` for the Kafka-backed lookup).
"""

from __future__ import annotations

import io
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastavro
from fastavro.schema import fingerprint as _fingerprint
from fastavro.schema import to_parsing_canonical_form

MAGIC = b"\xc3\x01"
HEADER_LEN = len(MAGIC) + 8
SCHEMA_DIR = Path(__file__).parent


class DecodeError(ValueError):
    """The bytes are not a decodable single-object Avro message; ``reason`` says why."""


class UnknownSchemaError(DecodeError):
    """The message names a writer-schema fingerprint this codec has not seen."""

    def __init__(self, fingerprint: bytes):
        self.fingerprint = fingerprint
        super().__init__(f"unknown writer schema fingerprint {fingerprint.hex()}")


@dataclass(frozen=True)
class Decoded:
    name: str  # full name, e.g. rlpulse.v1.Span
    record: dict[str, Any]
    fingerprint: bytes


@dataclass(frozen=True)
class _Schema:
    name: str
    parsed: Any
    canonical: str
    fingerprint: bytes


def _load(schema: dict[str, Any] | str) -> _Schema:
    raw = json.loads(schema) if isinstance(schema, str) else schema
    parsed = fastavro.parse_schema(raw)  # keeps fastavro's parsed marker: no re-parse on every write
    canonical = to_parsing_canonical_form(parsed)
    # fastavro's hex digest is already in the little-endian byte order the spec puts on the wire.
    fp = bytes.fromhex(_fingerprint(canonical, "CRC-64-AVRO"))
    name = parsed["name"] if isinstance(parsed, dict) and "name" in parsed else canonical
    return _Schema(name=name, parsed=parsed, canonical=canonical, fingerprint=fp)


def short_name(full_name: str) -> str:
    return full_name.rsplit(".", 1)[-1]


class Codec:
    """Encodes records with this process's schemas; decodes any known writer schema."""

    def __init__(self, schema_dir: Path = SCHEMA_DIR):
        self._readers: dict[str, _Schema] = {}
        self._writers: dict[bytes, _Schema] = {}
        self._lock = threading.Lock()
        for path in sorted(schema_dir.glob("*.avsc")):
            try:
                schema = _load(path.read_text())
            except Exception as exc:  # a broken .avsc is a packaging bug: say which file
                raise ValueError(f"{path.name}: invalid Avro schema: {exc}") from exc
            self._readers[schema.name] = schema
            self._writers[schema.fingerprint] = schema

    # -- schemas ---------------------------------------------------------------------------
    def _reader(self, name: str) -> _Schema:
        full = name if "." in name else f"rlpulse.v1.{name}"
        try:
            return self._readers[full]
        except KeyError:
            raise ValueError(f"no schema named {name!r}; known: {sorted(map(short_name, self._readers))}") from None

    def fingerprint(self, name: str) -> bytes:
        return self._reader(name).fingerprint

    def canonical(self, name: str) -> str:
        return self._reader(name).canonical

    def names(self) -> list[str]:
        return sorted(self._readers)

    def add_schema(self, schema_json: str) -> bytes:
        """Learn a writer schema (canonical JSON from the schemas topic); returns its fingerprint."""
        schema = _load(schema_json)
        with self._lock:
            self._writers.setdefault(schema.fingerprint, schema)
        return schema.fingerprint

    def knows(self, fingerprint: bytes) -> bool:
        return fingerprint in self._writers

    # -- messages --------------------------------------------------------------------------
    def encode(self, name: str, record: dict[str, Any]) -> bytes:
        """Encode ``record`` with the local schema ``name``; a record that does not fit raises ValueError."""
        schema = self._reader(name)
        buf = io.BytesIO()
        buf.write(MAGIC)
        buf.write(schema.fingerprint)
        try:
            fastavro.schemaless_writer(buf, schema.parsed, record, strict_allow_default=True)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"{short_name(schema.name)} record does not match its schema: {exc}") from None
        return buf.getvalue()

    def decode(self, data: bytes) -> Decoded:
        """Decode a single-object message into the local reader schema of the writer's name."""
        if data is None or len(data) < HEADER_LEN:
            raise DecodeError(f"message too short for Avro single-object encoding ({0 if data is None else len(data)} bytes)")
        if data[:2] != MAGIC:
            raise DecodeError(f"not Avro single-object encoding: header {data[:2].hex()} is not c301")
        fp = bytes(data[2:HEADER_LEN])
        writer = self._writers.get(fp)
        if writer is None:
            raise UnknownSchemaError(fp)
        reader = self._readers.get(writer.name, writer)
        body = io.BytesIO(data[HEADER_LEN:])
        try:
            record = fastavro.schemaless_reader(body, writer.parsed, reader.parsed)
        except Exception as exc:  # fastavro raises many types on corrupt bodies
            raise DecodeError(f"corrupt {short_name(writer.name)} body: {type(exc).__name__}: {exc}") from None
        if body.tell() != len(data) - HEADER_LEN:
            raise DecodeError(f"{len(data) - HEADER_LEN - body.tell()} trailing bytes after the {short_name(writer.name)} body")
        return Decoded(name=writer.name, record=record, fingerprint=fp)
