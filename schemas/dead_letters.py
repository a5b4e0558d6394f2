"""A dead letter: the original bytes of a message that could not be used, with the reason and the
source in its headers, kept within what the broker takes. Written by the sink and by the OTLP
ingest (both consume what anyone may send); read and replayed by ``rlpulse dlq``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

REASON = "rlpulse.reason"
SOURCE_TOPIC = "rlpulse.source.topic"
SOURCE_PARTITION = "rlpulse.source.partition"
SOURCE_OFFSET = "rlpulse.source.offset"
REPLAY_OF = "rlpulse.replay.of"  # on a republished message: the dead letter it came from
# On a dead letter whose original was too big for the broker: the bytes kept are its first ones.
ORIGINAL_SIZE = "rlpulse.original.size"  # the original value's size in bytes
ORIGINAL_SHA256 = "rlpulse.original.sha256"  # hex digest of the whole original value
TRUNCATED = "rlpulse.truncated"  # "value" (and "key" when the key was cut too)
# What a dead letter's key and value may take together: under the producer's default
# max_request_size and the broker's default message.max.bytes (both 1 MiB), with room for the
# headers and the record batch's framing. A message consumed can be far bigger (a 20 MiB value
# compressed to kilobytes on the wire: the broker checks only the compressed batch); sent whole,
# the producer raises MessageSizeTooLargeError and the sink would crash on it at every restart.
MAX_LETTER_BYTES = 1_000_000
MAX_REASON_BYTES = 4096
MAX_KEY_BYTES = 4096  # in a letter too big, a key over this is cut too (the SDK's keys are project/run ids)


@dataclass(frozen=True)
class Letter:
    """What is published for one dead letter: the original bytes, or their first bytes when too big."""

    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


def build_letter(msg: object, reason: str, max_bytes: int = MAX_LETTER_BYTES) -> Letter:
    """The dead letter of ``msg`` (an aiokafka ConsumerRecord): within ``max_bytes`` of key and
    value, a too-big original kept truncated, with its size and sha256 digest in the headers."""
    key, value = msg.key, msg.value  # type: ignore[attr-defined]
    headers = [
        (REASON, reason.encode()[:MAX_REASON_BYTES]),
        (SOURCE_TOPIC, msg.topic.encode()),  # type: ignore[attr-defined]
        (SOURCE_PARTITION, str(msg.partition).encode()),  # type: ignore[attr-defined]
        (SOURCE_OFFSET, str(msg.offset).encode()),  # type: ignore[attr-defined]
    ]
    cut = []
    if len(key or b"") + len(value or b"") <= max_bytes:
        return Letter(key=key, value=value, headers=headers)
    if key is not None and len(key) > MAX_KEY_BYTES:
        key, cut = key[:MAX_KEY_BYTES], ["key"]
    if value is not None and len(value) + len(key or b"") > max_bytes:
        headers += [(ORIGINAL_SIZE, str(len(value)).encode()),
                    (ORIGINAL_SHA256, hashlib.sha256(value).hexdigest().encode())]
        value, cut = value[:max_bytes - len(key or b"")], ["value", *cut]
    if cut:
        headers.append((TRUNCATED, ",".join(cut).encode()))
    return Letter(key=key, value=value, headers=headers)
