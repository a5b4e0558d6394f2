"""Checkpoint saves and restores as CHECKPOINT spans of the run's trace (seed 001, "Signal sources").

``TrainingTelemetry.checkpoint`` records one that already happened; ``TrainingTelemetry.checkpointing``
times one and records it when its block ends, failed when the block raised::

    with tel.checkpointing(step=1200, op="save") as ck:
        ck.size_bytes = save_checkpoint(model, path)   # an exception: outcome failed, and it propagates

The span carries the operation (``checkpoint_op``), ``checkpoint_bytes``, its own start and end,
and ``outcome`` ok or failed (status ERROR with the error's type and message, cut to 256
characters: a message may hold a path, never a secret the SDK knows of). A failed save fires the
streams' ``checkpoint_failed`` alert; the run's next successful save resolves it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from rlpulse.producers.sdk import events as v
from rlpulse.producers.sdk.records import random_span_id, trace_id
from rlpulse.schemas.enums import CHECKPOINT_OPS, CHECKPOINT_OUTCOMES

MAX_ERROR = 256  # characters of a failed checkpoint's error kept in status_message


def checkpoint_fields(run_id: str, attempt: int, step: int, op: str, outcome: str, start_ns: int, end_ns: int,
                      size_bytes: int | None, error: str | None) -> dict[str, Any]:
    """The Span fields of one checkpoint operation, checked (ValueError naming the field)."""
    v.require_step("step", step)
    v.require_choice("op", op, CHECKPOINT_OPS)
    v.require_choice("outcome", outcome, CHECKPOINT_OUTCOMES)
    v.require_long("start_ns", start_ns, minimum=0)
    v.require_long("end_ns", end_ns, minimum=0)
    if start_ns > end_ns:
        raise ValueError(f"start_ns {start_ns} is after end_ns {end_ns}")
    if size_bytes is not None:
        v.require_count("size_bytes", size_bytes)
    failed = outcome == "failed"
    message = (error or "")[:MAX_ERROR] if failed else ""
    return {"time_ns": end_ns, "trace_id": trace_id(f"{run_id}/{attempt}"), "span_id": random_span_id(),
            "name": f"checkpoint {op}", "kind": "CHECKPOINT", "start_time_ns": start_ns, "end_time_ns": end_ns,
            "status": "ERROR" if failed else "OK", "status_message": message, "step": step, "outcome": outcome,
            "checkpoint_op": op, "checkpoint_bytes": size_bytes}


class Checkpointing:
    """Times a checkpoint operation and publishes it when the ``with`` block ends (``size_bytes``
    may be set inside it); an exception marks it failed and propagates."""

    def __init__(self, publish: Callable[..., None], step: int, op: str, clock: Callable[[], int] = time.time_ns):
        v.require_step("step", step)
        v.require_choice("op", op, CHECKPOINT_OPS)
        self._publish, self.step, self.op, self._clock = publish, step, op, clock
        self.size_bytes: int | None = None
        self._start = 0

    def __enter__(self) -> Checkpointing:
        self._start = self._clock()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, *_: object) -> None:
        error = None if exc is None else f"{type(exc).__name__}: {exc}"
        self._publish(step=self.step, op=self.op, outcome="ok" if exc is None else "failed", start_ns=self._start,
                      end_ns=self._clock(), size_bytes=self.size_bytes, error=error)


class CheckpointCalls:
    """``TrainingTelemetry``'s checkpoint calls (a base class of it; it sets the attributes)."""

    run_id: str
    attempt: int
    _clock: Callable[[], int]

    def publish_span(self, span: Mapping[str, Any]) -> bool:  # SenderFaces's, before this class in TrainingTelemetry
        raise NotImplementedError

    def checkpoint(self, step: int, op: str, outcome: str = "ok", duration_s: float = 0.0,
                   size_bytes: int | None = None, error: str | None = None, start_ns: int | None = None,
                   end_ns: int | None = None) -> None:
        """Record a checkpoint ``op`` (save or restore) of ``step`` that ended ``end_ns`` (default now),
        ``outcome`` ok or failed."""
        end = self._clock() if end_ns is None else end_ns
        start = end - int(v.require_duration("duration_s", duration_s) * 1e9) if start_ns is None else start_ns
        self.publish_span(checkpoint_fields(self.run_id, self.attempt, step, op, outcome, start, end, size_bytes, error))

    def checkpointing(self, step: int, op: str = "save") -> Checkpointing:
        """A ``with`` block timing a checkpoint ``op``: failed if it raises."""
        return Checkpointing(self.checkpoint, step, op, self._clock)
