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
