"""Queued events -> Avro containers, one per message, whatever transport carries them.

Events are grouped by (topic, key, record type) and each group becomes one or more Avro
Object Container Files (``rlpulse.schemas.codec.Codec.encode``) of up to ``batch_records`` records,
always below ``max_message_bytes``. A record that cannot be built or encoded is isolated by
halving its container and given up on alone, so it never blocks the events around it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rlpulse.producers.sdk.queue import Item
from rlpulse.schemas.codec import Codec

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1024 * 1024  # the broker's default message.max.bytes is 1 MiB (+12)
BATCH_RECORDS = 1000
# A Kafka record batch header plus one record's framing (aiokafka's own estimate is 61 + 21 +
# varints); kept generous so a container we accept is never refused by the producer.
MESSAGE_OVERHEAD = 256
BLOCK_OVERHEAD = 32  # a container block's record count, byte size and sync marker


@dataclass
class Container:
    """One message: ``value`` is an Avro container of ``schema`` records, all under ``key``."""

    topic: str
    key: bytes
    schema: str
    items: list[Item]  # the queue's items, kept until acknowledged (they count in its budget)
    value: bytes = b""

    @property
    def size(self) -> int:
        return sum(item[2] for item in self.items)


class Encoder:
    """Thread-safe enough for its use: the callers' size checks and the sender thread share the header cache."""

    def __init__(self, codec: Codec, max_message_bytes: int = MAX_MESSAGE_BYTES, batch_records: int = BATCH_RECORDS):
        self.codec = codec
        self.max_message_bytes = max_message_bytes
        self.batch_records = batch_records
        self._headers: dict[str, int] = {}

    # -- sizes -----------------------------------------------------------------------------
    def header_bytes(self, schema: str) -> int:
        """Bytes of a container of ``schema`` with no records (its header carries the schema)."""
        size = self._headers.get(schema)
        if size is None:
            size = self._headers[schema] = len(self.codec.encode(schema, []))
        return size

    def max_record_bytes(self, schema: str, key: str) -> int:
        """The largest encoded record of ``schema`` under ``key`` that still fits in one message."""
        return self.max_message_bytes - self.header_bytes(schema) - len(key.encode()) - MESSAGE_OVERHEAD - BLOCK_OVERHEAD

    # -- encoding --------------------------------------------------------------------------
    def encode(self, items: list[Item]) -> tuple[list[Container], list[int]]:
        """Group ``items`` and encode each group's containers; returns them and the sizes of items given up on.

        Records are built one container at a time, so at most one container's record dicts
        exist at once. A record that cannot be built or encoded (a bug, never a caller's bad
        argument, which the call refused) is logged and given up on instead of blocking the rest.
        """
        groups: dict[tuple[str, str, str], list[Item]] = {}
        for item in items:
            group = groups.get(item[0].group)
            if group is None:
                group = groups[item[0].group] = []
            group.append(item)
        out: list[Container] = []
        lost: list[int] = []
        for (topic, key, schema), group in groups.items():
            key_bytes = key.encode()
            budget = self.max_message_bytes - self.header_bytes(schema) - len(key_bytes) - MESSAGE_OVERHEAD
            start = used = 0
            for i, item in enumerate(group):  # cut by count and by the estimated bytes
                if i > start and (i - start >= self.batch_records or used + item[2] > budget):
                    self._encode_into(out, Container(topic, key_bytes, schema, group[start:i]), lost)
                    start, used = i, 0
                used += item[2]
            if start < len(group):
                self._encode_into(out, Container(topic, key_bytes, schema, group[start:]), lost)
        return out, lost

    def _encode_into(self, out: list[Container], c: Container, lost: list[int]) -> None:
        """Build and encode ``c``; halve it while it is over the limit or holds a record that does not encode."""
        records, good = [], []
        for item in c.items:
            try:
                records.append(item[0].build(item[1], item[3]))
                good.append(item)
            except Exception:
                log.exception("could not build a %s record; dropped", c.schema)
                lost.append(item[2])
        if not good:
            return
        c.items = good
        try:
            c.value = self.codec.encode(c.schema, records)
            fits = len(c.value) + len(c.key) + MESSAGE_OVERHEAD <= self.max_message_bytes
            error = None if fits else f"{len(c.value)} bytes encoded, over the {self.max_message_bytes}-byte message limit"
        except ValueError as exc:
            error = str(exc)
        if error is None:
            out.append(c)
        else:
            self.halve(out, c, lost, error)

    def halve(self, out: list[Container], c: Container, lost: list[int], error: str) -> None:
        """Re-encode ``c`` as two containers into ``out`` (a single record that fails ``error`` is lost)."""
        if len(c.items) == 1:
            log.error("a %s record for %s could not be sent (%s); dropped", c.schema, c.topic, error)
            lost.append(c.items[0][2])
            return
        half = len(c.items) // 2
        for part in (c.items[:half], c.items[half:]):
            self._encode_into(out, Container(c.topic, c.key, c.schema, part), lost)
