"""Probing a topic never creates it.

A metadata request naming a missing topic makes a broker with ``auto.create.topics.enable``
(Kafka's default, and the local broker's) create it with its default partition count; the streams
then refuse to start on topics whose counts disagree. ``rlpulse status`` run before the
pipeline's first start did exactly that.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from rlpulse.schemas.catalogue import RUN_TOPICS
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics, partition_counts_async

pytestmark = pytest.mark.integration


async def _topics_with_prefix(settings: Settings) -> list[str]:
    admin = AIOKafkaAdminClient(**settings.kafka_client_kwargs())
    await admin.start()
    try:
        return sorted(t for t in await admin.list_topics() if t.startswith(settings.topic_prefix + "."))
    finally:
        await admin.close()


def test_probes_and_status_create_no_topic(settings: Settings) -> None:
    counts = asyncio.run(partition_counts_async(settings, RUN_TOPICS))
    assert counts == {settings.topic(s): 0 for s in RUN_TOPICS}
    status = subprocess.run([sys.executable, "-m", "rlpulse.cli", "status"], env={**os.environ, **settings.env()},
                            capture_output=True, text=True, timeout=120)
    assert asyncio.run(_topics_with_prefix(settings)) == [], status.stdout + status.stderr
    # Once created, the probe sees each topic with the pipeline's partition count.
    ensure_topics(settings)
    counts = asyncio.run(partition_counts_async(settings, RUN_TOPICS))
    assert counts == {settings.topic(s): settings.partitions for s in RUN_TOPICS}
