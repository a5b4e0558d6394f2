"""Stalled and silent training runs, from the step topic (seed 001, "Alert on a stalled run").

A job exports its ``step_count`` at every heartbeat while it runs. Per (run, attempt):

- ``stalled_run`` fires when the count has not increased for the attempt's *stall window* while
  the job still reports (its last report is less than ``silent_after`` old); it resolves when the
  count increases. The window follows the run's own step time, as the seed asks ("Base the window
  on the usual step time of the run"): ``factor`` x the median of the last ``HISTORY`` intervals
  between step_count increases, clamped to [min(``stall_min``, ``stall_after``), ``stall_max``].
  Before any interval is known the window is ``stall_after``. The ceiling is ``stall_max``, not
  ``stall_after``: a run whose normal step is slower than ``stall_after`` must not fire on every
  step; the floor never exceeds ``stall_after``, so a run with history never waits longer than
  the global window just because of the floor.
- ``first_step_stalled`` fires when a job that has not completed its first step (``step_count``
  0) still reports ``stall_after`` after its first report (a job stuck at start-up, say in a
  collective's set-up). The seed has no series for such a job; rlpulse names it separately. It
  resolves when the first step completes.
- ``silent_run`` fires when no report at all came for ``silent_after``; it resolves when reports
  resume. Going silent does not resolve an open stall: the job has still made no progress, and a
  RESOLVED record would read as "fixed". Silence only stops a *new* stall firing.
- ``RUN_END`` ends tracking: open alerts of that attempt resolve ("run ended") and its state is
  dropped. The first report of a higher attempt of the same run ends the lower ones the same way
  ("superseded"): a resumed run is a new attempt, and the old one will never report again.
- Each attempt is its own series and starts from its own count (0), inheriting no alert or step
  time. A step repeated after a restore still raises the job's ``step_count``, so it is progress.

Ages are processing time (``now_ns`` when the event is observed or the timer ticks), not the
events' own ``time_ns``: a stalled or dead job sends nothing new whose time could move the clock,
and the job's clock is not ours (skew). Step *intervals* are the job's own clock (the ``time_ns``
of the events that raised the count): a difference of one job's times cancels its skew, and a
backlog read in a burst must not make the run look fast. The interval of the first step is
counted from the attempt's first report when that report had count 0 (it includes start-up, so it
errs long); an interval that is not positive says nothing and is not kept. The count is compared by
maximum, so an event that arrives out of order cannot lower it.

The time between *observed* increases is what the window must cover: a job that reports its count
only at heartbeats shows an increase per heartbeat, however many steps it made in between.

Tracked attempts are capped (``max_runs``, default 10,000): a new attempt beyond the cap evicts the
one whose last report is oldest, resolves its open alerts with a summary saying tracking stopped,
and counts it in ``evicted``.
"""

from __future__ import annotations

from typing import Any
from collections.abc import MutableMapping

from rlpulse.base.env import STALL_AFTER
from rlpulse.streams.alerting import SEVERITY, AlertBook

NS = 1_000_000_000
MAX_RUNS = 10_000
HISTORY = 16  # step intervals kept per attempt: the window follows the run's recent pace, in bounded state
STALL_RULES = ("first_step_stalled", "stalled_run")


class StallDetector:
    """Stall and silence per ``project/run_id/attempt``; ``state`` values are JSON-able dicts.

    ``resumed_ns`` (optional) is when this processor (re)started: ages are measured from no
    earlier than it, so time the processor itself was down, or the backlog it has not read yet,
    never looks like a stalled or silent job. The price is that a stall already under way when
    the processor restarts is reported up to its window later.

    A state value holds the count, when it last rose (``increased_ns``, processing time), the last
    report (``seen_ns``), and the step time: ``base_t`` (event time of the last increase, or of a
    first report at count 0), ``intervals`` (the last ``HISTORY`` intervals, ns) and ``window_ns``
    (derived from them when they change, so a check costs a lookup). State from a worker before
    the per-run window reads with no history: the window is ``stall_after`` until the next intervals.
    """

    def __init__(self, state: MutableMapping[str, dict], book: AlertBook, stall_after_s: float,
                 silent_after_s: float, *, stall_min_s: float = 60.0, stall_max_s: float = 86400.0,
                 factor: float = 5.0, max_runs: int = MAX_RUNS, resumed_ns: int | None = None):
        self.state = state
        self.book = book
        self.stall_ns = int(stall_after_s * NS)
        self.floor_ns = min(int(stall_min_s * NS), self.stall_ns)
        self.ceiling_ns = int(stall_max_s * NS)
        self.factor = factor
        self.silent_ns = int(silent_after_s * NS)
        self.max_runs = max_runs
        self.resumed_ns = resumed_ns
        self.evicted = 0

    @staticmethod
    def key(project: str, run_id: str, attempt: int) -> str:
        """The state and alert key of one attempt: ``project/run_id/attempt``."""
        return f"{project}/{run_id}/{attempt}"

    def observe(self, event: dict[str, Any], now_ns: int) -> list[dict]:
        """Take one Step event; return the Alert records it causes (FIRING or RESOLVED)."""
        key = self.key(event.get("project", ""), event["run_id"], event["attempt"])
        if event["type"] == "RUN_END":
            return self._end(key, now_ns, f"run {event['run_id']} attempt {event['attempt']}: run ended")
        out: list[dict] = []
        count = int(event["step_count"])
        seen = self.state.get(key)
        if seen is None:
            out += self._supersede(event, now_ns)
            out += self._make_room(now_ns)
            # a first report at count 0 is the attempt's start: the first step's interval counts from it
            value = {"project": event.get("project", ""), "run_id": event["run_id"], "attempt": event["attempt"],
                     "step_count": count, "increased_ns": now_ns, "seen_ns": now_ns,
                     "base_t": int(event["time_ns"]) if count == 0 else None}
        else:
            value = {**seen, "seen_ns": now_ns}
            increased = count > seen["step_count"]
            if increased:
                value.update(step_count=count, increased_ns=now_ns)
                self._interval(value, seen, int(event["time_ns"]))
            if self.book.state:  # the run has an open alert (rare): the lookups below cost a key each
                if increased:
                    rule = "first_step_stalled" if seen["step_count"] == 0 else "stalled_run"
                    out += self._resolve(key, rule, now_ns, self._age(seen["increased_ns"], now_ns),
                                         f"{self._name(seen)}: step_count rose to {count}")
                # Reports resumed: whatever the silence was, it is over.
                out += self._resolve(key, "silent_run", now_ns, self._age(seen["seen_ns"], now_ns),
                                     f"{self._name(seen)}: reporting again")
        self.state[key] = value
        out += self._check_stall(key, value, now_ns)
        return out

    def tick(self, now_ns: int) -> list[dict]:
        """Wall-clock check of every tracked attempt (a timer calls it every second).

        Open episodes are left alone here, so a quiet second writes nothing to the tables;
        ``last_seen_ns`` of a stall moves with the heartbeats that ``observe`` sees.
        """
        out: list[dict] = []
        for key, value in sorted(self.state.items()):
            silent_for = self._age(value["seen_ns"], now_ns)
            if silent_for >= self.silent_ns:
                if self.book.is_firing("silent_run", key):
                    continue
                out += self._fire(key, value, "silent_run", now_ns, silent_for, self.silent_ns,
                                  f"{self._name(value)}: no report for {silent_for / NS:.0f}s "
                                  f"(last step_count {value['step_count']})", value["seen_ns"] + self.silent_ns)
            elif not self.book.is_firing(self._rule(value), key):
                out += self._check_stall(key, value, now_ns)
        return out

    @property
    def tracked(self) -> int:
        return len(self.state)

    def window_ns(self, value: dict) -> int:
        """The stall window of one attempt's state: its own, or ``stall_after`` before any step time."""
        if value["step_count"] == 0:
            return self.stall_ns
        return value.get("window_ns") or self.stall_ns

    def _interval(self, value: dict, seen: dict, t: int) -> None:
        """Record the event-time interval since the last increase (or the start) in ``value``.

        Runs only when the count rises; the median and window are computed here, once per
        increase, not at every check.
        """
        base = seen.get("base_t")
        value["base_t"] = t if base is None else max(base, t)
        if base is None or t <= base:  # no start to count from, or no information (same or earlier time)
            return
        intervals = [*seen.get("intervals", ()), t - base][-HISTORY:]
        value["intervals"] = intervals
        value["window_ns"] = self._derive(intervals)[0]

    def _derive(self, intervals: list[int]) -> tuple[int, str]:
        """(window ns, how it was derived) from the recorded intervals."""
        typical = sorted(intervals)[len(intervals) // 2]  # the upper median: errs long on an even count
        raw = int(self.factor * typical)
        window = min(max(raw, self.floor_ns), self.ceiling_ns)
        how = f"{self.factor:g} x median step time {_dur(typical)} over the last {len(intervals)} steps = {_dur(raw)}"
        if window > raw:
            how += f", raised to the floor {_dur(window)}"
        elif window < raw:
            how += f", capped at {_dur(window)}"
        return window, how

    def _how(self, value: dict) -> str:
        if value["step_count"] == 0:
            return f"window {_dur(self.stall_ns)} = {STALL_AFTER}: no step completed yet"
        intervals = value.get("intervals")
        if not intervals or not value.get("window_ns"):
            return f"window {_dur(self.stall_ns)} = {STALL_AFTER}: no step time known yet"
        return f"window {self._derive(intervals)[1]}"

    @staticmethod
    def _rule(value: dict) -> str:
        return "first_step_stalled" if value["step_count"] == 0 else "stalled_run"

    def _check_stall(self, key: str, value: dict, now_ns: int) -> list[dict]:
        window = self.window_ns(value)
        flat_for = self._age(value["increased_ns"], now_ns)
        if flat_for < window or self._age(value["seen_ns"], now_ns) >= self.silent_ns:
            return []
        if value["step_count"] == 0:
            return self._fire(key, value, "first_step_stalled", now_ns, flat_for, window,
                              f"{self._name(value)}: no step completed {flat_for / NS:.0f}s after its first report "
                              f"while the job still reports ({self._how(value)})", value["increased_ns"] + window)
        return self._fire(key, value, "stalled_run", now_ns, flat_for, window,
                          f"{self._name(value)}: step_count {value['step_count']} has not increased "
                          f"for {flat_for / NS:.0f}s while the job still reports ({self._how(value)})",
                          value["increased_ns"] + window)

    def _end(self, key: str, now_ns: int, why: str) -> list[dict]:
        """Resolve whatever is open for ``key`` and stop tracking it."""
        value = self.state.get(key)
        flat_for = self._age(value["increased_ns"], now_ns) if value else 0
        silent_for = self._age(value["seen_ns"], now_ns) if value else 0
        out: list[dict] = []
        for rule in STALL_RULES:
            out += self._resolve(key, rule, now_ns, flat_for, why)
        out += self._resolve(key, "silent_run", now_ns, silent_for, why)
        if value is not None:
            del self.state[key]
        return out

    def _supersede(self, event: dict[str, Any], now_ns: int) -> list[dict]:
        """End lower attempts of the same run: a resumed run never reports on the old attempt."""
        older = [k for k, v in self.state.items()
                 if v["run_id"] == event["run_id"] and v["project"] == event.get("project", "")
                 and v["attempt"] < event["attempt"]]
        out: list[dict] = []
        for key in sorted(older):
            out += self._end(key, now_ns, f"{self._name(self.state[key])}: superseded by attempt {event['attempt']}")
        return out

    def _make_room(self, now_ns: int) -> list[dict]:
        out: list[dict] = []
        while self.max_runs > 0 and len(self.state) >= self.max_runs:
            key = min(self.state.items(), key=lambda kv: (kv[1]["seen_ns"], kv[0]))[0]
            out += self._end(key, now_ns, f"{self._name(self.state[key])}: no longer tracked "
                                          f"(over {self.max_runs} runs tracked; its state is unknown)")
            self.evicted += 1
        return out

    def _fire(self, key: str, value: dict, rule: str, now_ns: int, age_ns: int, limit_ns: int,
              summary: str, since_ns: int) -> list[dict]:
        # ``since_ns``, the moment the condition began by the state (last increase or report plus
        # the limit), is first_seen_ns: fired again after a crash lost the state write, the
        # episode keeps its identity instead of opening a second one
        record = self.book.fire(rule, key, now_ns=now_ns, value=age_ns / NS, threshold=limit_ns / NS,
                                summary=summary, severity=SEVERITY[rule], project=value["project"],
                                run_id=value["run_id"], attempt=value["attempt"], since_ns=since_ns)
        return [record] if record is not None else []

    def _resolve(self, key: str, rule: str, now_ns: int, age_ns: int, summary: str) -> list[dict]:
        record = self.book.resolve(rule, key, now_ns=now_ns, value=age_ns / NS, summary=summary)
        return [record] if record is not None else []

    def _age(self, since_ns: int, now_ns: int) -> int:
        """Nanoseconds from ``since_ns`` (or from the restart, if later) to ``now_ns``."""
        if self.resumed_ns is not None:
            since_ns = max(since_ns, self.resumed_ns)
        return now_ns - since_ns

    @staticmethod
    def _name(value: dict) -> str:
        return f"run {value['run_id']} attempt {value['attempt']}"


def _dur(ns: int) -> str:
    """A duration for a summary: 500ms, 12s, 1.5s, 40m, 2h."""
    seconds = ns / NS
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.3g}s"
    if seconds < 7200:
        return f"{seconds / 60:.3g}m"
    return f"{seconds / 3600:.3g}h"
