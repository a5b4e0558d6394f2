"""A small test harness for the stream processors, in the spirit of bytewax's ``testing.py``.

Feed messages of records and a clock, inject a crash (with or without the last state write
reaching the changelog) and a replay, and read the outputs the way ClickHouse keeps them
(the latest emission per natural key). The harness drives the same :class:`RunStage` the Faust
app drives, so what it shows is what the worker does, minus Kafka::

    h = Harness(RunConfig(window_s=10, lateness_s=2))
    h.feed("spans", [grader_span(...), ...])
    h.advance(30)                      # wall clock moves; ticks run
    h.latest("grader-failures")        # {(project, run_id, attempt, term, cause, start): record}
"""

from __future__ import annotations

import copy
import json
from typing import Any

from rlpulse.schemas.catalogue import DERIVED_TOPICS, topic_key
from rlpulse.streams.runs import Output, RunConfig, RunProcessor
from rlpulse.streams.stage import RunStage

NS = 1_000_000_000

# The natural key of each derived topic's rows (record field names), as the ClickHouse tables
# deduplicate them: the catalogue's key of the topic's table.
NATURAL_KEYS = {short: topic_key(short) for short in DERIVED_TOPICS}


class Harness:
    def __init__(self, config: RunConfig | None = None, now_ns: int = 1_000_000 * NS, partitions: int = 1):
        self.config = config or RunConfig()
        self.now_ns = now_ns
        self.partitions = partitions
        self.table: dict[str, Any] = {}  # what the changelog holds
        self.outputs: list[Output] = []
        self.fed: list[tuple[str, int, list[dict[str, Any]]]] = []  # every message fed, for replays
        self._before_last_write: dict[str, Any] = {}
        self.caught_up = True  # False from a crash until the replay: the partitions have messages waiting
        self.stage = RunStage(RunProcessor(self.config, resumed_ns=now_ns), self.table)

    # -- driving -------------------------------------------------------------------------------
    def feed(self, topic: str, records: list[dict[str, Any]], partition: int = 0) -> list[Output]:
        """Process one message of ``records`` on ``topic`` (spans or steps) at the current clock."""
        self._before_last_write = copy.deepcopy(self.table)
        self.fed.append((topic, partition, copy.deepcopy(records)))
        out = self.stage.on_message(topic, partition, copy.deepcopy(records), self.now_ns)
        self.outputs += out
        return out

    def tick(self) -> list[Output]:
        before = copy.deepcopy(self.table)
        out: list[Output] = []
        for p in range(self.partitions):
            out += self.stage.on_tick(p, self.now_ns, caught_up=self.caught_up)
        if self.table != before:  # the tick wrote state: that is now the last write a crash can lose
            self._before_last_write = before
        self.outputs += out
        return out

    def advance(self, seconds: float, step_s: float = 0.5) -> None:
        """Move the wall clock forward, ticking every ``step_s`` as the worker's timer does."""
        end = self.now_ns + int(seconds * NS)
        while self.now_ns < end:
            self.now_ns = min(self.now_ns + int(step_s * NS), end)
            self.tick()

    def crash(self, lose_last_write: bool = False) -> None:
        """Kill the worker and start a new one from the changelog.

        ``lose_last_write``: the last state write (of a message or a tick) never reached the
        changelog, though its outputs were sent (a crash between the two). Otherwise the crash came between the state write and
        the offset commit. Either way the uncommitted messages are then replayed with :meth:`replay`;
        until then the partitions are behind (ticks find messages waiting), as the worker's are,
        and the wall clock may move on (:meth:`advance`: the rebalance before the replay).
        """
        restored = self._before_last_write if lose_last_write else self.table
        self.table = json.loads(json.dumps(restored))  # what recovery reads back: plain JSON
        self.stage = RunStage(RunProcessor(self.config, resumed_ns=self.now_ns), self.table)
        self.caught_up = False

    def replay(self, last: int) -> None:
        """Feed the last ``last`` messages again, as Kafka redelivers uncommitted offsets."""
        for topic, partition, records in self.fed[-last:]:
            self.outputs += self.stage.on_message(topic, partition, copy.deepcopy(records), self.now_ns)
        self.caught_up = True

    # -- reading, as ClickHouse keeps it ------------------------------------------------------
    def latest(self, topic: str) -> dict[tuple, dict[str, Any]]:
        """Rows of ``topic`` after deduplication: the latest ``emitted_at_ns`` per natural key."""
        fields = NATURAL_KEYS[topic]
        rows: dict[tuple, dict[str, Any]] = {}
        for o in self.outputs:
            if o.topic == topic:
                key = tuple(o.record[f] for f in fields)
                if key not in rows or o.record["emitted_at_ns"] >= rows[key]["emitted_at_ns"]:
                    rows[key] = o.record
        return rows

    def alerts(self) -> list[tuple[str, str, str]]:
        """(rule, key, state) of every alert record, in order."""
        return [(o.record["rule"], o.record["key"], o.record["state"]) for o in self.outputs if o.topic == "alerts"]

    def alert_rows(self) -> list[tuple[str, str, str]]:
        """(rule, key, state) of the alerts table's rows: one per (rule, key, first_seen_ns, state), as the sink keeps them."""
        rows: dict[tuple, tuple[str, str, str]] = {}
        for o in self.outputs:
            if o.topic == "alerts":
                r = o.record
                rows.setdefault((r["rule"], r["key"], r["first_seen_ns"], r["state"]), (r["rule"], r["key"], r["state"]))
        return list(rows.values())

    def emissions(self, topic: str) -> list[dict[str, Any]]:
        return [o.record for o in self.outputs if o.topic == topic]
