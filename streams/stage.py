"""Processors bound to a table: load a key's state, apply a message or a tick, write it once.

The Faust app gives these its tables; the test harness (``rlpulse.streams.testing``) gives them dicts.
Either way the table is written once per message (one changelog record), never per event.

A run's state goes into its table as JSON bytes (:func:`dump_state`), the changelog's raw value:
Faust's serializer registry cost more than the serializing itself, and a worker holding bytes
for 1,000 runs needs less memory than one holding their dicts. State an older worker wrote
through Faust's json serializer is the same JSON, so it restores.

A Faust table can only be written while an event of the partition that owns the key is being
processed (its changelog goes to that partition), so a tick for partition ``p`` only touches
states whose ``partition`` is ``p``: the partition whose message last wrote them.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Protocol
from collections.abc import MutableMapping

import orjson

from rlpulse.schemas.catalogue import ALERTS_TOPIC, engine_key, run_key
from rlpulse.base.settings import AlertThresholds
from rlpulse.streams import compiled
from rlpulse.streams.alerting import AlertBook, engine_saturated, hardware, hardware_tick
from rlpulse.streams.runs import Output, Run, RunProcessor, often

log = logging.getLogger(__name__)


class Stage(Protocol):
    """What the worker (``rlpulse.streams.worker``) drives, for either agent: a message's records, or a tick."""

    def on_message(self, topic: str, partition: int, records: list[dict[str, Any]], now_ns: int) -> list[Output]:
        """The records of one message of ``topic`` (a short name) on ``partition``; the outputs to publish."""
        ...

    def on_tick(self, partition: int, now_ns: int, caught_up: bool = True) -> list[Output]:
        """Wall-clock work for the states of ``partition``; ``caught_up``: see :meth:`RunStage.on_tick`."""
        ...


class RunStage:
    def __init__(self, processor: RunProcessor, table: MutableMapping[str, Any]):
        self.processor = processor
        self.table = table
        # key -> (the value last written, the live Run it came from): no rebuild while they agree
        self._cache: dict[str, tuple[Any, Run]] = {}
        # key -> (a value this worker did not write, the partition it names): see on_tick
        self._partitions: dict[str, tuple[Any, int]] = {}

    def _load(self, key: str, project: str, run_id: str, partition: int, value: Any = None) -> Run:
        value = self.table.get(key) if value is None else value
        cached = self._cache.get(key)
        if cached is not None and cached[0] is value:
            return cached[1]
        return Run.from_dict(load_state(value)) if value else Run(project, run_id, partition)

    def _store(self, key: str, run: Run) -> None:
        value = dump_state(run.to_dict())
        self.table[key] = value
        self._cache[key] = (value, run)

    def on_message(self, topic: str, partition: int, records: list[dict[str, Any]], now_ns: int) -> list[Output]:
        """One message of ``spans`` or ``steps`` (normally of one run; grouped in case it is not)."""
        by_run: dict[str, list[dict[str, Any]]]
        if compiled.LOOPS is not None and compiled.LOOPS.one_run(records):  # a key per record cost ~5% of the CPU
            by_run = {run_key(records[0]["project"], records[0]["run_id"]): records}
        else:
            by_run = defaultdict(list)
            for r in records:
                by_run[run_key(r["project"], r["run_id"])].append(r)
        out: list[Output] = []
        config, processor = self.processor.config, self.processor
        for key, rs in by_run.items():
            project, run_id = rs[0]["project"], rs[0]["run_id"]
            if len(project) > config.max_name or len(run_id) > config.max_name:
                processor.names_refused += len(rs)
                if often(processor.names_refused - len(rs), processor.names_refused):
                    log.warning("%d %s records refused: project of %d and run_id of %d characters, at most %d each "
                                "(%d refused on this worker)", len(rs), topic, len(project), len(run_id),
                                config.max_name, processor.names_refused)
                continue
            value = self.table.get(key)
            if not value and len(self.table) >= config.max_runs:
                processor.runs_refused += len(rs)
                if often(processor.runs_refused - len(rs), processor.runs_refused):
                    log.error("%d %s records of the new run %s refused: this worker holds %d runs, at most %d; "
                              "the run's figures start once ended runs expire (%d records refused on this worker)",
                              len(rs), topic, key, len(self.table), config.max_runs, processor.runs_refused)
                continue
            run = self._load(key, project, run_id, partition, value)
            run.partition = partition
            out += self.processor.on_records(run, topic, rs, now_ns)
            self._store(key, run)
        return out

    def on_tick(self, partition: int, now_ns: int, caught_up: bool = True) -> list[Output]:
        """Wall-clock work for the runs of ``partition``.

        ``caught_up`` is False while the partition still has messages that were waiting when
        this worker got it (after a restart: the uncommitted replay and what was published
        while no worker ran). Then nothing here is due: a run whose messages are still in Kafka
        is not idle or silent, and silence counts only from the end of the catch-up.
        """
        if not caught_up:
            self.processor.behind(partition, now_ns)
            return []
        out: list[Output] = []
        for key, value in list(self.table.items()):
            if not value:
                continue
            cached = self._cache.get(key)
            if cached is not None and cached[0] is value:
                run = cached[1]
                if run.partition != partition:
                    continue
            else:
                # Restored from the changelog, or a standby copy another worker keeps writing:
                # read once per value for its partition, and a Run only for this partition's.
                seen = self._partitions.get(key)
                if seen is None or seen[0] is not value:
                    state = load_state(value)
                    seen = self._partitions[key] = (value, state["partition"])
                    if seen[1] == partition:
                        self._cache[key] = (value, Run.from_dict(state))
                if seen[1] != partition:
                    continue
                cached = self._cache.get(key)
                if cached is None or cached[0] is not value:
                    cached = self._cache[key] = (value, Run.from_dict(load_state(value)))
                run = cached[1]
            outputs, changed = self.processor.on_tick(run, now_ns)
            out += outputs
            if self.processor.expired(run, now_ns):
                del self.table[key]
                self._cache.pop(key, None)
            elif changed:
                self._store(key, run)
        if len(self._cache) + len(self._partitions) > 2 * len(self.table) + 64:
            # keys deleted by another worker's tombstones, or partitions that moved away
            self._cache = {k: v for k, v in self._cache.items() if k in self.table}
            self._partitions = {k: v for k, v in self._partitions.items() if k in self.table}
        return out


def dump_state(state: dict[str, Any]) -> bytes:
    """A run's state as its table value: JSON bytes (non-string keys as JSON would write them)."""
    return orjson.dumps(state, option=orjson.OPT_NON_STR_KEYS)


def load_state(value: bytes | str | dict[str, Any]) -> dict[str, Any]:
    """A table value back into the state dict (a dict as it is: a table that holds dicts)."""
    return value if isinstance(value, dict) else orjson.loads(value)


ENGINE_STATE = "engine:"  # the table key of an engine's state: this + engine_key (GPU states are keyed by UUID)
ENGINE_FORGET_NS = 3600 * 10**9  # an engine unheard of this long, with no alert open, leaves the table
MAX_ENGINES = 10_000  # engines in the table; samples of more are refused and counted
MAX_ENGINE_KEY = 2048  # characters (the poller's URLs are at most 1024)


class HardwareStage:
    """XID and hardware-slowdown alerts per GPU, state keyed by ``hw_id``; ``engine_saturated`` per
    vLLM engine, state keyed ``engine:<engine_key>``. Placements and capacity carry no figure a rule reads.

    A GPU (an engine) has one poller, whose samples are in time order: a sample no newer than the
    last one applied is a replay and is skipped (the poller's time is its mark, as sequence ids are a run's).
    """

    def __init__(self, thresholds: AlertThresholds, table: MutableMapping[str, Any]):
        self.thresholds = thresholds
        self.table = table
        self.engines_refused = 0  # engine samples refused: a key over MAX_ENGINE_KEY, or the table full

    def _engine(self, partition: int, sample: dict[str, Any], now_ns: int, states: dict[str, dict[str, Any]]) -> list[Output]:
        """One EngineSample through the engine_saturated rule; its state is written with the message's."""
        key = ENGINE_STATE + engine_key(sample.get("pod", ""), sample["url"], sample.get("engine", ""))
        state = states.get(key) or self.table.get(key)
        # the count of engines walks the table: only once the table could hold MAX_ENGINES of them (a walk per
        # new engine made the first samples of many engines quadratic)
        if state is None and (len(key) > MAX_ENGINE_KEY or (len(self.table) >= MAX_ENGINES and sum(
                k.startswith(ENGINE_STATE) for k in self.table) >= MAX_ENGINES)):
            self.engines_refused += 1
            if often(self.engines_refused - 1, self.engines_refused):
                log.warning("engine sample refused: a key of %d characters (at most %d) or %d engines held already "
                            "(%d refused on this worker)", len(key), MAX_ENGINE_KEY, MAX_ENGINES, self.engines_refused)
            return []
        state = state or {}
        if sample["time_ns"] <= state.get("mark", -1):
            return []
        # .get: a GPU sample whose hw_id someone made "engine:..." writes this key too; it must not crash the lane
        state = states[key] = {"partition": partition, "gpu": dict(state.get("gpu") or {}),
                               "engine": dict(state.get("engine") or {}), "alerts": dict(state.get("alerts") or {}),
                               "mark": sample["time_ns"], "seen_ns": now_ns}
        alerts = engine_saturated(AlertBook(state["alerts"]), state["engine"], sample, self.thresholds, now_ns)
        return [Output(ALERTS_TOPIC, a["key"], "Alert", a) for a in alerts]

    def on_message(self, topic: str, partition: int, records: list[dict[str, Any]], now_ns: int) -> list[Output]:
        """Samples and placements of ``hardware`` (the only topic here)."""
        out: list[Output] = []
        states: dict[str, dict[str, Any]] = {}
        for sample in records:
            if "kv_cache_usage" in sample:  # an EngineSample
                out += self._engine(partition, sample, now_ns, states)
                continue
            if "throttle_reasons" not in sample:  # placements and capacity carry no figures
                continue
            hw_id = sample["hw_id"]
            state = states.get(hw_id) or dict(self.table.get(hw_id) or {"gpu": {}, "alerts": {}, "mark": -1})
            if sample["time_ns"] <= state.get("mark", -1):
                continue
            state = states[hw_id] = {"partition": partition, "gpu": dict(state["gpu"]), "alerts": dict(state["alerts"]),
                                     "mark": sample["time_ns"]}
            # an episode's first_seen_ns is the sample's time: the same record if a replay fires it again
            alerts = hardware(AlertBook(state["alerts"]), state["gpu"], sample, self.thresholds, now_ns,
                              since_ns=sample["time_ns"])
            out += [Output(ALERTS_TOPIC, a["key"], "Alert", a) for a in alerts]
        for hw_id, state in states.items():
            if state != self.table.get(hw_id):  # most samples change nothing: no changelog write for them
                self.table[hw_id] = state
        return out

    def on_tick(self, partition: int, now_ns: int, caught_up: bool = True) -> list[Output]:
        """XID alerts that have been quiet long enough resolve. ``caught_up`` is not consulted: the
        worker follows catch-ups for the runs' inputs only, and always passes True here."""
        out: list[Output] = []
        for hw_id, value in list(self.table.items()):
            if not value or value["partition"] != partition:
                continue
            idle_ns = now_ns - value.get("seen_ns", now_ns)
            if hw_id.startswith(ENGINE_STATE) and not value["alerts"] and idle_ns > ENGINE_FORGET_NS:
                del self.table[hw_id]  # an engine of a run long over: its streak and mark are of no use
                continue
            state = {**value, "gpu": dict(value["gpu"]), "alerts": dict(value["alerts"])}
            alerts = hardware_tick(AlertBook(state["alerts"]), state["gpu"], self.thresholds, now_ns)
            if alerts:
                self.table[hw_id] = state
                out += [Output(ALERTS_TOPIC, a["key"], "Alert", a) for a in alerts]
        return out
