"""What one request's observations become: per (run, attempt, writer) the Step events, per-step
figures, grader windows and placements (:class:`RunGroup`); GPU samples and capacity rows
(:func:`translate_other`). The rules are in ``metrics``'s docstring."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from collections import Counter
from typing import Any, Protocol

from rlpulse.producers.otlp import metric_points as mp
from rlpulse.producers.otlp.identity import (RUN_KEYS, SEED, Identity, OtlpRejected, Out, first, identity, integer,
                                             training_settings)
from rlpulse.schemas.catalogue import (GRADER_FAILURES_TOPIC, GRADER_WINDOWS_TOPIC, HARDWARE_TOPIC,
                                       LENGTH_HISTOGRAMS_TOPIC, REWARD_HISTOGRAMS_TOPIC, STEP_STATS_TOPIC,
                                       STEP_TERMS_TOPIC, STEPS_TOPIC, run_key)
from rlpulse.schemas.enums import RUN_STATUSES, enum_default, enum_symbols
from rlpulse.schemas.gpu_health import throttle_reason_names, xid_class



class Scratch(Protocol):
    """The translator's scratch state (``metrics.Scratch``) as this module uses it."""

    series: dict[Any, Any]
    counts: Counter[str]

    def get(self, key: Any) -> Any: ...
    def mark(self, key: Any) -> Any: ...
    def set_mark(self, key: Any, value: Any, now_ns: int) -> None: ...

RUN_START, STEP, HEARTBEAT, RUN_END, _METRICS = enum_symbols("Step", "type")
RL, SFT, OTHER = enum_symbols("Step", "trainer")
UNKNOWN_STATUS = enum_default("Step", "status")
STATUS_KEY = SEED + "run.status"
PLACEMENT_EVERY_NS = 60 * 10**9  # a placement series is re-sent at most once a minute
HELD = (mp.REWARD, mp.LENGTHS, mp.DURATION, mp.FAILURES, mp.JUDGE_TOKENS)  # differences held until their step
NEEDS_TERM = HELD[:1] + HELD[2:]


@dataclass
class Obs:
    """One data point read against its series: its value, its difference ``d`` (a level's value),
    its window (previous export or start time, point time), whether it brought anything new."""

    key: Any
    metric: str
    family: str
    labels: tuple[str, str]
    value: mp.Value
    d: mp.Value
    window: tuple[int, int]
    changed: bool
    step: int | None
    where: tuple[dict[str, Any], ...]
    total: float = 0.0


def attrs_key(attrs: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """A point's attributes as a hashable part of its series key."""
    return tuple(sorted((k, repr(v)) for k, v in attrs.items()))


def label(key: str, where: tuple[dict[str, Any], ...]) -> str:
    value = first((key,), *where)
    return "" if value is None else str(value)


@dataclass
class RunGroup:
    """The observations of one (run identity, writer) in one request."""

    ident: Identity
    writer: str
    obs: list[Obs] = field(default_factory=list)

    def translate(self, s: Scratch, now_ns: int) -> list[Out]:
        for o in self.obs:
            if o.metric in NEEDS_TERM and not o.labels[0]:
                raise OtlpRejected(f"{SEED}{o.metric}: a point without the attribute {mp.TERM_KEY}")
            if o.metric == mp.FAILURES and not o.labels[1]:
                raise OtlpRejected(f"{SEED}{o.metric}: a point without the attribute {mp.CAUSE_KEY}")
        i = self.ident
        self.base = {"project": i.project, "run_id": i.run_id, "attempt": i.attempt}
        self.key = run_key(i.project, i.run_id)
        steps, rose = self._steps(s, now_ns)
        return steps + self._figures(s, rose, now_ns) + self._windows(now_ns) + self._placements(s, now_ns)

    def _out(self, topic: str, record_type: str, record: dict[str, Any]) -> Out:
        return Out(topic, self.key, record_type, record)

    def _gauges(self, step: int | None) -> list[Obs]:
        return sorted((o for o in self.obs if o.family == "gauge" and o.step == step), key=lambda o: o.window[1])

    # -- steps --------------------------------------------------------------------------------
    def _steps(self, s: Scratch, now_ns: int) -> tuple[list[Out], int | None]:
        i = self.ident
        run_mark = ("run", i.project, i.run_id, i.attempt, self.writer)
        seq, trainer, total = s.mark(run_mark) or (0, OTHER, 0)
        events: list[dict[str, Any]] = []
        start_mark = ("start", i.project, i.run_id, i.attempt)
        if s.mark(start_mark) is None:
            s.set_mark(start_mark, 1, now_ns)
            start = self._step(RUN_START, min(o.window[1] for o in self.obs), -1, total)
            start["config"] = self._settings()
            events.append(start)
        rose: int | None = None
        for c in sorted((o for o in self.obs if o.family == "count"), key=lambda o: o.window[1]):
            trainer, total = (RL if c.metric.startswith("rl.") else SFT), int(c.total)
            assert isinstance(c.d, float)
            if c.d > 0:
                step = c.step if c.step is not None else total
                events.append(self._step(STEP, c.window[1], step, total, self._step_gauges(s, c.step)))
                if c.step is None:
                    rose = step
            else:
                events.append(self._step(HEARTBEAT, c.window[1], -1, total))
        end_mark = ("end", i.project, i.run_id, i.attempt)
        ended = [o for o in self.obs if o.family == "ended"]
        if ended and s.mark(end_mark) is None:
            s.set_mark(end_mark, 1, now_ns)
            status = label(STATUS_KEY, ended[-1].where)
            end = self._step(RUN_END, ended[-1].window[1], -1, total)
            end["status"] = status if status in RUN_STATUSES else UNKNOWN_STATUS
            events.append(end)
        for e in events:
            seq += 1
            e.update(trainer=trainer, sequence_id=seq)
        s.set_mark(run_mark, (seq, trainer, total), now_ns)
        return [self._out(STEPS_TOPIC, "Step", e) for e in events], rose

    def _settings(self) -> dict[str, str]:
        """The training settings of the group's resources (``identity.training_settings``): one in practice."""
        merged: dict[str, Any] = {}
        for o in reversed(self.obs):  # where resources differ, the first one's value of a name wins
            merged.update(o.where[-1])
        return training_settings(merged)

    def _step_gauges(self, s: Scratch, step: int | None) -> dict[str, Any]:
        g = {o.metric: float(o.value) for o in self._gauges(step) if isinstance(o.value, float)}
        tokens, throughput, mfu = int(g.get(mp.TOKENS, 0.0)), g.get(mp.THROUGHPUT, 0.0), g.get(mp.MFU)
        if mfu is not None and not 0.0 <= mfu <= 1.0:
            s.counts["mfu_out_of_range"] += 1
            mfu = None
        return {"tokens": max(tokens, 0), "throughput": throughput, "mfu": mfu,
                "duration_s": tokens / throughput if tokens > 0 and throughput > 0 else 0.0}

    def _step(self, type_: str, time_ns: int, step: int, total: int, figures: dict[str, Any] | None = None) -> dict[str, Any]:
        return {**self.ident.fields(), "time_ns": time_ns, "type": type_, "trainer": OTHER, "step": step,
                "step_count": total, "tokens": 0, "duration_s": 0.0, "throughput": 0.0, "mfu": None,
                "dropped_events": 0, "writer_id": self.writer, "sequence_id": 0, "spans_sent": 0, "metrics": {},
                "status": None, "config": {}, **(figures or {})}

    # -- per-step figures ---------------------------------------------------------------------
    def _figures(self, s: Scratch, rose: int | None, now_ns: int) -> list[Out]:
        out: list[Out] = []
        held_obs = [o for o in self.obs if o.metric in HELD]
        figure_obs = [o for o in self.obs if o.metric in HELD or o.family == "gauge"]
        for step in sorted({o.step for o in figure_obs if o.step is not None}):
            keys = self._hold(s, step, held_obs, now_ns)
            if any(o.changed for o in figure_obs if o.step == step):
                out += self._records(step, self._collect(s, keys, step), now_ns)  # a step attribute: the series' totals
        keys = self._hold(s, None, held_obs, now_ns)
        if rose is not None:
            out += self._records(rose, self._collect(s, keys, None), now_ns)
            for k in keys:  # given to this step: nothing held any more
                series = s.get(k)
                if series is not None:
                    s.series[k] = replace(series, pending=None)
            s.set_mark(self._held_mark(None), frozenset(), now_ns)
        return out

    def _held_mark(self, step: int | None) -> tuple[Any, ...]:
        return ("held", self.ident, self.writer, step)

    def _hold(self, s: Scratch, step: int | None, held_obs: list[Obs], now_ns: int) -> frozenset[Any]:
        keys = (s.mark(self._held_mark(step)) or frozenset()) | {o.key for o in held_obs if o.step == step}
        s.set_mark(self._held_mark(step), keys, now_ns)
        return keys

    def _collect(self, s: Scratch, keys: frozenset[Any], step: int | None) -> mp.StepFigures:
        f = mp.StepFigures()
        for o in self._gauges(step):
            assert isinstance(o.value, float)
            if o.metric in (mp.SHARE_MEAN, mp.SHARE_STD):
                f.shares[(o.metric, o.labels[0])] = o.value
            else:
                f.gauges[o.metric] = o.value
        for k in sorted(keys, key=repr):
            series = s.get(k)
            if series is None or series.pending is None:
                continue
            term, second, v = series.labels[0], series.labels[1], series.pending
            if series.metric == mp.REWARD and isinstance(v, mp.Hist):
                f.reward[term] = mp.add(f.reward.get(term), v)  # type: ignore[assignment]
            elif series.metric == mp.DURATION and isinstance(v, mp.Hist):
                f.duration[term] = mp.add(f.duration.get(term), v)  # type: ignore[assignment]
            elif series.metric == mp.LENGTHS and isinstance(v, mp.ExpHist):
                f.lengths = mp.add(f.lengths, v)  # type: ignore[assignment]
            elif series.metric == mp.FAILURES and isinstance(v, float):
                f.failures[term] = f.failures.get(term, 0.0) + v
            elif series.metric == mp.JUDGE_TOKENS and isinstance(v, float):
                if second in (mp.INPUT, mp.OUTPUT):
                    f.tokens[(term, second)] = f.tokens.get((term, second), 0.0) + v
        return f

    def _records(self, step: int, f: mp.StepFigures, now_ns: int) -> list[Out]:
        b = self.base
        out = [self._out(STEP_STATS_TOPIC, "StepStats", mp.step_stats(b, step, f, now_ns))] if f.has_stats() else []
        out += [self._out(REWARD_HISTOGRAMS_TOPIC, "RewardHistogram", r) for r in mp.reward_histograms(b, step, f, now_ns)]
        out += [self._out(STEP_TERMS_TOPIC, "StepTermStats", r) for r in mp.term_stats(b, step, f, now_ns)]
        if f.lengths is not None:
            out.append(self._out(LENGTH_HISTOGRAMS_TOPIC, "CompletionLengthHistogram",
                                 mp.length_histogram(b, step, f.lengths, now_ns)))
        return out

    # -- grader windows, placements -----------------------------------------------------------
    def _windows(self, now_ns: int) -> list[Out]:
        calls: dict[str, tuple[mp.Hist, tuple[int, int]]] = {}
        for o in self.obs:
            if o.metric == mp.DURATION and isinstance(o.d, mp.Hist):
                was = calls.get(o.labels[0])
                window = o.window if was is None else (min(was[1][0], o.window[0]), max(was[1][1], o.window[1]))
                calls[o.labels[0]] = (mp.add(was[0] if was else None, o.d), window)  # type: ignore[assignment]
        failed = [o for o in self.obs if o.metric == mp.FAILURES]
        out = []
        for term in sorted(set(calls) | {o.labels[0] for o in failed}):
            hist, span = calls.get(term, (None, None))
            mine = [o for o in failed if o.labels[0] == term]
            failures = sum(int(o.d) for o in mine if isinstance(o.d, float))
            graded = hist.count if hist else 0
            if not graded and not failures:
                continue  # nothing happened in this window
            window = span or (min(o.window[0] for o in mine), max(o.window[1] for o in mine))
            out.append(self._out(GRADER_WINDOWS_TOPIC, "GraderWindow",
                                 mp.grader_window(self.base, term, window, hist, failures, now_ns)))
            out += [self._out(GRADER_FAILURES_TOPIC, "GraderFailureWindow",
                              mp.failure_window(self.base, term, o.labels[1], o.window, int(o.d), graded, now_ns))
                    for o in mine if isinstance(o.d, float)]
        return out

    def _placements(self, s: Scratch, now_ns: int) -> list[Out]:
        out = []
        for o in self.obs:
            if o.family != "placement" or o.value == 0.0:
                continue
            mark = ("placed", o.key)
            last = s.mark(mark)
            if last is not None and now_ns - last < PLACEMENT_EVERY_NS:
                continue
            s.set_mark(mark, now_ns, now_ns)
            role, rank = first((ROLE_KEY,), *o.where), first((RANK_KEY,), *o.where)
            if not isinstance(role, str) or not role or rank is None:
                raise OtlpRejected(f"{SEED}job.placement: a point without {ROLE_KEY} and {RANK_KEY}")
            index = first((GPU_INDEX_KEY,), *o.where)
            record = {**self.ident.fields(), "time_ns": o.window[1], "role": role,
                      "rank": integer(rank, RANK_KEY, 0, 2**31 - 1),
                      "pod": label("k8s.pod.name", o.where), "node": label("k8s.node.name", o.where),
                      "host": label("host.name", o.where),
                      "index": None if index is None else integer(index, GPU_INDEX_KEY, 0, 2**31 - 1),
                      "hw_id": label("hw.id", o.where) or None}
            out.append(Out(HARDWARE_TOPIC, placement_key(record), "Placement", record))
        return out


# -- GPU and capacity -------------------------------------------------------------------------------
def translate_other(s: Scratch, obs: list[Obs], now_ns: int) -> list[Out]:
    """GpuSample per hw.id and CapacitySample rows of one request's GPU and pool gauges."""
    gpus: dict[str, list[Obs]] = {}
    rows: dict[tuple[str, bool, str, str, str], tuple[dict[str, float], int]] = {}
    for o in obs:
        if o.family == "gpu":
            hw = label("hw.id", o.where)
            if not hw:
                raise OtlpRejected(f"{o.metric}: a GPU figure without the attribute hw.id (the GPU's UUID)")
            gpus.setdefault(hw, []).append(o)
        else:
            row, name = _capacity_row(o)
            figures, t = rows.get(row, ({}, 0))
            figures[name] = float(o.value)  # type: ignore[arg-type]
            rows[row] = (figures, max(t, o.window[1]))
    out = [_gpu(hw, points) for hw, points in sorted(gpus.items())]
    for (pool, serving, accelerator, project, instance), (figures, t) in sorted(rows.items()):
        out.append(Out(HARDWARE_TOPIC, pool, "CapacitySample",
                       capacity_row(pool, serving, accelerator, project, instance, t, figures)))
    return out


def _gpu(hw: str, points: list[Obs]) -> Out:
    where = points[0].where
    if first(RUN_KEYS, *where) is None:  # a GPU no run holds: as the GPU poller without a placement
        run: dict[str, Any] = {"project": "", "run_id": "", "attempt": 0}
    else:
        i = identity(*where)
        run = {"project": i.project, "run_id": i.run_id, "attempt": i.attempt}
    index, rank, role = (first((k,), *where) for k in (GPU_INDEX_KEY, RANK_KEY, ROLE_KEY))
    place = {"hw_id": hw, "index": -1 if index is None else integer(index, GPU_INDEX_KEY, 0, 2**31 - 1),
             "host": label("host.name", where), "node": label("k8s.node.name", where),
             "pod": label("k8s.pod.name", where),
             "rank": None if rank is None else integer(rank, RANK_KEY, 0, 2**31 - 1),
             "role": None if role is None else str(role)}
    figures: dict[str, float] = {}
    for o in sorted(points, key=lambda o: o.window[1]):
        # a counter (XIDs, energy) as its running total; the rest as exported
        figures[GPU_FIELDS[o.metric]] = o.total if o.metric in ("gpu.xid.errors", "hw.energy") else float(o.value)  # type: ignore[arg-type]
    record = gpu_sample(run, place, figures, max(o.window[1] for o in points))
    return Out(HARDWARE_TOPIC, hw, "GpuSample", record)


def _capacity_row(o: Obs) -> tuple[tuple[str, bool, str, str, str], str]:
    state = label(STATE_KEY, o.where) or None
    if o.metric in ("pool.devices.declared", "pool.devices.observed", "project.devices.quota"):
        state = None
    name = CAPACITY_FIELDS.get((o.metric, state))
    if name is None:
        raise OtlpRejected(f"{SEED}{o.metric}: claim state {state!r}, not {GRANTED} or {QUEUED}")
    pool = label(POOL_KEY, o.where)
    project = label(PROJECT_KEY, o.where) if o.metric.startswith("project.") else ""
    instance = label(INSTANCE_KEY, o.where) or label("service.instance.id", o.where)
    serving = first((SERVING_KEY,), *o.where)
    if isinstance(serving, str):
        serving = serving.lower() == "true"
    if o.metric.startswith("pool.") and not pool:
        raise OtlpRejected(f"{SEED}{o.metric}: a point without the attribute {POOL_KEY}")
    if o.metric.startswith("project.") and not project:
        raise OtlpRejected(f"{SEED}{o.metric}: a point without the attribute {PROJECT_KEY}")
    if not instance:
        raise OtlpRejected(f"{SEED}{o.metric}: a point without the attribute {INSTANCE_KEY}")
    return (pool, bool(serving), label(ACCELERATOR_KEY, o.where) or "any", project, instance), name


# -- hardware -----------------------------------------------------------------------------------
GPU_FIELDS = {  # metric -> GpuSample field (OTel's units are the poller's: W, C, bytes, fractions 0-1, MHz)
    "hw.power": "power_w", "hw.temperature": "temperature_c", "hw.gpu.utilization": "gpu_utilization",
    "hw.gpu.memory.usage": "memory_used_bytes", "hw.gpu.memory.limit": "memory_total_bytes",
    "hw.gpu.memory.utilization": "memory_utilization", "hw.energy": "energy_mj",
    "gpu.memory.activity": "memory_activity", "gpu.clock.sm": "sm_clock_mhz",
    "gpu.clock.throttle_reasons": "throttle_reasons", "gpu.xid.errors": "xid_errors", "gpu.xid.last": "xid_last",
}
GPU_INDEX_KEY, RANK_KEY, ROLE_KEY = SEED + "gpu.index", SEED + "job.rank", SEED + "job.role"


def gpu_sample(run: dict[str, Any], where: dict[str, Any], figures: dict[str, float], time_ns: int) -> dict[str, Any]:
    """GpuSample of one hw.id. ``run``: project/run_id/attempt ('', '', 0 without a run, as the GPU
    poller writes them); ``where``: hw_id, index, host, node, pod, rank, role. A figure the export
    lacks reads 0 (the record has no null for it); memory_utilization falls back to used/limit."""
    used, total = mp.long_(figures.get("memory_used_bytes", 0.0)), mp.long_(figures.get("memory_total_bytes", 0.0))
    reasons = mp.long_(figures.get("throttle_reasons", 0.0))
    xid = figures.get("xid_last")
    return {
        **run, "time_ns": time_ns, **where,
        "power_w": figures.get("power_w", 0.0), "temperature_c": figures.get("temperature_c", 0.0),
        "gpu_utilization": figures.get("gpu_utilization", 0.0), "memory_used_bytes": used, "memory_total_bytes": total,
        "memory_utilization": figures.get("memory_utilization", used / total if total else 0.0),
        "memory_activity": figures.get("memory_activity", 0.0), "sm_clock_mhz": figures.get("sm_clock_mhz", 0.0),
        "throttle_reasons": reasons, "xid_errors": mp.long_(figures.get("xid_errors", 0.0)),
        "xid_last": None if xid is None else mp.long_(xid), "throttle_reason_names": throttle_reason_names(reasons),
        "xid_class": xid_class(None if xid is None else mp.long_(xid)), "memory_reserved_bytes": None,
        "energy_mj": None if "energy_mj" not in figures else mp.long_(figures["energy_mj"] * 1000.0),  # J -> mJ
        "nvlink_tx_bytes_per_s": None, "nvlink_rx_bytes_per_s": None, "remapped_rows_correctable": None,
        "remapped_rows_uncorrectable": None, "remap_pending": None, "remap_failure": None,
        "tensor_activity": None, "dram_activity": None,
    }


def placement_key(record: dict[str, Any]) -> str:
    """The GPU poller's key: hw_id, else host/index, else host."""
    if record["hw_id"]:
        return str(record["hw_id"])
    return f"{record['host']}/{record['index']}" if record["index"] is not None else str(record["host"])


# -- capacity ------------------------------------------------------------------------------------
POOL_KEY, SERVING_KEY, ACCELERATOR_KEY = SEED + "pool", SEED + "pool.serving", SEED + "pool.accelerator"
STATE_KEY, INSTANCE_KEY, PROJECT_KEY = SEED + "claim.state", SEED + "instance", SEED + "project"
GRANTED, QUEUED = "GRANTED", "QUEUED"
CAPACITY_FIELDS = {  # (metric, claim state or None) -> CapacitySample field
    ("pool.devices.declared", None): "devices_declared", ("pool.devices.observed", None): "devices_observed",
    ("pool.devices.claimed", GRANTED): "devices_granted", ("pool.devices.claimed", QUEUED): "devices_queued",
    ("pool.claims", GRANTED): "claims_granted", ("pool.claims", QUEUED): "claims_queued",
    ("project.devices.claimed", GRANTED): "devices_granted", ("project.devices.claimed", QUEUED): "devices_queued",
    ("project.devices.quota", None): "quota",
}


def capacity_row(pool: str, serving: bool, accelerator: str, project: str, instance: str, time_ns: int,
                 figures: dict[str, float]) -> dict[str, Any]:
    """One CapacitySample as producers/pollers/capacity.py shapes it: a pool row (project '') or a
    project row; a figure not exported is null."""
    row: dict[str, Any] = {"pool": pool, "serving": serving, "accelerator": accelerator, "project": project,
                           "instance": instance, "time_ns": time_ns}
    for name in ("devices_declared", "devices_observed", "devices_granted", "devices_queued", "claims_granted",
                 "claims_queued", "quota"):
        row[name] = mp.long_(figures[name]) if name in figures else None
    return row
