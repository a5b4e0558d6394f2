"""Stage 2 of the step figures: merge partials, decide when a step is complete, emit.

A step is complete when its STEP event has arrived or a later step has begun (or the run
ended) and no partial has changed it for ``settle_s``; or, by wall clock, when nothing has
changed it for ``lateness_s``. A complete step that changes later is emitted again (the
sink keeps the latest), but the alert rules see each step once, in step order.
"""

from __future__ import annotations

import json
from typing import Any, MutableMapping

from streams.histograms import ExpHistogram
from streams.steps import merge


class StepMerger:
    def __init__(self, state: MutableMapping[str, Any], settle_s: float, lateness_s: float, retention_s: float):
        self.state = state
        self.settle_ns = int(settle_s * 1e9)
        self.lateness_ns = int(lateness_s * 1e9)
        self.retention_ns = int(retention_s * 1e9)
        self.forgotten: list[tuple[str, str, int]] = []  # (project, run_id, attempt) of runs dropped by tick

    @staticmethod
    def _run_key(project: str, run_id: str, attempt: int) -> str:
        return json.dumps(["run", project, run_id, attempt], separators=(",", ":"))

    @staticmethod
    def _step_key(project: str, run_id: str, attempt: int, step: int) -> str:
        return json.dumps(["step", project, run_id, attempt, step], separators=(",", ":"))

    def _run(self, project: str, run_id: str, attempt: int) -> dict[str, Any]:
        return dict(self.state.get(self._run_key(project, run_id, attempt)) or {"stepped": -1, "seen": -1, "ended": False})

    def on_partial(self, record: dict[str, Any], now_ns: int) -> None:
        """Take a StepPartial: it replaces the previous partial of the same source partition."""
        key = self._step_key(record["project"], record["run_id"], record["attempt"], record["step"])
        value = dict(self.state.get(key) or {"partials": {}, "complete": False, "dirty": False, "updated_ns": 0})
        partials = dict(value["partials"])
        partials[str(record["source_partition"])] = json.loads(record["state"])
        value.update(partials=partials, dirty=True, updated_ns=now_ns)
        self.state[key] = value
        run_key = self._run_key(record["project"], record["run_id"], record["attempt"])
        run = self._run(record["project"], record["run_id"], record["attempt"])
        if record["step"] > run["seen"]:
            run["seen"] = record["step"]
            self.state[run_key] = run

    def on_step_event(self, event: dict[str, Any], now_ns: int) -> None:
        """Take a Step event: STEP marks its step done; RUN_END marks the run ended."""
        if event["type"] not in ("STEP", "RUN_END"):
            return
        run_key = self._run_key(event["project"], event["run_id"], event["attempt"])
        run = self._run(event["project"], event["run_id"], event["attempt"])
        if event["type"] == "STEP":
            run["stepped"] = max(run["stepped"], event["step"])
        else:
            run["ended"] = True
            run["ended_ns"] = now_ns
        self.state[run_key] = run

    def tick(self, now_ns: int) -> list[tuple[dict[str, Any], bool]]:
        """Steps to emit now, as (merged figures, first time complete), in (run, step) order."""
        out = []
        ended_runs = set()
        for (_, project, run_id, attempt, step), key in sorted((json.loads(k), k) for k in self.state if k.startswith('["step"')):
            value = self.state[key]
            quiet = now_ns - value["updated_ns"]
            if value["complete"]:
                if value["dirty"] and quiet >= self.settle_ns:
                    self.state[key] = dict(value, dirty=False)
                    out.append((merge(value["partials"].values()), False))
                elif not value["dirty"] and quiet > self.retention_ns:
                    del self.state[key]
                continue
            run = self._run(project, run_id, attempt)
            done = run["ended"] or step <= run["stepped"] or step < run["seen"]
            if (done and quiet >= self.settle_ns) or quiet >= self.lateness_ns:
                self.state[key] = dict(value, complete=True, dirty=False)
                out.append((merge(value["partials"].values()), True))
        # A run that ended long ago and whose steps are all gone needs no record any more. (Its
        # partials can arrive after its RUN_END: they come through stage 1, the RUN_END does not.)
        live = {tuple(json.loads(k)[1:4]) for k in self.state if k.startswith('["step"')}
        for key in [k for k in self.state if k.startswith('["run"')]:
            run = self.state[key]
            if run["ended"] and now_ns - run["ended_ns"] > self.retention_ns and tuple(json.loads(key)[1:]) not in live:
                ended_runs.add(key)
        for key in ended_runs:
            del self.state[key]
            self.forgotten.append(tuple(json.loads(key)[1:]))
        return out


class GraderWindowMerger:
    """Merges the per-source-partition rows of each grader-failure window into totals.

    A window is evaluated once, ``settle_s`` after its last row arrived (the streams emit all
    rows of a window within one timer tick), and forgotten after ``retention_s``.
    """

    def __init__(self, state: MutableMapping[str, Any], settle_s: float, retention_s: float):
        self.state = state
        self.settle_ns = int(settle_s * 1e9)
        self.retention_ns = int(retention_s * 1e9)

    def on_row(self, row: dict[str, Any], now_ns: int) -> None:
        key = json.dumps(["gw", row["project"], row["run_id"], row["attempt"], row["term"], row["window_start_ns"]],
                         separators=(",", ":"))
        value = dict(self.state.get(key) or {"rows": {}, "evaluated": False})
        rows = dict(value["rows"])
        rows[f"{row['source_partition']}|{row['cause']}"] = [row["failures"], row["graded"]]
        durations = dict(value.get("durations") or {})
        if row.get("duration_histogram"):
            durations[str(row["source_partition"])] = row["duration_histogram"]
        value.update(rows=rows, durations=durations, updated_ns=now_ns, end_ns=row["window_end_ns"])
        self.state[key] = value

    def tick(self, now_ns: int) -> list[dict[str, Any]]:
        """Windows settled since the last tick, with totals over source partitions, in order."""
        out = []
        for (_, project, run_id, attempt, term, start), key in sorted(
            (json.loads(k), k) for k in self.state if k.startswith('["gw"')
        ):
            value = self.state[key]
            quiet = now_ns - value["updated_ns"]
            if value["evaluated"]:
                if quiet > self.retention_ns:
                    del self.state[key]
                continue
            if quiet < self.settle_ns:
                continue
            graded = {src.split("|")[0]: g for src, (_, g) in value["rows"].items()}
            failures, total = sum(f for f, _ in value["rows"].values()), sum(graded.values())
            durations = ExpHistogram()
            for raw in value.get("durations", {}).values():
                durations = durations.merge(ExpHistogram.from_dict(json.loads(raw)))

            def q(p: float) -> float:
                return float(durations.quantile(p)) if durations.count else 0.0

            out.append({"project": project, "run_id": run_id, "attempt": attempt, "term": term,
                        "window_start_ns": start, "window_end_ns": value.get("end_ns", start),
                        "failures": failures, "graded": total, "failure_rate": failures / total if total else 0.0,
                        "duration_p50_s": q(0.5), "duration_p90_s": q(0.9), "duration_p99_s": q(0.99),
                        "duration_max_s": float(durations.max or 0.0), "emitted_at_ns": now_ns})
            self.state[key] = dict(value, evaluated=True)
        return out
