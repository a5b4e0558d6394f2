"""``InMemoryTransport``: a transport that keeps what it is given, for tests and dry runs.

Pass one to the SDK and nothing needs a broker; the messages are exactly what Kafka would have
received (Avro containers, per topic and key), so a test can decode them with
``rlpulse.schemas.codec.Codec`` and compare them with the calls it made::

    transport = InMemoryTransport()
    with TrainingTelemetry(project="p", run_id="r", transport=transport) as tel:
        tel.rollout(step=0, rollout_id="a", reward=1.0)
    transport.records("spans")  # [{... "kind": "ROLLOUT", "reward": 1.0, ...}]

It can be told to fail (``fail()``), as a broker that is down would: every send is refused
until ``heal()``, so a test sees the sender retry, keep the buffer, drop and count past its
byte bound, and report the undelivered count from ``flush()``. It can also refuse messages
above a size (``max_message_bytes``), as a broker with a lower ``message.max.bytes`` does.
"""

from __future__ import annotations

import threading
from typing import Any
from collections.abc import Callable, Sequence

from rlpulse.producers.sdk.delivery import Message, MessageTooLarge
from rlpulse.schemas.codec import Codec


class InMemoryTransport:
    """Thread-safe: the sender thread sends, a test reads ``messages`` and switches failures from its own."""

    def __init__(self, max_message_bytes: int | None = None):
        self.max_message_bytes = max_message_bytes  # refuse (as too large) a message whose value is longer
        self.messages: list[tuple[str, bytes, bytes]] = []  # (topic, key, value) in the order acknowledged
        self.attempts = 0  # messages offered to send(), acknowledged or not (a resend counts again)
        self.refused: str | None = None
        self._failing: BaseException | None = None
        self._failures_left: int | None = None  # None: until heal()
        self._lock = threading.Lock()

    # -- what a test switches ------------------------------------------------------------------
    def fail(self, error: BaseException | None = None, messages: int | None = None) -> None:
        """Refuse every message with ``error`` (a ConnectionError by default) until ``heal()``, or
        only the next ``messages`` messages offered."""
        with self._lock:
            self._failing = error or ConnectionError("InMemoryTransport told to fail")
            self._failures_left = messages

    def heal(self) -> None:
        with self._lock:
            self._failing = self._failures_left = None

    # -- what a test reads ---------------------------------------------------------------------
    def values(self, topic: str | None = None) -> list[bytes]:
        """The message values, in order; only ``topic``'s (a full name, or the part after the prefix) if given."""
        with self._lock:
            return [v for t, _, v in self.messages if topic is None or t == topic or t.endswith(f".{topic}")]

    def records(self, topic: str | None = None, codec: Codec | None = None) -> list[dict[str, Any]]:
        """Every record of the messages (of ``topic``), decoded, in the order they were acknowledged."""
        codec = codec or Codec()
        return [r for value in self.values(topic) for r in codec.decode(value).records]

    # -- the Transport protocol (rlpulse.producers.sdk.delivery) -----------------------------------------
    def renew(self) -> InMemoryTransport:
        return self  # one memory across the sender's threads, so a test reads everything in one place

    async def start(self, stopping: Callable[[], bool]) -> bool:
        return True

    async def send(self, messages: Sequence[Message]) -> list[BaseException | None]:
        results: list[BaseException | None] = []
        with self._lock:
            for m in messages:
                self.attempts += 1
                if self._failing is not None:
                    results.append(self._failing)
                    if self._failures_left is not None:
                        self._failures_left -= 1
                        if self._failures_left <= 0:
                            self._failing = self._failures_left = None
                elif self.max_message_bytes is not None and len(m.value) > self.max_message_bytes:
                    results.append(MessageTooLarge(f"{len(m.value)} bytes over {self.max_message_bytes}"))
                else:
                    self.messages.append((m.topic, m.key, m.value))
                    results.append(None)
        return results

    def interrupt(self) -> None:
        pass

    async def close(self) -> None:
        pass
