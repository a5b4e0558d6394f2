"""Where this worker stands on its partitions: what it processed, committing what Faust has not,
and whether it has caught up with what was waiting when it got them.

Commits the offsets this worker has processed when Faust's own commit falls behind.

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
        # TP -> the end of the log when this worker got the partition: reached, it has caught up
        self.targets: dict[Any, int] = {}
        self._starts: dict[Any, int] = {}  # TP -> log start, for a partition the group never committed

    def done(self, message: Any) -> None:
        self.positions[message.tp] = message.offset + 1

    def forget(self, tps: set[Any]) -> None:
        """Partitions revoked: their positions belong to whoever gets them next."""
        for tp in tps:
            self.positions.pop(tp, None)
            self.targets.pop(tp, None)
            self._starts.pop(tp, None)

    async def caught_up(self, consumer: Any, tps: list[Any]) -> bool:
        """True once every message that was in ``tps`` when this worker got them is processed.

        After a restart that is the uncommitted range and all that was published while no
        worker ran; after a rebalance, what the previous owner left. The first call after an
        assignment fixes the target (the log end offsets then) and answers False, so the caller
        sees each (re)assignment as a catch-up, however short. Live traffic that arrives later
        does not hold the answer back: a busy partition is never "behind" for ever.
        """
        missing = [tp for tp in tps if tp not in self.targets]
        if missing:
            try:
                self.targets.update(await consumer.highwaters(*missing))
            except Exception as exc:  # noqa: BLE001 - a rebalance under way, the broker briefly away: ask again next tick
                log.debug("end offsets of %s not known yet: %s", missing, exc)
            return False
        committed = consumer._committed_offset  # noqa: SLF001 - see the module docstring
        for tp in tps:
            done = self.positions.get(tp)
            if done is None:
                done = committed.get(tp)
            if done is None:  # never committed: reading starts at the log's start
                if tp not in self._starts:
                    self._starts.update(await consumer.earliest_offsets(tp))
                done = self._starts.get(tp, 0)
            if done < self.targets[tp]:
                return False
        return True

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
