"""Commits the offsets this worker has processed when Faust's own commit falls behind.

faust-streaming 0.15.3 can stop committing a partition after a rebalance (faust-streaming #318,
robinhood/faust #681: its acked-offset bookkeeping keeps a stale entry). The figures stay exact
(replays are skipped by sequence marks), but the group's lag never reaches zero, so
``rlpulse status`` and everything that waits for the streams to catch up would hang; it was
seen here after a worker restart. Every ``interval`` seconds this commits, for each assigned
partition, the offset after the last message the agents finished, where Faust has committed
less. It goes through Faust's own commit path (``_commit_offsets``: producer flushed first, so
outputs and changelog are written before the offset moves), the one private call of the app.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class ProcessedOffsets:
    def __init__(self) -> None:
        self.positions: dict[Any, int] = {}  # TP -> offset after the last message processed here

    def done(self, message: Any) -> None:
        self.positions[message.tp] = message.offset + 1

    def forget(self, tps: set[Any]) -> None:
        """Partitions revoked: their positions belong to whoever gets them next."""
        for tp in tps:
            self.positions.pop(tp, None)

    async def commit_behind(self, consumer: Any) -> dict[Any, int]:
        """Commit what Faust has not; returns what was committed here."""
        if await consumer.maybe_wait_for_commit_to_finish():
            return {}
        assigned = consumer.assignment()
        committed = consumer._committed_offset  # noqa: SLF001 - see the module docstring
        todo = {tp: offset for tp, offset in self.positions.items()
                if tp in assigned and (committed.get(tp) or 0) < offset}
        if todo:
            await consumer._commit_offsets(todo)  # noqa: SLF001 - see the module docstring
        return todo
