"""Tumbling event-time windows closed by wall clock, with state in any mutable mapping.

The Faust agent passes its table as the mapping; unit tests pass a dict and a fixed clock.
Keys include the source partition: each partition is counted on its own, so the table stays
co-partitioned with its changelog and a replayed offset is recognised and skipped. Readers
sum the per-partition rows.
"""

from __future__ import annotations

import json
from typing import Any, MutableMapping

from streams.histograms import ExpHistogram

NS = 1_000_000_000
CAUSES = ("timeout", "unavailable", "unreadable", "ungradable")  # grader failure causes (seed 001)
UNKNOWN_CAUSE = "unknown"  # an outcome outside the contract still counts as a failure, under this cause
MAX_TERMS = 64  # distinct terms per run and window; more are counted together under OTHER_TERM
OTHER_TERM = "_other"


def window_start(t_ns: int, size_ns: int) -> int:
    """Start of the tumbling window holding ``t_ns``: windows are [start, start + size)."""
    return t_ns - (t_ns % size_ns)


def closes_at(start_ns: int, size_ns: int, lateness_ns: int) -> int:
    """Wall-clock time from which the window takes no more events and is emitted."""
    return start_ns + size_ns + lateness_ns


class GraderFailures:
    """Counts grader outcomes per (partition, run, attempt, term, window).

    ``add`` returns what happened to the event: ``added``, ``duplicate`` (offset already
    counted: a replay after a restart), ``late`` (its window had closed; counted in
    ``dropped_late``) or ``ignored`` (not a GRADER span).
    """

    def __init__(self, state: MutableMapping[str, Any], window_s: float, lateness_s: float):
        self.state = state
        self.size_ns = int(window_s * NS)
        self.lateness_ns = int(lateness_s * NS)
        self.dropped_late = 0
        self.folded_terms = 0  # spans counted under OTHER_TERM because their run had too many terms
        self._terms: dict[str, set[str]] = {}  # run and window -> its terms (rebuilt from state after a restart)

    def _term(self, partition: int, span: dict[str, Any], start: int) -> str:
        """The span's term, or OTHER_TERM when its run already has MAX_TERMS terms in this window."""
        ident = (partition, span["project"], span["run_id"], span["attempt"], start)
        run = json.dumps(ident)
        terms = self._terms.get(run)
        if terms is None:
            terms = {v["term"] for v in list(self.state.values()) if v is not None
                     and (v["partition"], v["project"], v["run_id"], v["attempt"], v["start_ns"]) == ident}
            self._terms[run] = terms
        term = span["term"]
        if term not in terms:
            if len(terms) >= MAX_TERMS:
                self.folded_terms += 1
                return OTHER_TERM
            terms.add(term)
        return term

    @staticmethod
    def key(partition: int, project: str, run_id: str, attempt: int, term: str, start_ns: int) -> str:
        return json.dumps([partition, project, run_id, attempt, term, start_ns], separators=(",", ":"))

    def add(self, span: dict[str, Any], partition: int, offset: int, now_ns: int) -> str:
        if span.get("kind") != "GRADER" or span.get("term") is None:
            return "ignored"
        start = window_start(span["time_ns"], self.size_ns)
        term = self._term(partition, span, start)
        key = self.key(partition, span["project"], span["run_id"], span["attempt"], term, start)
        current = self.state.get(key)
        if current is not None and offset <= current["offset"]:
            return "duplicate"
        if now_ns >= closes_at(start, self.size_ns, self.lateness_ns):
            self.dropped_late += 1
            return "late"
        value = dict(current) if current else {
            "partition": partition, "project": span["project"], "run_id": span["run_id"],
            "attempt": span["attempt"], "term": term, "start_ns": start, "graded": 0,
            "causes": {cause: 0 for cause in CAUSES}, "durations": ExpHistogram().to_dict(),
        }
        value["graded"] += 1
        # state written by an older version has no durations: start them here
        durations = ExpHistogram.from_dict(value["durations"]) if "durations" in value else ExpHistogram()
        durations.add(max(span.get("end_time_ns", 0) - span.get("start_time_ns", 0), 0) / NS)
        value["durations"] = durations.to_dict()
        outcome = span.get("outcome") or "ok"
        if outcome not in CAUSES and outcome != "ok":
            outcome = UNKNOWN_CAUSE
        if outcome != "ok":
            causes = dict(value["causes"])
            causes[outcome] = causes.get(outcome, 0) + 1
            value["causes"] = causes
        value["offset"] = offset
        self.state[key] = value  # a new value object, so the table records the change
        return "added"

    def closed(self, now_ns: int) -> list[tuple[str, dict[str, Any]]]:
        """Windows whose close time has passed, in key order."""
        for run in [r for r in self._terms if now_ns >= closes_at(json.loads(r)[-1], self.size_ns, self.lateness_ns)]:
            del self._terms[run]  # a closed window takes no new terms
        return sorted(
            (k, v) for k, v in list(self.state.items())
            if v is not None and now_ns >= closes_at(v["start_ns"], self.size_ns, self.lateness_ns)
        )

    def records(self, value: dict[str, Any], emitted_at_ns: int) -> list[dict[str, Any]]:
        """GraderFailureWindow records for one window: one per cause, zero counts included."""
        return [
            {"project": value["project"], "run_id": value["run_id"], "attempt": value["attempt"],
             "term": value["term"], "cause": cause, "window_start_ns": value["start_ns"],
             "window_end_ns": value["start_ns"] + self.size_ns, "failures": count, "graded": value["graded"],
             "source_partition": value["partition"], "emitted_at_ns": emitted_at_ns,
             "duration_histogram": json.dumps(value.get("durations", ExpHistogram().to_dict()), separators=(",", ":"))}
            for cause, count in sorted(value["causes"].items())
        ]
