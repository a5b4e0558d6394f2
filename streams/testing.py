"""A test harness for the stream processors, in the spirit of bytewax's ``testing.py``. Public:
its names are kept stable for users' own tests (docs/figures-and-alerts.md shows one).

Feed messages of records and a clock, inject a crash (with or without the last state write
reaching the changelog) and a replay, and read the outputs the way ClickHouse keeps them
(the latest emission per natural key). The harness drives the same :class:`RunStage` the Faust
app drives, so what it shows is what the worker does, minus Kafka::

    h = Harness(RunConfig(window_s=10, lateness_s=2))
    h.feed("spans", [grader_span(...), ...])
    h.advance(30)                      # wall clock moves; ticks run
    h.latest("grader-failures")        # {(project, run_id, attempt, term, cause, start): record}

:class:`WorkerHarness` drives the worker itself (:class:`rlpulse.streams.worker.StreamsWorker`, both
stages) over an in-memory broker: messages are Avro containers at offsets, and what Faust's
consumer does wrong can be injected: offsets it takes as read without handing them over (a gap,
or a catch-up's tail), ticks that arrive late, a crash and the replay of what was not committed::

    h = WorkerHarness(RunConfig(window_s=10, lateness_s=2, idle_s=5))
    h.feed("spans", [span, ...])       # offset 0, handed to the worker
    h.drop_next("spans", 2)            # the consumer skips the next two offsets
    h.append("spans", [...]); h.append("spans", [...]); h.feed("spans", [...])
    h.reads                            # [(TopicPartition("t.spans", 0), 1, 3)]: read back first
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections import defaultdict
from typing import Any
from collections.abc import Mapping

from rlpulse.schemas.catalogue import (ALERTS_TOPIC, BY_SHORT, DERIVED_TOPICS, HARDWARE_TOPICS, RUN_TOPICS,
                                       TICKS_TOPIC, topic_key)
from rlpulse.schemas.codec import Codec, short_name
from rlpulse.base.settings import AlertThresholds
from rlpulse.streams.commits import TopicPartition
from rlpulse.streams.runs import Output, RunConfig, RunProcessor
from rlpulse.streams.stage import HardwareStage, RunStage
from rlpulse.streams.worker import StreamsWorker

NS = 1_000_000_000

# The natural key of each derived topic's rows (record field names), as the ClickHouse tables
# deduplicate them: the catalogue's key of the topic's table.
NATURAL_KEYS = {short: topic_key(short) for short in DERIVED_TOPICS}


class OutputReader:
    """The outputs of a harness, read the way ClickHouse keeps them."""

    outputs: list[Output]

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
        return [(o.record["rule"], o.record["key"], o.record["state"]) for o in self.outputs if o.topic == ALERTS_TOPIC]

    def alert_rows(self) -> list[tuple[str, str, str]]:
        """(rule, key, state) of the alerts table's rows: one per (rule, key, first_seen_ns, state), as the sink keeps them."""
        rows: dict[tuple, tuple[str, str, str]] = {}
        for o in self.outputs:
            if o.topic == ALERTS_TOPIC:
                r = o.record
                rows.setdefault((r["rule"], r["key"], r["first_seen_ns"], r["state"]), (r["rule"], r["key"], r["state"]))
        return list(rows.values())

    def emissions(self, topic: str) -> list[dict[str, Any]]:
        return [o.record for o in self.outputs if o.topic == topic]


class Harness(OutputReader):
    """The run stage alone: records in, outputs out, no offsets."""

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
        self.table = dict(restored)  # what recovery reads back: the JSON bytes written
        self.stage = RunStage(RunProcessor(self.config, resumed_ns=self.now_ns), self.table)
        self.caught_up = False

    def replay(self, last: int) -> None:
        """Feed the last ``last`` messages again, as Kafka redelivers uncommitted offsets."""
        for topic, partition, records in self.fed[-last:]:
            self.outputs += self.stage.on_message(topic, partition, copy.deepcopy(records), self.now_ns)
        self.caught_up = True



class MemoryBroker:
    """What the worker sees of Kafka and the clock, in memory: its publisher, range reader,
    consumer (``rlpulse.streams.commits.ConsumerView``) and clock. Each topic partition is a list of
    message values (its log); what the worker publishes is decoded back into :attr:`outputs`,
    its ticks appended to the ``ticks`` log."""

    def __init__(self, now_ns: int, partitions: int, prefix: str = "t"):
        self.now_ns, self.partitions, self.prefix = now_ns, partitions, prefix
        self.codec = Codec()
        self.logs: dict[TopicPartition, list[bytes | None]] = defaultdict(list)
        self.log_start: dict[TopicPartition, int] = {}  # the first offset retention kept (0 if absent)
        self.group_offsets: dict[TopicPartition, int] = {}  # what the group committed
        self.reads: list[tuple[TopicPartition, int, int]] = []  # every range the worker read itself
        self.containers: list[tuple[str, str, str, int]] = []  # (topic, key, record type, records) sent
        self.outputs: list[Output] = []

    def tp(self, topic: str, partition: int = 0) -> TopicPartition:
        return TopicPartition(f"{self.prefix}.{topic}", partition)

    def wall_ns(self) -> int:
        return self.now_ns

    def monotonic_s(self) -> float:
        return self.now_ns / NS

    async def send(self, topic: str, key: bytes, value: bytes, partition: int | None = None) -> None:
        if topic == TICKS_TOPIC:
            self.logs[self.tp(TICKS_TOPIC, partition or 0)].append(value)
            return
        decoded = self.codec.decode(value)
        schema = short_name(decoded.name)
        self.containers.append((topic, key.decode(), schema, len(decoded.records)))
        self.outputs += [Output(topic, key.decode(), schema, r) for r in decoded.records]

    async def read_range(self, tp: TopicPartition, first: int, end: int) -> list[tuple[int, bytes | None]]:
        self.reads.append((tp, first, end))
        log = self.logs[tp]
        return [(o, log[o]) for o in range(max(first, self.log_start.get(tp, 0)), min(end, len(log)))]

    def committed(self, tp: TopicPartition) -> int | None:
        return self.group_offsets.get(tp)

    def highwater(self, tp: TopicPartition) -> int | None:
        return len(self.logs[tp])

    def assignment(self) -> set[TopicPartition]:
        return {self.tp(t, p) for t in (*RUN_TOPICS, *HARDWARE_TOPICS) for p in range(self.partitions)}

    async def commit_under_way(self) -> bool:
        return False

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        self.group_offsets.update(offsets)


class WorkerHarness(OutputReader):
    """The worker itself over a :class:`MemoryBroker`, both stages with dicts for tables.

    The consumer hands a partition's messages over in order from its position; :meth:`drop_next`
    makes it take offsets as read without handing them over, as faust-streaming 0.15.3 does after
    a restart. Ticks reach both agents when the wall clock moves (:meth:`advance`), or, after a
    cut-off, later and all at once, as a producer's queue delivers them once the broker is back.
    """

    def __init__(self, config: RunConfig | None = None, now_ns: int = 1_000_000 * NS, partitions: int = 1,
                 thresholds: AlertThresholds | None = None):
        self.config, self.thresholds = config or RunConfig(), thresholds or AlertThresholds()
        self.broker = MemoryBroker(now_ns, partitions)
        self.outputs = self.broker.outputs
        self.position: dict[TopicPartition, int] = {}  # the consumer's next offset to hand over
        self.dropping: dict[TopicPartition, int] = defaultdict(int)  # offsets to take as read, unseen
        self.table: dict[str, Any] = {}  # the runs table, as the changelog holds it
        self.gpus: dict[str, Any] = {}
        self._before_last_write: dict[str, Any] = {}
        self._start()

    def _start(self) -> None:
        b = self.broker
        self.stage = RunStage(RunProcessor(self.config, resumed_ns=b.now_ns), self.table)
        self.worker = StreamsWorker(b.prefix, b.partitions, self.stage, HardwareStage(self.thresholds, self.gpus),
                                    publisher=b, ranges=b, consumer=b, clock=b)
        self.position = dict(b.group_offsets)  # Kafka redelivers from the committed offsets

    @property
    def now_ns(self) -> int:
        return self.broker.now_ns

    @property
    def reads(self) -> list[tuple[TopicPartition, int, int]]:
        """Every range the worker read itself: (partition, first, end)."""
        return self.broker.reads

    # -- driving -----------------------------------------------------------------------------------
    def append(self, topic: str, records: list[dict[str, Any]], partition: int = 0, schema: str | None = None) -> int:
        """Publish one message of ``records`` to ``topic``, not yet handed to the worker; its offset."""
        value = self.broker.codec.encode(schema or short_name(BY_SHORT[topic].records[0]), records)
        log = self.broker.logs[self.broker.tp(topic, partition)]
        log.append(value)
        return len(log) - 1

    def feed(self, topic: str, records: list[dict[str, Any]], partition: int = 0,
             schema: str | None = None) -> list[Output]:
        """Publish one message and hand over what is waiting on its partition; the outputs that made."""
        self.append(topic, records, partition, schema)
        return self.deliver(topic, partition)

    def drop_next(self, topic: str, count: int = 1, partition: int = 0) -> None:
        """The consumer takes the next ``count`` offsets of the partition as read without handing them over."""
        self.dropping[self.broker.tp(topic, partition)] += count

    def deliver(self, topic: str | None = None, partition: int | None = None) -> list[Output]:
        """The consumer hands over what is waiting (on ``topic``/``partition``, or everywhere, ticks last)."""
        before = len(self.outputs)
        for t in (topic,) if topic else dict.fromkeys((*RUN_TOPICS, *HARDWARE_TOPICS)):
            for p in (partition,) if partition is not None else range(self.broker.partitions):
                self._hand_over(self.broker.tp(t, p))
        return self.outputs[before:]

    def _hand_over(self, tp: TopicPartition) -> None:
        log, short = self.broker.logs[tp], self.worker.short(tp.topic)
        # ticks reach both agents, as both subscribe to them
        lanes = [lane for lane in (self.worker.runs, self.worker.gpus) if short == TICKS_TOPIC or short in lane.sources]
        while (offset := self.position.get(tp, 0)) < len(log):
            self.position[tp] = offset + 1
            if self.dropping[tp]:
                self.dropping[tp] -= 1
                continue
            for lane in lanes:
                before = copy.deepcopy(self.table)
                asyncio.run(self.worker.on_event(lane, tp, offset, log[offset]))
                if self.table != before:  # this event wrote state: now the last write a crash can lose
                    self._before_last_write = before

    def tick(self, cut_off: bool = False) -> list[Output]:
        """The worker's timer sends its ticks; unless ``cut_off``, they (and any queued) reach the agents."""
        before = len(self.outputs)
        asyncio.run(self.worker.send_ticks())
        if not cut_off:
            self.deliver(TICKS_TOPIC)
        return self.outputs[before:]

    def advance(self, seconds: float, step_s: float = 0.5, cut_off: bool = False) -> list[Output]:
        """Move the wall clock forward, ticking every ``step_s`` as the worker's timer does.
        ``cut_off``: the ticks queue meanwhile (the broker is out of reach), to arrive late."""
        before, end = len(self.outputs), self.now_ns + int(seconds * NS)
        while self.now_ns < end:
            self.broker.now_ns = min(self.now_ns + int(step_s * NS), end)
            self.tick(cut_off)
        return self.outputs[before:]

    def commit(self) -> dict[TopicPartition, int]:
        """Commit what the worker processed (here its commit of what Faust left behind does it all)."""
        return asyncio.run(self.worker.commit_behind())

    def crash(self, lose_last_write: bool = False) -> None:
        """Kill the worker and start a new one from the changelog and the group's committed offsets.

        ``lose_last_write``: the last state write (of a message or a tick) never reached the
        changelog, though its outputs were sent. Nothing is handed over until :meth:`deliver` (the
        replay) or :meth:`advance` (ticks, which find messages waiting)."""
        restored = self._before_last_write if lose_last_write else self.table
        self.table = dict(restored)  # what recovery reads back: the JSON bytes written
        self.gpus = json.loads(json.dumps(self.gpus))
        self._start()
