"""What the sink checks of each consumed message before buffering it (see ``rlpulse.sinks.write.sink``).

Only the container framing is read in Python, against the bounds every reader of a container
shares (``rlpulse.schemas.limits``: records, decoded bytes with bounded decompression, blocks, schema
nesting, a writer schema whose blocks could claim endless items); then the record type against
the topic and the writer schema against the reader schema. No record is decoded here:
ClickHouse decodes every table (see ``rlpulse.sinks.store.avro_sql``).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping

from rlpulse.schemas.catalogue import BY_SHORT, TABLES
from rlpulse.schemas.codec import DecodeError
from rlpulse.schemas.limits import CODECS, Limits, check_container, decoded_size
from rlpulse.sinks.store.avro_sql import IncompatibleSchema, Plans
from rlpulse.sinks.write.writer import Entry

__all__ = ["CODECS", "Limits", "check_message", "decoded_size"]


def check_message(msg: Any, topics: Mapping[str, str], plans: Plans, limits: Limits) -> tuple[str, Entry]:
    """The table and entry of a consumed message; DecodeError says why it cannot be inserted.

    ``topics``: the short name of each consumed topic, by its full name.
    """
    if not msg.value:
        raise DecodeError("empty message (no value)")
    checked = check_container(msg.value, limits)
    header = checked.header
    allowed = BY_SHORT[topics[msg.topic]].records
    if header.name not in allowed:
        raise DecodeError(f"record type {header.name} does not belong on topic {msg.topic} (it carries {', '.join(allowed)})")
    table = TABLES[header.name]
    try:
        plans.plan(table, header.name, header.schema_json)
    except IncompatibleSchema as exc:
        raise DecodeError(f"{header.name} writer schema does not resolve into the reader schema: {exc}") from None
    return table, Entry(msg, header, checked.records)
