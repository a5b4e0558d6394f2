"""The state of one run, as the run processor keeps it: one Faust table entry per run.

It travels through the table's changelog as JSON (``to_dict`` / ``from_dict``); the steps and
windows, most of its bytes, as positional lists (``StepFigures.encode`` / ``decode``), each kept
serialized until it changes. Fields added later are read with a default, and the dicts an older
worker wrote for steps and windows are read as they are, so state written by an older worker restores.
"""

from __future__ import annotations

from typing import Any

from rlpulse.streams.figures import GraderWindow, StepFigures


class Run:
    """The state of one run: marks, progress, open and retained figures, stall and alert state."""

    def __init__(self, project: str, run_id: str, partition: int):
        self.project, self.run_id, self.partition = project, run_id, partition
        self.marks: dict[str, int] = {}  # "topic|attempt|writer" -> highest sequence_id applied
        self.progress: dict[str, list[int]] = {}  # same key -> [highest event time, wall clock of its last message]
        self.seen_ns = 0  # wall clock of the last message
        self.windows: dict[str, GraderWindow] = {}  # "attempt|term|start_ns"
        self.steps: dict[str, StepFigures] = {}  # "attempt|step"
        self.step_ends: dict[str, int] = {}  # "attempt|step" -> STEP event time, for steps not yet seen
        self.max_step: dict[str, int] = {}  # attempt -> highest step with a rollout
        # attempt -> highest step / window start whose figures were emitted and dropped: data for
        # them is late, and must never start a new, partial row that would replace the complete one
        self.retired_steps: dict[str, int] = {}
        self.retired_windows: dict[str, int] = {}
        self.stalls: dict[str, dict] = {}
        self.rules: dict[str, dict] = {}
        self.alerts: dict[str, dict] = {}
        self.ended: list[int] = []  # attempts that sent RUN_END
        # stream -> the last sequence_id it will ever have (from its writer's RUN_END): once applied,
        # the stream is complete and holds nothing back
        self.finished: dict[str, int] = {}
        self.latest_attempt = 0  # the newest attempt the steps topic has shown
        self.late_dropped = 0
        self.rejected = 0  # records skipped as invalid (a NaN reward, a negative length)
        # the run's distinct grader terms, in the order first seen: at most RunConfig.max_terms get
        # windows; grader spans of further terms are refused and counted here
        self.terms: list[str] = []
        self.terms_refused = 0

    def to_dict(self) -> dict[str, Any]:
        return {"project": self.project, "run_id": self.run_id, "partition": self.partition, "marks": self.marks,
                "progress": self.progress, "seen_ns": self.seen_ns,
                "windows": {k: w.encode() for k, w in self.windows.items()},
                "steps": {k: s.encode() for k, s in self.steps.items()}, "step_ends": self.step_ends,
                "max_step": self.max_step, "retired_steps": self.retired_steps,
                "retired_windows": self.retired_windows, "stalls": self.stalls, "rules": self.rules, "alerts": self.alerts,
                "ended": self.ended, "finished": self.finished, "latest_attempt": self.latest_attempt,
                "late_dropped": self.late_dropped, "rejected": self.rejected, "terms": self.terms,
                "terms_refused": self.terms_refused}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Run:
        run = cls(d["project"], d["run_id"], d["partition"])
        run.marks, run.seen_ns = dict(d["marks"]), d["seen_ns"]
        run.progress = {k: list(v) for k, v in d["progress"].items()}
        run.windows = {k: GraderWindow.decode(w) for k, w in d["windows"].items()}
        run.steps = {k: StepFigures.decode(s) for k, s in d["steps"].items()}
        run.step_ends, run.max_step = dict(d["step_ends"]), dict(d["max_step"])
        run.retired_steps, run.retired_windows = dict(d["retired_steps"]), dict(d["retired_windows"])
        run.stalls, run.rules, run.alerts = dict(d["stalls"]), dict(d["rules"]), dict(d["alerts"])
        run.ended, run.late_dropped = list(d["ended"]), d["late_dropped"]
        run.finished = dict(d.get("finished", {}))
        run.latest_attempt, run.rejected = d.get("latest_attempt", 0), d.get("rejected", 0)
        # state from a worker before the term cap: the terms its open windows name
        run.terms = list(d["terms"]) if "terms" in d else list(dict.fromkeys(k.split("|")[1] for k in run.windows))
        run.terms_refused = d.get("terms_refused", 0)
        return run

    def ident(self, attempt: int) -> dict[str, Any]:
        return {"project": self.project, "run_id": self.run_id, "attempt": attempt}

    @property
    def key(self) -> str:
        return f"{self.project}/{self.run_id}"
