"""Dead letters: the original bytes, with the reason and the source in the message headers;
and their replay (``rlpulse dlq replay``) once the cause is fixed.

A replay republishes each dead letter's original bytes, with its key, to the topic it came from,
where the sink reads it again like any message (and dead-letters it again if the cause is not
fixed: a new letter, left for a later replay). What was replayed is recorded, so a second replay
does not send it twice: in a compacted ledger topic ``<prefix>.dlq-replayed`` (one entry per
replayed letter, written once the broker has the republished message), and in the consumer
group ``<prefix>-dlq-replay``, whose committed offset on the dead-letter topic is the first
letter not replayed yet (so its lag is what is left to replay, and a replay starts there). The
ledger is needed besides the offset because a filtered replay (``--topic``, ``--reason``) leaves
letters behind it. A replay that dies between a republish and its ledger entry republishes that
letter again next time; the rows are idempotent in ClickHouse anyway (the tables' keys collapse
the copy: ``FINAL``, or after a merge), so the ledger keeps plain counts exact, not the data.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from rlpulse.base.settings import Settings
from rlpulse.schemas.catalogue import DLQ_TOPIC, SINK_TOPICS
from rlpulse.schemas.codec import DecodeError
from rlpulse.schemas.dead_letters import (MAX_LETTER_BYTES, ORIGINAL_SHA256, ORIGINAL_SIZE, REASON, REPLAY_OF,  # noqa: F401 - handed on
                                          SOURCE_OFFSET, SOURCE_PARTITION, SOURCE_TOPIC, TRUNCATED, Letter, build_letter)
from rlpulse.schemas.limits import Limits, check_container
from rlpulse.schemas.topics import read_topic, replication_for, topic_partitions

LEDGER_TOPIC = "dlq-replayed"


async def send_dead_letter(producer: AIOKafkaProducer, dlq_topic: str, msg: object, reason: str) -> None:
    """Publish ``msg``'s dead letter (:func:`build_letter`) to ``dlq_topic`` and wait until the broker has it."""
    letter = build_letter(msg, reason)
    await producer.send_and_wait(dlq_topic, value=letter.value, key=letter.key, headers=letter.headers)


async def queue_dead_letter(producer: AIOKafkaProducer, dlq_topic: str, msg: object, reason: str) -> asyncio.Future:
    """Like :func:`send_dead_letter` without waiting: returns the delivery future, which the
    sink awaits before it commits the message's offset (no commit past a lost dead letter)."""
    letter = build_letter(msg, reason)
    return await producer.send(dlq_topic, value=letter.value, key=letter.key, headers=letter.headers)


async def read_dead_letters(kafka_kwargs: dict, dlq_topic: str, limit: int = 100,
                            ledger_topic: str | None = None) -> list[dict]:
    """The last ``limit`` dead letters: source, reason, the size of the original bytes, and (with
    the replay ledger's topic) where a replay sent each, or ''."""
    replayed = {}
    if ledger_topic is not None and await _exists(kafka_kwargs, ledger_topic):  # none before the first replay
        replayed = {m.key.decode(): json.loads(m.value)["to"] for m in await read_topic(kafka_kwargs, ledger_topic)
                    if m.key is not None and m.value is not None}
    letters = []
    for msg in await read_topic(kafka_kwargs, dlq_topic, last=limit):
        headers = {k: v.decode(errors="replace") for k, v in msg.headers}
        letters.append({
            "time": msg.timestamp,
            "source": f"{headers.get(SOURCE_TOPIC)}[{headers.get(SOURCE_PARTITION)}]@{headers.get(SOURCE_OFFSET)}",
            "reason": headers.get(REASON, ""), "replayed": replayed.get(_letter_id(msg), ""),
            # the original's size: a truncated letter keeps it in its headers
            "bytes": int(headers[ORIGINAL_SIZE]) if headers.get(ORIGINAL_SIZE, "").isdigit() else len(msg.value or b""),
            "kept": len(msg.value or b""), "sha256": headers.get(ORIGINAL_SHA256, ""),
        })
    return sorted(letters, key=lambda d: d["time"])[-limit:]


def replay_group(settings: Settings) -> str:
    return f"{settings.topic_prefix}-dlq-replay"


def _letter_id(msg: Any) -> str:
    return f"{msg.partition}:{msg.offset}"


@dataclass
class ReplayReport:
    """What a replay did (or, dry, would do)."""

    replayed: list[dict] = field(default_factory=list)  # source, reason, to (topic[partition]@offset)
    already: int = 0  # replayed by an earlier replay (ledger, or below the group's offset)
    filtered: int = 0  # not matching --topic / --reason
    unroutable: int = 0  # no source topic in the headers: nowhere to send it
    truncated: int = 0  # kept truncated (the original was too big for the broker): not replayable
    # A source topic that is not one of this pipeline's (anyone can write to the dead-letter topic):
    # a replay sends only to the topics the sink reads, never where a letter's header says.
    foreign: int = 0
    # Refused by the one bounded container decoder (rlpulse.schemas.limits): not a container, or over a
    # bound. The sink would refuse it again; it stays in place, replayable if the limits change.
    refused: int = 0


async def _exists(kafka_kwargs: dict, topic: str) -> bool:
    admin = AIOKafkaAdminClient(**kafka_kwargs)
    await admin.start()
    try:
        return topic in set(await admin.list_topics())
    finally:
        await admin.close()


async def _ensure_ledger(settings: Settings) -> str:
    topic = settings.topic(LEDGER_TOPIC)
    admin = AIOKafkaAdminClient(**settings.kafka_client_kwargs())
    await admin.start()
    try:
        if topic not in set(await admin.list_topics()):
            # replicated like every other topic: the ledger is what keeps a replay from sending twice
            factor, min_isr = replication_for(len((await admin.describe_cluster())["brokers"]))
            configs = {"cleanup.policy": "compact", "min.insync.replicas": str(min_isr)}
            try:
                await admin.create_topics([NewTopic(topic, 1, factor, topic_configs=configs)])
            except TopicAlreadyExistsError:
                pass
    finally:
        await admin.close()
    return topic


def replay_targets(settings: Settings) -> frozenset[str]:
    """The only topics a replay publishes to: those the sink reads, under this pipeline's prefix."""
    return frozenset(settings.topic(short) for short in SINK_TOPICS)


def _refused(value: bytes | None, limits: Limits) -> bool:
    try:
        check_container(value, limits)
    except DecodeError:
        return True
    return False


def _matches(headers: dict[str, str], settings: Settings, topic: str | None, reason: str | None) -> bool:
    if topic is not None and headers.get(SOURCE_TOPIC) not in (topic, settings.topic(topic)):
        return False
    return reason is None or reason.lower() in headers.get(REASON, "").lower()


async def replay_dead_letters(settings: Settings, topic: str | None = None, reason: str | None = None,
                              dry_run: bool = False) -> ReplayReport:
    """Republish the dead letters not replayed yet that match ``topic`` (short or full source topic
    name) and ``reason`` (a substring, any case), up to the end of the dead-letter topic now."""
    kafka = settings.kafka_client_kwargs()
    dlq = settings.topic(DLQ_TOPIC)
    ledger = await _ensure_ledger(settings)
    done = {m.key.decode() for m in await read_topic(kafka, ledger) if m.key is not None and m.value is not None}
    report = ReplayReport()
    targets, limits = replay_targets(settings), Limits()
    consumer = AIOKafkaConsumer(group_id=replay_group(settings), enable_auto_commit=False, **kafka)
    producer = AIOKafkaProducer(acks="all", enable_idempotence=True, **kafka)
    await consumer.start()
    await producer.start()
    try:
        tps = await topic_partitions(consumer, dlq)
        if not tps:
            return report
        consumer.assign(tps)
        end = await consumer.end_offsets(tps)
        begin = await consumer.beginning_offsets(tps)
        start = {tp: max((await consumer.committed(tp)) or 0, begin[tp]) for tp in tps}
        # Every letter below the group's offset was settled by an earlier replay: not read again.
        report.already = sum(start[tp] - begin[tp] for tp in tps)
        first_left = dict(end)  # per partition: the first letter left unreplayed (the group's next offset)
        sends: list[tuple[Any, dict[str, str], asyncio.Future]] = []
        for tp in tps:
            consumer.seek(tp, start[tp])
        while [tp for tp in tps if await consumer.position(tp) < end[tp]]:
            for tp, batch in (await consumer.getmany(timeout_ms=1000)).items():
                for msg in batch:
                    if msg.offset >= end[tp]:
                        continue
                    headers = {k: v.decode(errors="replace") for k, v in msg.headers}
                    if _letter_id(msg) in done:
                        report.already += 1
                        continue
                    if not headers.get(SOURCE_TOPIC):
                        report.unroutable += 1
                        continue
                    if headers.get(TRUNCATED):  # only its first bytes were kept: republishing them would be garbage
                        report.truncated += 1
                        first_left[tp] = min(first_left[tp], msg.offset)
                        continue
                    if headers[SOURCE_TOPIC] not in targets:  # never replayable: passed, like unroutable
                        report.foreign += 1
                        continue
                    if not _matches(headers, settings, topic, reason):
                        report.filtered += 1
                        first_left[tp] = min(first_left[tp], msg.offset)
                        continue
                    if _refused(msg.value, limits):
                        report.refused += 1
                        first_left[tp] = min(first_left[tp], msg.offset)
                        continue
                    if dry_run:
                        report.replayed.append(_describe(headers, "(dry run)"))
                        continue
                    delivery = await producer.send(headers[SOURCE_TOPIC], value=msg.value, key=msg.key,
                                                   headers=[(REPLAY_OF, f"{msg.topic}[{msg.partition}]@{msg.offset}".encode())])
                    sends.append((msg, headers, delivery))
        if dry_run:
            return report
        # The broker has every republished message before any is written down as replayed.
        for _, headers, delivery in sends:
            meta = await delivery
            report.replayed.append(_describe(headers, f"{meta.topic}[{meta.partition}]@{meta.offset}"))
        entries = [await producer.send(ledger, key=_letter_id(msg).encode(), value=json.dumps(
            {"to": r["to"], "at": time.time()}).encode()) for (msg, _, _), r in zip(sends, report.replayed)]
        await asyncio.gather(*entries)
        advanced = {tp: first_left[tp] for tp in tps if first_left[tp] > start[tp]}
        if advanced:
            await consumer.commit(advanced)
        return report
    finally:
        await producer.stop()
        await consumer.stop()


def _describe(headers: dict[str, str], to: str) -> dict:
    source = f"{headers.get(SOURCE_TOPIC)}[{headers.get(SOURCE_PARTITION)}]@{headers.get(SOURCE_OFFSET)}"
    return {"source": source, "reason": headers.get(REASON, ""), "to": to}
