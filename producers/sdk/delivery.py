"""What the sender delivers through (the ``Transport`` protocol) and how it retries.

As OpenTelemetry's ``BatchSpanProcessor`` is generic over its exporter, the sender is generic
over its transport: ``rlpulse.producers.sdk.transport.KafkaTransport`` in production,
``rlpulse.producers.sdk.memory.InMemoryTransport`` for tests and dry runs. A transport only starts,
sends a round of messages and reports each one's fate, and closes; :class:`Delivery` owns the
policy around it, the same for every transport: all of a round's messages are sent and their
results awaited together, failed ones are sent again, in their order, with backoff, a message
the destination refuses as too large is halved, and nothing is given up on until the sender
says stop (``close()`` timed out). Until then what waits stays in the sender's buffer, whose
byte bound makes new events drop and count rather than grow it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol
from collections.abc import Callable, Sequence

from rlpulse.producers.sdk.containers import MESSAGE_OVERHEAD, Container, Encoder
from rlpulse.base.errors import Error

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 5.0
MIN_LEARNED_BYTES = 4096  # the least a refusal teaches the encoder to build to (a record over it is sent alone)


class Message(Protocol):
    """One message: an Avro container (``value``) of one record type, for ``topic`` under ``key``."""

    topic: str
    key: bytes
    value: bytes


class MessageTooLarge(Error):
    """A send result: the destination refuses this message for its size (the sender halves it and resends)."""


class Transport(Protocol):
    """Carries the sender's messages. Its coroutines run on the sender thread's event loop.

    A sender thread starts (``start``), sends rounds (``send``) and closes (``close``) one
    transport; the next thread (after ``close()`` and a later event, or in a forked child) uses
    ``renew()``'s. ``refused`` says why the destination refuses our credentials, while it does.
    """

    refused: str | None

    def renew(self) -> Transport:
        """The transport for a new sender thread: the same destination, none of this one's connections."""
        ...

    async def start(self, stopping: Callable[[], bool]) -> bool:
        """Be ready to send, retrying with backoff until ready (True) or ``stopping()`` (False).
        Called before every round: cheap when already started, a reconnect after a lost one."""
        ...

    async def send(self, messages: Sequence[Message]) -> list[BaseException | None]:
        """Send all of ``messages``, in order, and await them: None for each one acknowledged, else its error."""
        ...

    def interrupt(self) -> None:
        """End any wait in ``start`` now: the sender gives up (called on the transport's loop)."""
        ...

    async def close(self) -> None:
        """Release the connection (briefly, after ``interrupt()``: the destination may be down)."""
        ...


class Delivery:
    """One sender thread's delivery through ``transport``; ``encoder`` re-encodes halves of a refused message."""

    def __init__(self, transport: Transport, encoder: Encoder):
        self.transport = transport
        self.encoder = encoder
        self._interrupted = asyncio.Event()  # binds to the loop that first waits on it: the thread's

    def interrupt(self) -> None:
        """Stop waiting for acknowledgements and backoffs now (call on the thread's loop)."""
        self._interrupted.set()
        self.transport.interrupt()

    async def _backoff(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._interrupted.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def deliver(self, containers: list[Container], on_done: Callable[[list[Container], list[int]], None],
                      stopping: Callable[[], bool]) -> list[Container]:
        """Send all, await the results together, resend failures in order with backoff.

        ``on_done(delivered, lost_sizes)`` is called as containers are acknowledged (or given up
        on). Returns what is still undelivered when ``stopping()`` turned true.
        """
        backoff = 0.1
        todo = containers
        while todo:
            if not await self.transport.start(stopping):
                return todo
            # The transport's own retries (an idempotent producer retries until the broker takes
            # a batch) may last while the destination is down: only interrupt() ends this wait.
            sending = asyncio.ensure_future(self.transport.send(todo))
            interrupted = asyncio.ensure_future(self._interrupted.wait())
            await asyncio.wait((sending, interrupted), return_when=asyncio.FIRST_COMPLETED)
            interrupted.cancel()
            if not sending.done():
                sending.cancel()
                return todo
            results = sending.result()
            delivered: list[Container] = []
            failed: list[Container] = []
            lost: list[int] = []
            error: BaseException | None = None
            for c, result in zip(todo, results):
                if result is None:
                    delivered.append(c)
                elif isinstance(result, MessageTooLarge):
                    # The destination's limit is below ours. Build every later message, and the halves
                    # of this one, to half the refused size: a half refused again while a later message
                    # of the batch went through would arrive after it, and the streams would take its
                    # records for replays (their marks are per writer, in publish order).
                    floor = MIN_LEARNED_BYTES + len(c.key) + MESSAGE_OVERHEAD
                    self.encoder.max_message_bytes = max(min(self.encoder.max_message_bytes, len(c.value) // 2), floor)
                    split: list[Container] = []
                    self.encoder.halve(split, c, lost, f"the destination refused {len(c.value)} bytes as too large")
                    failed.extend(split)
                else:
                    error = error or result
                    failed.append(c)
            on_done(delivered, lost)
            if not failed:
                return []
            if stopping():
                return failed
            if error is not None:
                log.warning("%d telemetry messages not delivered (%s: %s); retrying in %.1fs", len(failed),
                            type(error).__name__, error, backoff)
                await self._backoff(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
            todo = failed
        return []
