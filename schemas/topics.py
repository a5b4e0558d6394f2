"""Creates the pipeline's topics with the configured partition count, and checks they agree.

Every component that publishes or consumes first calls :func:`ensure_topics`, the SDK
included: a topic the broker auto-creates on first use gets the broker's default partition
count, after which Faust restarts its agents forever on ``PartitionsMismatch``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, for_code

from rlpulse.base import env as envvars
from rlpulse.base.settings import Settings
from rlpulse.schemas.catalogue import BY_SHORT, STREAM_TABLES, TOPICS
from rlpulse.base.errors import Error

log = logging.getLogger(__name__)


class PartitionMismatch(Error, RuntimeError):
    """Topics that must be co-partitioned have different partition counts."""


def replication_for(brokers: int) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) for a cluster of ``brokers``: three copies where
    there are three brokers, and an ``acks=all`` write acknowledged by two, so one may be down."""
    factor = max(1, min(3, brokers))
    return factor, 2 if factor >= 3 else 1


def topic_specs(settings: Settings, brokers: int = 1) -> list[NewTopic]:
    """Every topic the pipeline uses (Faust's changelogs and leader topic too: Faust would create
    them at its own replication factor, 1), replicated as :func:`replication_for` ``brokers`` says."""
    factor, min_isr = replication_for(brokers)
    isr = {"min.insync.replicas": str(min_isr)} if factor >= 3 else {}
    specs = [NewTopic(settings.topic(t.short), 1 if t.kind == "dlq" else settings.partitions, factor, topic_configs=isr)
             for t in TOPICS]
    compact = {"cleanup.policy": "compact", **isr}
    # Faust creating its changelogs itself after its first assignment causes a second rebalance
    # at once, after which it may never commit some partitions (faust-streaming #318).
    specs += [NewTopic(f"{settings.app_id}-{t}-changelog", settings.partitions, factor, topic_configs=compact)
              for t in STREAM_TABLES]
    specs.append(NewTopic(f"{settings.app_id}-__assignor-__leader", 1, factor, topic_configs=isr))
    return specs


async def ensure_topics_async(settings: Settings) -> list[str]:
    """Create missing topics; returns the names created. Existing topics are left as they are.

    The replication factor follows the brokers the cluster's metadata lists now (min(3, brokers)):
    one on the single local broker, three with ``min.insync.replicas=2`` on a cluster of three or
    more. Topics created while a broker of three is down get two copies (said in the log)."""
    admin = AIOKafkaAdminClient(**settings.kafka_client_kwargs())
    await admin.start()
    created = []
    try:
        existing = set(await admin.list_topics())
        brokers = len((await admin.describe_cluster())["brokers"])
        missing = [spec for spec in topic_specs(settings, brokers) if spec.name not in existing]
        if missing and 1 < brokers < 3:
            log.warning("creating %d topics with %d copies: the cluster lists %d brokers now", len(missing), brokers, brokers)
        for spec in missing:  # one at a time: a concurrent creator makes only that topic fail
            try:
                response = await admin.create_topics([spec])
            except TopicAlreadyExistsError:
                continue
            # aiokafka returns a topic's error in the response rather than raising it: a topic
            # not created (too few brokers for its replicas, say) would be auto-created later
            # with the broker's defaults, unreplicated.
            for _, code, *message in response.topic_errors:
                if code not in (0, TopicAlreadyExistsError.errno):
                    error = for_code(code)
                    raise error(f"creating topic {spec.name} ({spec.num_partitions} partitions, {spec.replication_factor} "
                                f"copies) failed: {error.__name__} {message[0] if message else ''}".rstrip())
                if code == 0:
                    created.append(spec.name)
    finally:
        await admin.close()
    return created


def ensure_topics(settings: Settings) -> list[str]:
    return asyncio.run(ensure_topics_async(settings))


async def topic_partitions(consumer: AIOKafkaConsumer, topic: str) -> list[Any]:
    """The topic's partitions, after fetching fresh metadata (a new consumer may not have it yet)."""
    return await topics_partitions(consumer, [topic])


async def topics_partitions(consumer: AIOKafkaConsumer, topics: Iterable[str]) -> list[Any]:
    """Every partition of ``topics`` (none of a topic that does not exist), in the order given, from
    one fresh metadata fetch: each fetch carries every topic of the cluster, and a shared broker
    holds thousands (a test suite's broker held 4,681, and a fetch per topic cost the sink a second
    of start-up)."""
    from aiokafka import TopicPartition

    # aiokafka's public API has no "metadata now"; its client does. Ask for every topic's metadata
    # rather than this one's: a metadata request that names a missing topic makes a broker with
    # auto.create.topics.enable create it with its default partition count, and `rlpulse status`
    # (or a lag probe) run before the pipeline's first start then left topics that the streams
    # refuse to start on (their partition counts disagree).
    metadata = await consumer._client.fetch_all_metadata()  # noqa: SLF001
    return [TopicPartition(topic, p) for topic in topics for p in sorted(metadata.partitions_for_topic(topic) or ())]


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


async def partition_counts_async(settings: Settings, shorts: tuple[str, ...], settle_s: float = 0.0) -> dict[str, int]:
    """Partition count of each topic (0 when it does not exist). With ``settle_s``, a topic not seen
    yet is asked for again for up to that long: a broker's metadata lags the topics just created
    (on a broker started moments before, by seconds)."""
    consumer = AIOKafkaConsumer(**settings.kafka_client_kwargs())
    await consumer.start()
    deadline = time.monotonic() + settle_s
    try:
        while True:
            names = [settings.topic(s) for s in shorts]
            found = Counter(tp.topic for tp in await topics_partitions(consumer, names))
            counts = {name: found[name] for name in names}
            if all(counts.values()) or time.monotonic() >= deadline:
                return counts
            await asyncio.sleep(0.25)
    finally:
        await consumer.stop()


def check_copartitioned(settings: Settings, shorts: tuple[str, ...]) -> None:
    """Raise PartitionMismatch naming the topics when ``shorts`` do not all have ``settings.partitions``."""
    counts = asyncio.run(partition_counts_async(settings, shorts, settle_s=15.0))  # called right after ensure_topics
    wrong = {t: n for t, n in counts.items() if n != settings.partitions}
    if wrong:
        listing = ", ".join(f"{t} has {n}" for t, n in sorted(counts.items()))
        raise PartitionMismatch(
            f"topics disagree on partition counts ({listing}; expected {settings.partitions}, {envvars.PARTITIONS}). "
            "A topic auto-created by the broker gets its default count: delete the topics named, or set "
            f"{envvars.PARTITIONS} to match, and start again.")


__all__ = ["BY_SHORT", "PartitionMismatch", "check_copartitioned", "ensure_topics", "ensure_topics_async", "read_topic",
           "replication_for", "topic_partitions", "topics_partitions"]
