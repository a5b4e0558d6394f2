"""What the sink checks of each consumed message before buffering it (see ``sinks.sink``).

Only the container framing is read in Python (magic, header, block sizes and sync markers:
``schemas.codec.read_header`` and ``blocks``): the record type against the topic, the writer
schema against the reader schema, the codec, and the size against :class:`Limits`. No record is
decoded here: ClickHouse decodes every table (see ``sinks.avro_sql``).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Mapping

from rlpulse.schemas.catalogue import BY_SHORT, TABLES
from rlpulse.schemas.codec import DecodeError, blocks, read_header
from rlpulse.sinks.avro_sql import IncompatibleSchema, Plans
from rlpulse.sinks.writer import Entry

# Container codecs ClickHouse's Avro input reads.
CODECS = ("null", "deflate", "snappy")


@dataclass(frozen=True)
class Limits:
    """What one message may hold. The SDK writes containers of at most 1,000 records below the
    broker's 1 MiB ``message.max.bytes``; a bigger one still arrives through producer compression
    (the broker limits the compressed batch), a topic whose ``max.message.bytes`` was raised, or a
    deflate or snappy container that decompresses far beyond its size on the wire. Over either
    limit the message is dead-lettered before ClickHouse sees it."""

    max_message_records: int = 100_000
    max_message_bytes: int = 16 * 1024 * 1024  # the records' Avro bytes, decompressed


def decoded_size(codec: str, body: memoryview, budget: int) -> int:
    """Bytes of a block's records once decompressed; counting stops a little past ``budget``, so a
    deflate bomb is never inflated whole (nor kept: only its length is counted)."""
    if codec == "null":
        return len(body)
    if codec == "snappy":  # the block opens with its uncompressed length, a varint (then data, then a CRC)
        n = 0
        for i, b in enumerate(bytes(body[:5])):
            n |= (b & 0x7F) << (7 * i)
            if b < 0x80:
                return n
        raise DecodeError("corrupt snappy block: no length")
    inflate = zlib.decompressobj(-15)  # Avro's deflate is raw deflate, no zlib header
    size, data = 0, bytes(body)
    try:
        while data and size <= budget:
            size += len(inflate.decompress(data, 1 << 20))
            data = inflate.unconsumed_tail
    except zlib.error as exc:
        raise DecodeError(f"corrupt deflate block: {exc}") from None
    return size


def check_message(msg: Any, topics: Mapping[str, str], plans: Plans, limits: Limits) -> tuple[str, Entry]:
    """The table and entry of a consumed message; DecodeError says why it cannot be inserted.

    ``topics``: the short name of each consumed topic, by its full name.
    """
    if not msg.value:
        raise DecodeError("empty message (no value)")
    header = read_header(msg.value)
    allowed = BY_SHORT[topics[msg.topic]].records
    if header.name not in allowed:
        raise DecodeError(f"record type {header.name} does not belong on topic {msg.topic} (it carries {', '.join(allowed)})")
    if header.codec not in CODECS:
        raise DecodeError(f"Avro container codec {header.codec!r} is not one of {', '.join(CODECS)}")
    records, size = 0, 0
    for count, body in blocks(msg.value, header):  # walks every sync marker
        records += count
        size += decoded_size(header.codec, body, limits.max_message_bytes - size)
    if records > limits.max_message_records:
        raise DecodeError(f"container holds {records} records, over the sink's limit of {limits.max_message_records} a message")
    if size > limits.max_message_bytes:
        raise DecodeError(f"container's records take over {limits.max_message_bytes} bytes decoded "
                          f"({len(msg.value)} on the wire), over the sink's limit of {limits.max_message_bytes} a message")
    table = TABLES[header.name]
    try:
        plans.plan(table, header.name, header.schema_json)
    except IncompatibleSchema as exc:
        raise DecodeError(f"{header.name} writer schema does not resolve into the reader schema: {exc}") from None
    return table, Entry(msg, header, records)
