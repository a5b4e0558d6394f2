"""OTLP metrics -> rlpulse records (seed 001's metric names; the table is in docs/otel.md).

:class:`MetricTranslator` keeps per-series state so that cumulative points can be differenced.
A *series* is a metric name + the run identity and writer + the step attribute + the point's own
attributes. A request is translated all or nothing: its changes are made on a scratch overlay and
committed only when every point was read; an :class:`OtlpRejected` leaves the state as it was.

Temporality. CUMULATIVE sums and histograms (explicit and exponential) give ``current - previous``;
the series starts again (the difference is the whole value) when start_time_unix_nano changed, a
value went down, the bounds changed or an exponential scale went up. A scale that went down is
handled by downscaling the previous point. DELTA points are taken as they are. A series seen for
the first time counts its whole value. min/max: see ``metric_points``.

The step of per-step figures (StepStats, RewardHistogram, StepTermStats, CompletionLengthHistogram):
- points with the step attribute (``akka.optimize.training.rl.step``) belong to that step; as the
  step is part of the series, the figure is the series' total since first sight, re-sent (latest
  wins) whenever a series of that step changed;
- otherwise the step is the value of ``rl.step.count`` / ``sft.step.count`` of the same run,
  attempt and writer in the same request, when that count rose in it;
- otherwise (the count did not rise, or no counter came: a periodic export between two steps, or
  a delta export with nothing new on the counter) the differences are *held* in the series' state
  and join the next step's figures; gauges of such an export are not used (the job keeps exporting
  them at their last value). Nothing is refused for lacking a step.
A count that rose by more than one between two exports gives one STEP (step = the count) whose
figures cover those steps together: exact per-step figures need one export per step.
Grader windows (GraderWindow, GraderFailureWindow) are per export, not per step: window_start_ns is
the previous export time of the series (the point's start time for delta points and first sight),
window_end_ns the point's time.

Steps: RUN_START on the first sight of a (project, run, attempt); STEP when the count rose (step =
the count or the step attribute, tokens/throughput/mfu from the gauges, duration_s = tokens /
throughput), HEARTBEAT when it did not; RUN_END on the first ``run.ended`` point. writer_id is
``otlp/`` + service.instance.id (else service.name); sequence_id is a dense counter per (project,
run, attempt, writer) from 1 kept in this state, which the ingest replaces by the Kafka position of
the request (``rlpulse.producers.otlp.ingest.number``: a replay repeats it, a restart does not reuse it).

Bounds: series and marks not seen for SERIES_TTL_NS are forgotten; a request that would hold more
than MAX_SERIES series, or has more than MAX_POINTS points, is refused (counted in ``counts``).
Metric names rlpulse does not translate are ignored and counted per name in ``ignored``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality

from rlpulse.producers.otlp import metric_points as mp
from rlpulse.producers.otlp.identity import SEED, Identity, OtlpRejected, Out, attributes, identity, step_of
from rlpulse.producers.otlp.metric_runs import CAPACITY_FIELDS, GPU_FIELDS, Obs, RunGroup, attrs_key, translate_other
from rlpulse.schemas.codec import Codec

SERIES_TTL_NS = 3600 * 10**9  # a series (and a run's sequence) not seen for an hour is forgotten
SWEEP_EVERY_NS = 60 * 10**9
MAX_SERIES = 100_000
MAX_POINTS = 50_000  # per request
MAX_IGNORED_NAMES = 256  # names counted one by one in ``ignored``; beyond, under "(other)"
DELTA = AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA
CUMULATIVE = AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE

LEVEL = ("gauge", "sum")  # a Gauge, or an UpDownCounter's cumulative Sum read as a level
# short metric name -> (family, the OTLP data kinds accepted)
SPECS: dict[str, tuple[str, tuple[str, ...]]] = {
    "rl.step.count": ("count", ("sum",)), "sft.step.count": ("count", ("sum",)),
    "run.ended": ("ended", LEVEL), "job.placement": ("placement", LEVEL),
    "rl.rollout.reward": ("reward", ("histogram",)), "rl.grader.duration": ("duration", ("histogram",)),
    "rl.rollout.completion.length": ("lengths", ("exponential_histogram",)),
    "rl.grader.failures": ("failures", ("sum",)), "rl.grader.tokens": ("tokens", ("sum",)),
    **{g: ("gauge", LEVEL) for g in (*mp.STATS_GAUGES, mp.TOKENS, mp.THROUGHPUT, mp.MFU, mp.SHARE_MEAN, mp.SHARE_STD)},
    **{g: ("gpu", LEVEL) for g in GPU_FIELDS},
    **{m: ("pool", LEVEL) for m, _ in CAPACITY_FIELDS},
}
COUNTERS = {"gpu.xid.errors", "hw.energy"}  # GPU figures that are counters: their running total
RUN_FAMILIES = {"count", "ended", "placement", "reward", "duration", "lengths", "failures", "tokens", "gauge"}


def short_name(name: str) -> str:
    return name[len(SEED):] if name.startswith(SEED) else name


@dataclass(frozen=True)
class Series:
    """One series' state: its last cumulative value (None for delta points), its running total
    (sums), the differences not yet given to a step (``pending``) and when it was seen."""

    metric: str
    labels: tuple[str, str]  # (term, cause or token type)
    start_ns: int
    time_ns: int
    last: mp.Value | None
    total: float
    pending: mp.Value | None
    seen_ns: int


class Scratch:
    """A request's changes over the translator's state, committed only when it is all read."""

    def __init__(self, series: dict[Any, Series], marks: dict[Any, tuple[Any, int]]):
        self._series, self._marks = series, marks
        self.series: dict[Any, Series] = {}
        self.marks: dict[Any, tuple[Any, int]] = {}
        self.counts: Counter[str] = Counter()
        self.ignored: Counter[str] = Counter()

    def get(self, key: Any) -> Series | None:
        return self.series[key] if key in self.series else self._series.get(key)

    def mark(self, key: Any) -> Any:
        got = self.marks[key] if key in self.marks else self._marks.get(key)
        return None if got is None else got[0]

    def set_mark(self, key: Any, value: Any, now_ns: int) -> None:
        self.marks[key] = (value, now_ns)

    def new_series(self) -> int:
        return sum(1 for k in self.series if k not in self._series)


def _is_zero(d: mp.Value) -> bool:
    return d == 0.0 if isinstance(d, float) else d.count == 0


def _sub(cur: mp.Value, prev: mp.Value) -> mp.Value | None:
    if isinstance(cur, float) and isinstance(prev, float):
        return cur - prev if cur >= prev else None
    if isinstance(cur, mp.Hist) and isinstance(prev, mp.Hist):
        return mp.hist_sub(cur, prev)
    if isinstance(cur, mp.ExpHist) and isinstance(prev, mp.ExpHist):
        return mp.exp_sub(cur, prev)
    return None


class MetricTranslator:
    """OTLP metric export requests -> rlpulse records, with the state cumulative points need."""

    def __init__(self, max_series: int = MAX_SERIES, ttl_ns: int = SERIES_TTL_NS):
        self.max_series, self.ttl_ns = max_series, ttl_ns
        self._series: dict[Any, Series] = {}
        self._marks: dict[Any, tuple[Any, int]] = {}  # run sequences, starts, ends, placements, held figures
        self._swept_ns = 0
        self._codec = Codec()
        self.counts: Counter[str] = Counter()  # requests, rejected, series_cap, mfu_out_of_range, ...
        self.ignored: Counter[str] = Counter()  # metric name -> points ignored (not translated)

    @property
    def series_count(self) -> int:
        return len(self._series)

    def translate(self, request: ExportMetricsServiceRequest, now_ns: int) -> list[Out]:
        """The records of ``request``; OtlpRejected (state unchanged) naming what was wrong."""
        try:
            scratch = Scratch(self._series, self._marks)
            out = self._translate(scratch, request, now_ns)
            self._check(out)
            self._commit(scratch, now_ns)
        except OtlpRejected:
            self.counts["rejected"] += 1
            raise
        self.counts["requests"] += 1
        return out

    # -- reading -----------------------------------------------------------------------------
    def _translate(self, s: Scratch, request: ExportMetricsServiceRequest, now_ns: int) -> list[Out]:
        points = sum(len(getattr(m, m.WhichOneof("data")).data_points) for rm in request.resource_metrics
                     for sm in rm.scope_metrics for m in sm.metrics if m.WhichOneof("data"))
        if points > MAX_POINTS:
            raise OtlpRejected(f"{points} data points in one request, more than {MAX_POINTS}")
        groups: dict[tuple[Identity, str], RunGroup] = {}
        other: list[Obs] = []
        for rm in request.resource_metrics:
            res = attributes(rm.resource.attributes)
            for sm in rm.scope_metrics:
                scope = attributes(sm.scope.attributes)
                for metric in sm.metrics:
                    self._read_metric(s, metric, (scope, res), groups, other, now_ns)
        out: list[Out] = []
        for group in groups.values():
            out += group.translate(s, now_ns)
        return out + translate_other(s, other, now_ns)

    def _read_metric(self, s: Scratch, metric: Any, scopes: tuple[dict[str, Any], dict[str, Any]],
                     groups: dict[tuple[Identity, str], RunGroup], other: list[Obs], now_ns: int) -> None:
        name = short_name(metric.name)
        spec, kind = SPECS.get(name), metric.WhichOneof("data")
        if spec is None or kind is None:
            s.ignored[metric.name if len(self.ignored) + len(s.ignored) < MAX_IGNORED_NAMES else "(other)"] += 1
            return
        family, kinds = spec
        if kind not in kinds:
            raise OtlpRejected(f"{metric.name}: a {kind} where rlpulse reads a {' or '.join(kinds)}")
        data = getattr(metric, kind)
        temporality = getattr(data, "aggregation_temporality", None)
        if kind != "gauge" and temporality not in (DELTA, CUMULATIVE):
            raise OtlpRejected(f"{metric.name}: aggregation temporality unspecified")
        level = family not in ("count", "reward", "duration", "lengths", "failures", "tokens") and name not in COUNTERS
        if kind == "sum" and level and temporality == DELTA:
            raise OtlpRejected(f"{metric.name}: a delta sum where rlpulse reads a level (a gauge or cumulative sum)")
        for point in data.data_points:
            pattrs = attributes(point.attributes)
            where = (pattrs, *scopes)
            if kind == "histogram":
                value: mp.Value = mp.histogram(point, metric.name)
            elif kind == "exponential_histogram":
                value = mp.exponential(point, metric.name)
            else:
                value = mp.number(point, metric.name, counter=not level)
            if family in RUN_FAMILIES:
                ident, writer = identity(*where), _writer(where)
                step = step_of(*where)
                key = (name, ident, writer, step, attrs_key(pattrs))
                obs = self._observe(s, key, name, family, point, value, temporality, where, step, now_ns, level)
                group = groups.get((ident, writer))
                if group is None:
                    group = groups[(ident, writer)] = RunGroup(ident, writer)
                group.obs.append(obs)
            else:
                other_key = (name, family, attrs_key(pattrs), attrs_key(scopes[1]))
                other.append(self._observe(s, other_key, name, family, point, value, temporality, where, None, now_ns, level))

    def _observe(self, s: Scratch, key: Any, name: str, family: str, point: Any, value: mp.Value,
                 temporality: int | None, where: tuple[dict[str, Any], ...], step: int | None, now_ns: int,
                 level: bool) -> Obs:
        """Difference one point against its series (in the scratch state) and say what it brings."""
        prev = s.get(key)
        start, t = int(point.start_time_unix_nano), int(point.time_unix_nano)
        labels = (_label(mp.TERM_KEY, where), _label(mp.CAUSE_KEY, where) or _label(mp.TOKEN_TYPE_KEY, where))
        if level:  # a level: no difference; changed when first seen or different
            changed = prev is None or prev.last != value
            s.series[key] = Series(name, labels, start, t, value, 0.0, None, now_ns)
            return Obs(key, name, family, labels, value, value, (t, t), changed, step, where)
        last: mp.Value | None = None
        d: mp.Value | None = None
        window_start = start or t
        if temporality == DELTA:
            d = value
            total = (prev.total if prev else 0.0) + (value if isinstance(value, float) else 0.0)
        else:
            last = value
            total = value if isinstance(value, float) else 0.0
            if prev is not None and prev.last is not None and prev.start_ns == start:
                d = _sub(value, prev.last)
                if d is not None:
                    window_start = prev.time_ns
            if d is None:  # first sight, or the series started again: the whole value is new
                d = value
        pending = mp.add(prev.pending if prev else None, d)
        changed = prev is None or not _is_zero(d)
        s.series[key] = Series(name, labels, start, t, last, total, pending, now_ns)
        return Obs(key, name, family, labels, value, d, (window_start, t), changed, step, where, total)

    def _check(self, out: list[Out]) -> None:
        """Refuse (before the state changes) a request whose records the ingest could not encode: a
        value past an Avro long (a step count of 1e30) would otherwise be dead-lettered after commit."""
        for o in out:
            try:
                self._codec.encode(o.record_type, [o.record])
            except ValueError as exc:
                raise OtlpRejected(f"a value out of range: {str(exc)[:300]}") from None

    # -- state ------------------------------------------------------------------------------
    def _commit(self, s: Scratch, now_ns: int) -> None:
        if len(self._series) + s.new_series() > self.max_series:
            self._sweep(now_ns)
            if len(self._series) + s.new_series() > self.max_series:
                self.counts["series_cap"] += 1
                raise OtlpRejected(f"this request would hold more than {self.max_series} series: too many "
                                   "series (attribute values that vary without bound?)")
        self._series.update(s.series)
        self._marks.update(s.marks)
        self.counts.update(s.counts)
        self.ignored.update(s.ignored)
        if now_ns - self._swept_ns >= SWEEP_EVERY_NS:
            self._sweep(now_ns)

    def _sweep(self, now_ns: int) -> None:
        """Forget series and marks not seen for ttl_ns; drop forgotten series from the held sets."""
        old = now_ns - self.ttl_ns
        self._series = {k: v for k, v in self._series.items() if v.seen_ns >= old}
        marks = {}
        for k, (value, seen) in self._marks.items():
            if seen < old:
                continue
            if isinstance(value, frozenset):
                value = frozenset(x for x in value if x in self._series)
            marks[k] = (value, seen)
        self._marks = marks
        self._swept_ns = now_ns


def _label(key: str, where: tuple[dict[str, Any], ...]) -> str:
    for scope in where:
        value = scope.get(key)
        if value is not None and value != "":
            return str(value)
    return ""


def _writer(where: tuple[dict[str, Any], ...]) -> str:
    name = _label("service.instance.id", where) or _label("service.name", where)
    return f"otlp/{name}" if name else "otlp"

