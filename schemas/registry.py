"""A schema registry kept in Kafka itself: the compacted topic ``<prefix>.schemas``.

Writers publish each schema they use once (key: fingerprint, value: canonical JSON) before
their first message with it; readers that meet an unknown fingerprint read the topic to the
end and try again.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.errors import UnknownTopicOrPartitionError

from schemas.codec import Codec, Decoded, UnknownSchemaError

log = logging.getLogger(__name__)


async def topic_partitions(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    """The topic's partitions, after fetching fresh metadata (a new consumer may not have it yet)."""
    try:
        # aiokafka's public API has no "metadata for this topic now"; its client does.
        partitions = await consumer._client._wait_on_metadata(topic)  # noqa: SLF001
    except UnknownTopicOrPartitionError:
        return []
    return [TopicPartition(topic, p) for p in sorted(partitions)]


async def read_topic(kafka_kwargs: dict[str, Any], topic: str, last: int | None = None) -> list[ConsumerRecord]:
    """Every message of ``topic`` up to its end offsets now (or the ``last`` N of each partition)."""
    consumer = AIOKafkaConsumer(enable_auto_commit=False, auto_offset_reset="earliest", **kafka_kwargs)
    await consumer.start()
    messages: list[ConsumerRecord] = []
    try:
        tps = await topic_partitions(consumer, topic)
        if not tps:
            return []
        consumer.assign(tps)
        end = await consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, 0 if last is None else max(end[tp] - last, 0))
        while [tp for tp in tps if await consumer.position(tp) < end[tp]]:
            for batch in (await consumer.getmany(timeout_ms=1000)).values():
                messages.extend(batch)
    finally:
        await consumer.stop()
    return messages


async def publish_schemas(producer: AIOKafkaProducer, topic: str, codec: Codec, names: Iterable[str]) -> None:
    """Publish the named schemas and wait until the broker has them."""
    for name in names:
        await producer.send_and_wait(topic, key=codec.fingerprint(name), value=codec.canonical(name).encode())


class SchemaResolver:
    """Decodes with a :class:`Codec`, reading the schemas topic when a fingerprint is unknown."""

    def __init__(self, codec: Codec, topic: str, kafka_kwargs: dict[str, Any], min_refresh_interval: float = 1.0):
        self.codec = codec
        self._topic = topic
        self._kafka_kwargs = kafka_kwargs
        self._min_interval = min_refresh_interval
        self._last_refresh = 0.0

    async def decode(self, data: bytes) -> Decoded:
        try:
            return self.codec.decode(data)
        except UnknownSchemaError as exc:
            # Rate-limited so a flood of messages with a bogus fingerprint cannot hammer the broker.
            if time.monotonic() - self._last_refresh < self._min_interval:
                raise
            await self.refresh()
            if not self.codec.knows(exc.fingerprint):
                raise
            return self.codec.decode(data)

    async def refresh(self) -> int:
        """Read the schemas topic from the beginning to its end; returns how many schemas were read."""
        self._last_refresh = time.monotonic()
        consumer = AIOKafkaConsumer(enable_auto_commit=False, auto_offset_reset="earliest", **self._kafka_kwargs)
        await consumer.start()
        read = 0
        try:
            tps = await topic_partitions(consumer, self._topic)
            if not tps:
                return 0
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            end = await consumer.end_offsets(tps)
            remaining = {tp for tp in tps if end[tp] > 0}
            while remaining:
                batches = await consumer.getmany(timeout_ms=1000)
                for tp, messages in batches.items():
                    for msg in messages:
                        try:
                            self.codec.add_schema(msg.value.decode())
                            read += 1
                        except Exception as exc:  # one bad registry entry must not block the rest
                            log.warning("ignoring unreadable schema at %s offset %d: %s", self._topic, msg.offset, exc)
                for tp in list(remaining):
                    if await consumer.position(tp) >= end[tp]:
                        remaining.discard(tp)
        finally:
            await consumer.stop()
        return read
