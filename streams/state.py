"""State for the stream processors that Faust tables can hold.

A Faust table may only be written while an event of the partition that owns the key is
being processed (its changelog goes to that partition). :class:`PartitionView` gives each
partition its own slice of a table (keys prefixed with the partition), so processors that
keep per-key state write only keys of the partition whose event, or tick, they handle, and
iterate only their own keys.
"""

from __future__ import annotations

from typing import Any, Iterator, MutableMapping

# The app's Faust tables. Their changelog topics are created before the worker starts (see
# rlpulse.topics): Faust creating them itself after its first assignment causes a second
# rebalance at once, after which Faust may never commit some partitions (faust-streaming #318).
TABLES = ("grader-windows", "step-partials", "step-merge", "stalls", "step-rules", "run-alerts", "gpus", "gpu-alerts")


class PartitionView(MutableMapping[str, Any]):
    def __init__(self, table: MutableMapping[str, Any], partition: int):
        self._table = table
        self._prefix = f"{partition}|"

    def __getitem__(self, key: str) -> Any:
        value = self._table.get(self._prefix + key)
        if value is None:  # Faust stores a deletion as None until compaction
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        self._table[self._prefix + key] = value

    def __delitem__(self, key: str) -> None:
        if self._prefix + key not in self._table:
            raise KeyError(key)
        del self._table[self._prefix + key]

    def __iter__(self) -> Iterator[str]:
        n = len(self._prefix)
        for key in list(self._table.keys()):
            if key.startswith(self._prefix) and self._table.get(key) is not None:
                yield key[n:]

    def __len__(self) -> int:
        return sum(1 for _ in self)
