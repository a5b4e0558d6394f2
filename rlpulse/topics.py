"""Creates the pipeline's topics with the configured partition count (Faust needs them to exist)."""

from __future__ import annotations

import asyncio
import logging

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from rlpulse.settings import DERIVED_TOPICS, DLQ_TOPIC, INTERNAL_TOPICS, RAW_TOPICS, SCHEMAS_TOPIC, Settings

log = logging.getLogger(__name__)


def topic_specs(settings: Settings) -> list[NewTopic]:
    from streams.state import TABLES  # names only: no Faust import

    specs = [NewTopic(settings.topic(t), settings.partitions, 1) for t in RAW_TOPICS + DERIVED_TOPICS + INTERNAL_TOPICS]
    specs.append(NewTopic(settings.topic(DLQ_TOPIC), 1, 1))
    specs.append(NewTopic(settings.topic(SCHEMAS_TOPIC), 1, 1, topic_configs={"cleanup.policy": "compact"}))
    compact = {"cleanup.policy": "compact"}
    specs += [NewTopic(f"{settings.app_id}-{t}-changelog", settings.partitions, 1, topic_configs=compact) for t in TABLES]
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
