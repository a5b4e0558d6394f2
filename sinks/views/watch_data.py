"""What one frame of ``rlpulse watch`` shows: plain dataclasses, no reads and no drawing.

``rlpulse.sinks.views.watch`` fills them from ClickHouse and ``rlpulse.sinks.views.watch_view`` lays them out; both import
them from here, so the view needs nothing of the module that reads the store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NS = 1_000_000_000
RECENT_S = 600.0  # a run that reported in this many seconds is shown (sinks/views/watch.py says what else is)


@dataclass(frozen=True)
class Gpu:
    hw_id: str
    host: str
    index: int | None
    utilization: float | None  # fraction 0..1 of the latest sample; None: no sample in the placement's time
    power_w: float | None
    sample_ns: int | None
    memory: float | None = None  # memory used / total (0..1) of the latest sample


@dataclass(frozen=True)
class Alert:
    rule: str
    key: str
    severity: str
    summary: str
    project: str
    run_id: str
    attempt: int
    since_ns: int  # first_seen_ns of the episode


@dataclass
class RunLine:
    project: str
    run_id: str
    attempt: int
    state: str  # RUNNING, STALLED, SILENT, ENDED
    step: int | None  # highest step of a STEP event; None before the first
    step_count: int
    steps_per_min: float | None
    reward_mean: float | None
    clipped_ratio: float | None
    failure_rate: float | None
    graded: int  # scores behind failure_rate
    first_ns: int
    last_ns: int  # the latest report
    asof_ns: int  # pace and failure rate are taken up to this: the RUN_END, or now
    gpus: list[Gpu] = field(default_factory=list)
    alerts: list[Alert] = field(default_factory=list)
    end_status: str | None = None  # RUN_END's status (finished, failed, cancelled); None while running or unknown
    metrics: dict[str, float] = field(default_factory=dict)  # the chosen trainer scalars at their latest step
    tokens_per_s: float | None = None  # of the latest STEP event (seed 001's step.throughput); None: none known

    @property
    def key(self) -> str:
        return f"{self.project}/{self.run_id}/{self.attempt}"


@dataclass
class WatchSnapshot:
    url: str
    database: str
    now_ns: int
    runs: list[RunLine]
    any_runs: bool  # the database holds step events of some run (shown or not)
    show_all: bool = False
    project: str | None = None
    recent_s: float = RECENT_S
    endpoint: str | None = None  # the sink's read endpoint, when the store is a chDB store the sink holds
    metric_names: tuple[str, ...] = ()  # trainer scalars shown as columns (``--metric``)
