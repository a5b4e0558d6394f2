"""Capacity over time (seed 001): the trainer service's pool and project gauges as ``CapacitySample`` records.

The service calls :meth:`CapacityReporter.report` with what holds its GPU pools now: per pool the
devices declared and observed (None until the service has read the cluster), the devices that
claims hold (GRANTED) or wait for (QUEUED) and those claims; per training project its devices by
claim state and its quota. One record per pool and per (project, pool), on the hardware topic keyed
by the pool, through a :class:`~rlpulse.producers.sdk.sender.Sender` as the GPU poller publishes: this
is a service's call, not a training run's, so it is not on ``TrainingTelemetry``.

Every instance of the service reports the same values under its own ``instance``: readers take
the max across instances, never the sum (``sinks/read/queries/capacity.sql``, ``rlpulse capacity``).
As the seed says of the gauges, once the last claim on a pool or of a project has ended the
instance keeps reporting it at 0 until it restarts: a pool or project reported once and left out
of a later report is published again with no claims, so an idle pool reads 0 and stays visible.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any
from collections.abc import Callable, Iterable

from rlpulse.producers.sdk.sender import Outgoing, Sender
from rlpulse.base.settings import Settings

MAX_NAME = 256  # a pool, project, accelerator or instance name: the SDK's input limit for names
MAX_COUNT = 2**63 - 1


@dataclass(frozen=True)
class PoolCapacity:
    """One pool's figures: DECLARED, OBSERVED, and the devices and claims by claim state."""

    pool: str
    declared: int
    observed: int | None = None  # None: the service has not read the cluster yet
    granted: int = 0  # devices that claims hold
    queued: int = 0  # devices that claims wait for
    claims_granted: int = 0
    claims_queued: int = 0
    serving: bool = False  # the pool that serving endpoints use
    accelerator: str = "any"  # the device profile, or any


@dataclass(frozen=True)
class ProjectCapacity:
    """One training project's claims on one pool, by claim state, and its quota."""

    project: str
    pool: str
    granted: int = 0
    queued: int = 0
    quota: int | None = None


def _name(what: str, value: object, empty_ok: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty_ok):
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    if len(value) > MAX_NAME:
        raise ValueError(f"{what} is {len(value)} characters; at most {MAX_NAME} are allowed")
    return value


def _count(what: str, value: object, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise ValueError(f"{what} must be an int from 0, got {value!r}")
    return value


def _check_pool(p: PoolCapacity) -> None:
    _name("pool", p.pool)
    _name(f"pool {p.pool}: accelerator", p.accelerator)
    if not isinstance(p.serving, bool):
        raise ValueError(f"pool {p.pool}: serving must be True or False, got {p.serving!r}")
    for field in ("declared", "granted", "queued", "claims_granted", "claims_queued"):
        _count(f"pool {p.pool}: {field}", getattr(p, field))
    _count(f"pool {p.pool}: observed", p.observed, optional=True)


def _check_project(p: ProjectCapacity) -> None:
    _name("project", p.project)
    _name(f"project {p.project}: pool", p.pool)
    for field in ("granted", "queued"):
        _count(f"project {p.project}: {field}", getattr(p, field))
    _count(f"project {p.project}: quota", p.quota, optional=True)


class CapacityReporter:
    """Publishes one service instance's capacity figures; thread-safe as its sender is.

    ``sender``: one to share (the caller starts and closes it); by default the reporter makes,
    starts and (in :meth:`close`) closes its own."""

    def __init__(self, settings: Settings, instance: str, *, sender: Sender | None = None,
                 clock: Callable[[], int] = time.time_ns):
        self.instance = _name("instance", instance)
        self._own = sender is None
        self.sender = sender or Sender(settings)
        if self._own:
            self.sender.start()
        self._topic, self._clock = settings.topic("hardware"), clock
        self._pools: dict[str, PoolCapacity] = {}  # every pool reported so far, as last reported
        self._projects: dict[tuple[str, str], ProjectCapacity] = {}  # (project, pool) -> as last reported

    def report(self, pools: Iterable[PoolCapacity], projects: Iterable[ProjectCapacity] = ()) -> int:
        """Publish the figures of now; returns the records offered (pools and projects left out
        since an earlier report included, at 0 claims). ValueError naming a bad figure, before
        anything is published; records the full buffer refused are counted in ``sender.dropped``."""
        pools, projects = list(pools), list(projects)
        for p in pools:
            _check_pool(p)
        for q in projects:
            _check_project(q)
        if len({p.pool for p in pools}) < len(pools):
            raise ValueError("a pool is listed twice in one report")
        if len({(q.project, q.pool) for q in projects}) < len(projects):
            raise ValueError("a (project, pool) is listed twice in one report")
        now = self._clock()
        fresh = {p.pool: p for p in pools}
        for name, last in self._pools.items():
            fresh.setdefault(name, replace(last, granted=0, queued=0, claims_granted=0, claims_queued=0))
        claims = {(q.project, q.pool): q for q in projects}
        for key, last_claims in self._projects.items():
            claims.setdefault(key, replace(last_claims, granted=0, queued=0))
        self._pools, self._projects = fresh, claims
        out = [self._pool_record(p, now) for _, p in sorted(fresh.items())]
        out += [self._project_record(q, fresh.get(q.pool), now) for _, q in sorted(claims.items())]
        for record in out:
            self.sender.offer(Outgoing(self._topic, record["pool"], "CapacitySample", record))
        return len(out)

    def _pool_record(self, p: PoolCapacity, now: int) -> dict[str, Any]:
        return {"pool": p.pool, "serving": p.serving, "accelerator": p.accelerator, "project": "", "instance": self.instance,
                "time_ns": now, "devices_declared": p.declared, "devices_observed": p.observed,
                "devices_granted": p.granted, "devices_queued": p.queued, "claims_granted": p.claims_granted,
                "claims_queued": p.claims_queued, "quota": None}

    def _project_record(self, q: ProjectCapacity, pool: PoolCapacity | None, now: int) -> dict[str, Any]:
        # The pool's own attributes travel with it, so a project row reads alone.
        serving, accelerator = (pool.serving, pool.accelerator) if pool is not None else (False, "any")
        return {"pool": q.pool, "serving": serving, "accelerator": accelerator, "project": q.project,
                "instance": self.instance, "time_ns": now, "devices_declared": None, "devices_observed": None,
                "devices_granted": q.granted, "devices_queued": q.queued, "claims_granted": None, "claims_queued": None,
                "quota": q.quota}

    def flush(self, timeout: float = 30.0) -> int:
        """Wait for delivery; returns how many records are still undelivered."""
        return self.sender.flush(timeout)

    def close(self, timeout: float = 30.0) -> int:
        """Deliver what is buffered and close the reporter's own sender; returns the undelivered count."""
        return self.sender.close(timeout) if self._own else self.sender.flush(timeout)

    def __enter__(self) -> CapacityReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def publish_capacity(settings: Settings, instance: str, pools: Iterable[PoolCapacity],
                     projects: Iterable[ProjectCapacity] = (), timeout: float = 30.0) -> int:
    """One report from a process that reports once (a cron job): publish, deliver, close; returns
    the undelivered count."""
    with CapacityReporter(settings, instance) as reporter:
        reporter.report(pools, projects)
        return reporter.flush(timeout)
