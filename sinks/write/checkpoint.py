"""When the sink commits, and in what order (as quixstreams' ``checkpointing/checkpoint.py``).

A :class:`Checkpoint` gathers the messages consumed since the last commit, by table, and the
next offset of each partition. It is due when enough rows or bytes are buffered, or about a
second after its first message while a backlog fills every poll (so each table gets about one
insert a second, of thousands of rows, however fast messages arrive), or 0.4 s after it once
the sink has caught up (live rows reach ClickHouse sooner). Committing it writes every table first, then waits for
its dead letters to reach the broker, and only then commits the Kafka offsets: a crash at any
point replays the range, and the inserts' deduplication tokens make the replay harmless.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Awaitable, Callable

from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from rlpulse.sinks.write.writer import Entry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Policy:
    """Commit when any limit is reached; ``interval`` counts from the checkpoint's first message."""

    max_rows: int = 100_000
    max_bytes: int = 64 * 1024 * 1024  # what the buffered messages take in memory, and one insert's body
    interval: float = 1.0
    # Caught up (the last poll took fewer messages than it could), a checkpoint is due this soon: live
    # rows reach ClickHouse sooner (`bench --quick`, ~28k events/s live for 5 s: p99 event -> row 1.29 s,
    # against 1.97 s with 1.0); a backlog fills every poll, so its inserts stay large and few.
    live_interval: float = 0.4


class Checkpoint:
    """The messages since the last commit, by table, and where each partition's next commit goes."""

    def __init__(self, policy: Policy, clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self._clock = clock
        self.tables: dict[str, list[Entry]] = {}
        self.offsets: dict[TopicPartition, int] = {}  # next offset to read = the one to commit
        self.rows = 0
        self.bytes = 0
        self.started: float | None = None  # clock at the first message
        self.caught_up = False  # the last poll took all there was: the live interval applies
        self._pending: list[asyncio.Future] = []  # dead letters on their way to the broker

    def _note(self, msg: Any) -> None:
        if self.started is None:
            self.started = self._clock()
        tp = TopicPartition(msg.topic, msg.partition)
        self.offsets[tp] = max(self.offsets.get(tp, 0), msg.offset + 1)
        self.bytes += len(msg.value or b"")

    def add(self, table: str, entry: Entry) -> None:
        """Buffer a message bound for ``table``."""
        self._note(entry.msg)
        self.tables.setdefault(table, []).append(entry)
        self.rows += entry.records

    def skip(self, msg: Any, delivery: asyncio.Future | None = None) -> None:
        """A message that inserts nothing (dead-lettered): its offset commits once ``delivery`` is done."""
        self._note(msg)
        if delivery is not None:
            self._pending.append(delivery)

    def polled(self, messages: int, limit: int) -> None:
        """A poll gave ``messages`` of at most ``limit``: fewer means the sink has caught up."""
        self.caught_up = messages < limit

    @property
    def empty(self) -> bool:
        return not self.offsets

    @property
    def interval(self) -> float:
        return min(self.policy.live_interval, self.policy.interval) if self.caught_up else self.policy.interval

    def due(self) -> bool:
        """Time to commit: a limit reached, or ``interval`` passed since the first message."""
        if self.empty:
            return False
        p = self.policy
        return self.rows >= p.max_rows or self.bytes >= p.max_bytes or self._clock() - self.started >= self.interval  # type: ignore[operator]

    def remaining(self) -> float:
        """Seconds until the interval makes this checkpoint due (the consumer's poll timeout)."""
        if self.started is None:
            return self.interval
        return max(0.0, self.interval - (self._clock() - self.started))

    async def commit(self, write: Callable[[str, list[Entry]], Awaitable[None]], consumer: Any) -> dict[TopicPartition, int]:
        """Write every table, wait for the dead letters, then commit offsets; returns those committed.

        ``write`` returns once its table's rows are in (it retries outages for as long as they
        last), so the commit below never runs ahead of an insert.
        """
        for table, entries in self.tables.items():
            await write(table, entries)
        if self._pending:
            await asyncio.gather(*self._pending)  # a failed delivery raises: no commit past a lost dead letter
        # Only partitions this consumer still owns: after a rebalance the new owner commits the rest.
        assigned = consumer.assignment()
        offsets = {tp: off for tp, off in self.offsets.items() if tp in assigned}
        if not offsets:
            return {}
        try:
            await consumer.commit(offsets)
            return offsets
        except (CommitFailedError, IllegalStateError, KafkaError) as exc:
            # The rows are in; the next owner replays the range and the dedup tokens absorb it.
            log.warning("offset commit refused (%s: %s); the range will be replayed", type(exc).__name__, exc)
            return {}
