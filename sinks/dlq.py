"""Dead letters: the original bytes, with the reason and the source in the message headers."""

from __future__ import annotations

from aiokafka import AIOKafkaProducer

REASON = "rlpulse.reason"
SOURCE_TOPIC = "rlpulse.source.topic"
SOURCE_PARTITION = "rlpulse.source.partition"
SOURCE_OFFSET = "rlpulse.source.offset"


async def send_dead_letter(producer: AIOKafkaProducer, dlq_topic: str, msg: object, reason: str) -> None:
    """Publish ``msg`` (an aiokafka ConsumerRecord) to ``dlq_topic`` and wait until the broker has it."""
    headers = [
        (REASON, reason.encode()),
        (SOURCE_TOPIC, msg.topic.encode()),  # type: ignore[attr-defined]
        (SOURCE_PARTITION, str(msg.partition).encode()),  # type: ignore[attr-defined]
        (SOURCE_OFFSET, str(msg.offset).encode()),  # type: ignore[attr-defined]
    ]
    await producer.send_and_wait(dlq_topic, value=msg.value, key=msg.key, headers=headers)  # type: ignore[attr-defined]


async def read_dead_letters(kafka_kwargs: dict, dlq_topic: str, limit: int = 100) -> list[dict]:
    """The last ``limit`` dead letters: source, reason and the size of the original bytes."""
    from schemas.registry import read_topic

    letters = []
    for msg in await read_topic(kafka_kwargs, dlq_topic, last=limit):
        headers = {k: v.decode(errors="replace") for k, v in msg.headers}
        letters.append({
            "time": msg.timestamp, "source": f"{headers.get(SOURCE_TOPIC)}[{headers.get(SOURCE_PARTITION)}]@{headers.get(SOURCE_OFFSET)}",
            "reason": headers.get(REASON, ""), "bytes": len(msg.value or b""),
        })
    return sorted(letters, key=lambda d: d["time"])[-limit:]
