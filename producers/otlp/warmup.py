"""The metric translator's state rebuilt from Kafka whenever the ingest gets its partitions.

Cumulative series are differenced against their previous point, which the translator keeps in
memory. After a restart (or a rebalance that moves a partition here) that memory is empty, and
the first point of each series would count whole: its step's figures would hold the whole run. So
on every assignment a fresh translator reads the last :data:`WARM_MESSAGES` messages before the
group's committed offset of each metrics partition it now holds, in order, and its output is
thrown away: the translation is a function of the messages, so its state is then what a process
that never stopped would hold (for every series exported within those messages). The Collector
and ``rlpulse otlp`` key metrics by resource, so a job's series stay on one partition.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from rlpulse.producers.otlp.decode import METRICS, OtlpLimits, decode
from rlpulse.producers.otlp.identity import OtlpRejected
from rlpulse.producers.otlp.metrics import MetricTranslator

log = logging.getLogger(__name__)

WARM_MESSAGES = 2_000  # per partition: a job exports once a step, so this covers its recent steps many times over
READ_TIMEOUT_S = 30.0


class Warmup(ConsumerRebalanceListener):
    """Rebuilds ``target.metrics`` (a Translator's MetricTranslator) on each assignment."""

    def __init__(self, target: Any, metrics_topic: str, client_kwargs: dict[str, Any],
                 limits: OtlpLimits | None = None, messages: int = WARM_MESSAGES):
        self.target, self.metrics_topic, self.client_kwargs = target, metrics_topic, client_kwargs
        self.limits, self.messages = limits or OtlpLimits(), messages
        self.consumer: AIOKafkaConsumer | None = None  # set by the ingest once created
        self.replayed = 0  # messages read back, over every assignment
        # Set while the state matches the assignment: cleared from the start and on each revocation,
        # set once an assignment's state is rebuilt. The ingest translates only while it is set.
        self.ready = asyncio.Event()

    async def on_partitions_revoked(self, revoked: Any) -> None:  # the state is rebuilt on assignment
        self.ready.clear()

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self.ready.clear()
        try:
            await self._rebuild(assigned)
        finally:
            self.ready.set()  # a rebuild that failed leaves the state it had: counted whole, not stuck

    async def _rebuild(self, assigned: Any) -> None:
        assert self.consumer is not None
        fresh = MetricTranslator()
        for tp in sorted(tp for tp in assigned if tp.topic == self.metrics_topic):
            committed = await self.consumer.committed(tp)
            if not committed:
                continue
            values = await read_back(self.client_kwargs, tp, max(committed - self.messages, 0), committed)
            refused = 0
            for value in values:
                try:
                    fresh.translate(decode(METRICS, value, self.limits), time.time_ns())
                except OtlpRejected:  # refused then too: it was dead-lettered and left nothing in the state
                    refused += 1
            self.replayed += len(values)
            log.info("metric state rebuilt from %s[%d] offsets %d-%d (%d messages, %d refused as before; %d series)",
                     tp.topic, tp.partition, committed - len(values), committed - 1, len(values), refused,
                     fresh.series_count)
        # The counts (requests, ignored names) are the process's, not the state's: keep them.
        fresh.counts, fresh.ignored = self.target.metrics.counts, self.target.metrics.ignored
        self.target.metrics = fresh


async def read_back(client_kwargs: dict[str, Any], tp: TopicPartition, start: int, end: int) -> list[bytes | None]:
    """The values at offsets [start, end) of ``tp`` (fewer where retention removed the first),
    read with a consumer of its own (no group, nothing committed), within READ_TIMEOUT_S."""
    consumer = AIOKafkaConsumer(enable_auto_commit=False, auto_offset_reset="earliest", **client_kwargs)
    await consumer.start()
    out: list[bytes | None] = []
    try:
        consumer.assign([tp])
        consumer.seek(tp, start)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READ_TIMEOUT_S
        position = start
        while position < end and loop.time() < deadline:
            batch = await consumer.getmany(tp, timeout_ms=500)
            for msg in batch.get(tp, []):
                if msg.offset >= end:
                    return out
                out.append(msg.value)
                position = msg.offset + 1
        if position < end:
            log.warning("read %s[%d] back to offset %d of %d only: the state may count some series whole",
                        tp.topic, tp.partition, position, end)
    finally:
        await consumer.stop()
    return out
