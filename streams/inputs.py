"""The raw topics' messages into records, as the agents decode them.

A message that cannot be decoded (random bytes, a truncated container, a record type that does
not belong on the topic, a writer schema readers refuse) or that breaks the sink's limits
(``rlpulse.schemas.limits``: records, decoded bytes with bounded decompression, blocks, schema nesting,
endless arrays; the same numbers as the sink's, checked before anything is decoded) is skipped,
counted and logged with its place and the reason, so no record of it reaches a figure; the sink
dead-letters the raw message, so nothing is lost silently, and the messages around it are
processed as usual.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from collections.abc import Callable

from rlpulse.schemas.catalogue import BY_SHORT, SPANS_TOPIC
from rlpulse.schemas.codec import Codec, DecodeError
from rlpulse.schemas.limits import Limits, check_container
from rlpulse.streams.runs import SPAN_FIELDS

log = logging.getLogger(__name__)

# The fields each topic's processor reads: the decoder may skip the rest.
FIELDS = {SPANS_TOPIC: SPAN_FIELDS}


class Inputs:
    def __init__(self, codec: Codec, limits: Limits | None = None):
        self.codec = codec
        self.limits = limits or Limits()  # the sink's numbers: the same message is refused by both
        self.skipped = 0  # messages skipped as undecodable or over a limit

    def decode(self, short: str, value: bytes | None, where: str) -> list[dict[str, Any]]:
        """The records of one message of topic ``short``; [] for one that does not decode. ``where``: topic[partition]@offset."""
        try:
            checked = check_container(value, self.limits)  # bounded: nothing is decoded or inflated past a limit
            assert value is not None  # check_container refuses a tombstone
            return self.codec.decode(value, expect=BY_SHORT[short].records, fields=FIELDS.get(short),
                                     header=checked.header).records
        except DecodeError as exc:
            self.skipped += 1
            log.warning("skipping undecodable message %s: %s (%d skipped so far; the sink dead-letters it)",
                        where, exc, self.skipped)
        except Exception:  # noqa: BLE001 - a decoder bug must cost one message, not the worker
            self.skipped += 1
            log.exception("skipping message %s: the decoder failed on it (%d skipped so far)", where, self.skipped)
        return []


class KafkaRanges:
    """The worker's range reader (``rlpulse.streams.worker.RangeReader``) on the broker: :func:`read_range`
    with the client settings of the moment (``Settings.kafka_client_kwargs``)."""

    def __init__(self, client_kwargs: Callable[[], dict[str, Any]]):
        self.client_kwargs = client_kwargs

    async def read_range(self, tp: Any, first: int, end: int) -> list[tuple[int, bytes | None]]:
        return await read_range(self.client_kwargs(), tp, first, end)


async def read_range(client_kwargs: dict[str, Any], tp: Any, start: int, end: int,
                     timeout_s: float = 30.0) -> list[tuple[int, bytes | None]]:
    """Offsets ``start`` up to ``end`` (excluded) of ``tp``, as (offset, value), read with a consumer
    of its own (no group, nothing committed). Fewer when the log starts after ``start`` (retention)
    or the broker does not answer within ``timeout_s``: what is missing is then logged."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    part = TopicPartition(tp.topic, tp.partition)
    consumer = AIOKafkaConsumer(enable_auto_commit=False, auto_offset_reset="earliest", **client_kwargs)
    out: list[tuple[int, bytes | None]] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    await consumer.start()
    try:
        consumer.assign([part])
        consumer.seek(part, start)
        while loop.time() < deadline:
            batch = await consumer.getmany(part, timeout_ms=500)
            for record in batch.get(part, []):
                if record.offset >= end:
                    return out
                out.append((record.offset, record.value))
            if out and out[-1][0] >= end - 1 or await consumer.position(part) >= end:
                return out
        log.error("%s: read %d of offsets %d..%d within %.0fs; the rest is lost to this worker's figures",
                  tp, len(out), start, end - 1, timeout_s)
        return out
    finally:
        await consumer.stop()
