"""Creates the pipeline's topics with the configured partition count, and checks they agree.

Every component that publishes or consumes first calls :func:`ensure_topics`, the SDK
included: a topic the broker auto-creates on first use gets the broker's default partition
count, after which Faust restarts its agents forever on ``PartitionsMismatch``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, UnknownTopicOrPartitionError

from rlpulse.settings import Settings
from schemas.catalogue import BY_SHORT, STREAM_TABLES, TOPICS

log = logging.getLogger(__name__)


class PartitionMismatch(RuntimeError):
    """Topics that must be co-partitioned have different partition counts."""


def topic_specs(settings: Settings) -> list[NewTopic]:
    specs = [NewTopic(settings.topic(t.short), 1 if t.kind == "dlq" else settings.partitions, 1) for t in TOPICS]
    compact = {"cleanup.policy": "compact"}
    # Faust creating its changelogs itself after its first assignment causes a second rebalance
    # at once, after which it may never commit some partitions (faust-streaming #318).
    specs += [NewTopic(f"{settings.app_id}-{t}-changelog", settings.partitions, 1, topic_configs=compact) for t in STREAM_TABLES]
    specs.append(NewTopic(f"{settings.app_id}-__assignor-__leader", 1, 1))
    return specs


async def ensure_topics_async(settings: Settings) -> list[str]:
    """Create missing topics; returns the names created. Existing topics are left as they are."""
    admin = AIOKafkaAdminClient(**settings.kafka_client_kwargs())
    await admin.start()
    created = []
    try:
        existing = set(await admin.list_topics())
        missing = [spec for spec in topic_specs(settings) if spec.name not in existing]
        for spec in missing:  # one at a time: a concurrent creator makes only that topic fail
            try:
                await admin.create_topics([spec])
                created.append(spec.name)
            except TopicAlreadyExistsError:
                pass
    finally:
        await admin.close()
    return created


def ensure_topics(settings: Settings) -> list[str]:
    return asyncio.run(ensure_topics_async(settings))


async def topic_partitions(consumer: AIOKafkaConsumer, topic: str) -> list[Any]:
    """The topic's partitions, after fetching fresh metadata (a new consumer may not have it yet)."""
    from aiokafka import TopicPartition

    try:
        # aiokafka's public API has no "metadata for this topic now"; its client does.
        partitions = await consumer._client._wait_on_metadata(topic)  # noqa: SLF001
    except UnknownTopicOrPartitionError:
        return []
    return [TopicPartition(topic, p) for p in sorted(partitions)]


async def read_topic(kafka_kwargs: dict[str, Any], topic: str, last: int | None = None) -> list[Any]:
    """Every message of ``topic`` up to its end offsets now (or the ``last`` N of each partition)."""
    consumer = AIOKafkaConsumer(enable_auto_commit=False, auto_offset_reset="earliest", **kafka_kwargs)
    await consumer.start()
    messages: list[Any] = []
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


async def partition_counts_async(settings: Settings, shorts: tuple[str, ...]) -> dict[str, int]:
    """Partition count of each topic (0 when it does not exist)."""
    consumer = AIOKafkaConsumer(**settings.kafka_client_kwargs())
    await consumer.start()
    try:
        return {settings.topic(s): len(await topic_partitions(consumer, settings.topic(s))) for s in shorts}
    finally:
        await consumer.stop()


def check_copartitioned(settings: Settings, shorts: tuple[str, ...]) -> None:
    """Raise PartitionMismatch naming the topics when ``shorts`` do not all have ``settings.partitions``."""
    counts = asyncio.run(partition_counts_async(settings, shorts))
    wrong = {t: n for t, n in counts.items() if n != settings.partitions}
    if wrong:
        listing = ", ".join(f"{t} has {n}" for t, n in sorted(counts.items()))
        raise PartitionMismatch(
            f"topics disagree on partition counts ({listing}; expected {settings.partitions}, RLPULSE_PARTITIONS). "
            "A topic auto-created by the broker gets its default count: delete the topics named, or set "
            "RLPULSE_PARTITIONS to match, and start again.")


__all__ = ["BY_SHORT", "PartitionMismatch", "check_copartitioned", "ensure_topics", "ensure_topics_async", "read_topic", "topic_partitions"]
