"""Dead letters: the original bytes, with the reason and the source in the message headers."""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaProducer

REASON = "rlpulse.reason"
SOURCE_TOPIC = "rlpulse.source.topic"
SOURCE_PARTITION = "rlpulse.source.partition"
SOURCE_OFFSET = "rlpulse.source.offset"


def _headers(msg: object, reason: str) -> list[tuple[str, bytes]]:
    return [
        (REASON, reason.encode()),
        (SOURCE_TOPIC, msg.topic.encode()),  # type: ignore[attr-defined]
        (SOURCE_PARTITION, str(msg.partition).encode()),  # type: ignore[attr-defined]
        (SOURCE_OFFSET, str(msg.offset).encode()),  # type: ignore[attr-defined]
    ]


async def send_dead_letter(producer: AIOKafkaProducer, dlq_topic: str, msg: object, reason: str) -> None:
    """Publish ``msg`` (an aiokafka ConsumerRecord) to ``dlq_topic`` and wait until the broker has it."""
    await producer.send_and_wait(dlq_topic, value=msg.value, key=msg.key, headers=_headers(msg, reason))  # type: ignore[attr-defined]


async def queue_dead_letter(producer: AIOKafkaProducer, dlq_topic: str, msg: object, reason: str) -> asyncio.Future:
    """Like :func:`send_dead_letter` without waiting: returns the delivery future, which the
    sink awaits before it commits the message's offset (no commit past a lost dead letter)."""
    return await producer.send(dlq_topic, value=msg.value, key=msg.key, headers=_headers(msg, reason))  # type: ignore[attr-defined]


async def read_dead_letters(kafka_kwargs: dict, dlq_topic: str, limit: int = 100) -> list[dict]:
    """The last ``limit`` dead letters: source, reason and the size of the original bytes."""
    from schemas.topics import read_topic

    letters = []
    for msg in await read_topic(kafka_kwargs, dlq_topic, last=limit):
        headers = {k: v.decode(errors="replace") for k, v in msg.headers}
        letters.append({
            "time": msg.timestamp, "source": f"{headers.get(SOURCE_TOPIC)}[{headers.get(SOURCE_PARTITION)}]@{headers.get(SOURCE_OFFSET)}",
            "reason": headers.get(REASON, ""), "bytes": len(msg.value or b""),
        })
    return sorted(letters, key=lambda d: d["time"])[-limit:]
