"""The step calls of a writer, and grader calls held until their step completes.

``StepCalls`` is a base class of ``TrainingTelemetry``: ``step_completed``, ``log``, ``heartbeat``
and ``discard_step``, kept apart so the module of the span calls stays about them.

**Grader calls counted with their step** (``TrainingTelemetry(..., grader_calls="step")``). Seed
001: "If a judge refuses the job's credentials or fails too many consecutive calls, the job stops
and does not count those calls. The job reports the calls for a step when it reports that step."
In that mode ``grader()`` checks its arguments as always, then ``HeldGraderCalls`` keeps the call
under its step instead of queueing it. ``step_completed(n)`` queues the held calls of every step up
to ``n`` (a training loop completes its steps in order, so a loop that reports every few steps still
gets its calls out) before the STEP event, on every rank (each rank holds its own calls). A call for
a step at or below the last completed one goes out at once: that step was reported. The calls of a
step never completed (the job stopped: ``close()``, ``abandon()`` or the interpreter's exit before
its ``step_completed``; or ``discard_step(n)``, for a step a job gives up on and redoes after a
restore) are never published: counted in ``discarded`` and logged once at close.

Held calls count against the send buffer's bound (``buffer_bytes``) from the moment they are
held: their estimated bytes are reserved in the queue, so the SDK's memory stays within the one
bound and a step's calls never overflow it when they are released. A call that does not fit is
dropped as any event is: counted in the writer's ``dropped`` (the ``dropped_events`` of every STEP
and heartbeat; ``held_graders.dropped`` counts those among them) and logged at most every 10 s.

The default, ``grader_calls="call"``, queues each call when it is made: nothing of this runs.
"""

from __future__ import annotations

import logging
import threading
from typing import Any
from collections.abc import Callable, Mapping

from rlpulse.producers.sdk import events as v
from rlpulse.producers.sdk.queue import (DICT_QUEUED_BYTES, ENTRY_BYTES, SPANS, STEP_QUEUED_BYTES, STEPS, Channel,
                                         EventQueue)
from rlpulse.producers.sdk.sender import Sender

log = logging.getLogger(__name__)

GRADER_CALLS_NOW, GRADER_CALLS_WITH_STEP = "call", "step"
GRADER_CALLS = (GRADER_CALLS_NOW, GRADER_CALLS_WITH_STEP)  # the values of TrainingTelemetry's grader_calls
_NO_METRICS: dict[str, float] = {}  # shared, never mutated
_NO_CONFIG: dict[str, str] = {}  # shared, never mutated
# A held call: what EventQueue.put takes (stream, channel, the call's checked arguments, estimated bytes).
Held = tuple[int, Channel, Any, int]


class HeldGraderCalls:
    """Grader calls held per step until it completes; thread-safe. ``put`` has ``EventQueue.put``'s
    signature, so ``grader()`` hands a call here exactly as it would to the queue."""

    def __init__(self, queue: EventQueue, completed: int = -1):
        self._queue = queue  # the send queue: a held call's bytes are reserved in it, so one bound covers both
        self.completed = completed  # the step last completed: calls of it and earlier steps go out at once
        self._steps: dict[int, list[Held]] = {}
        self._lock = threading.Lock()
        self.held_bytes = 0
        self.published = 0  # calls queued for sending: when their step completed, or at once
        self.discarded = 0  # calls of steps never completed: never published
        self.dropped = 0  # calls refused at the buffer's bound (also in the writer's ``dropped``)

    @property
    def held(self) -> int:
        """Calls held now."""
        with self._lock:
            return sum(map(len, self._steps.values()))

    def put(self, stream: int, channel: Channel, args: Any, size: int) -> bool:
        step = args[2]  # TrainingTelemetry.grader's tuple: (start, end, step, rollout_id, ...)
        with self._lock:
            if step <= self.completed:
                self.published += 1
                return self._queue.put(stream, channel, args, size)
            if not self._queue.reserve(size):  # counted in the writer's dropped and logged, as any drop
                self.dropped += 1
                return False
            self._steps.setdefault(step, []).append((stream, channel, args, size))
            self.held_bytes += size
            return True

    def complete(self, step: int) -> int:
        """``step`` completed: queue the held calls of every step up to it, in step and call order; how many."""
        with self._lock:
            self.completed = step
            due = sorted(s for s in self._steps if s <= step)
            calls = [call for s in due for call in self._steps.pop(s)]
            for call in calls:  # under the lock: a call of a completed step made meanwhile queues after these
                self.held_bytes -= call[3]
                self._queue.put_reserved(*call)
            self.published += len(calls)
            return len(calls)

    def discard(self, step: int | None = None) -> int:
        """Forget the held calls of ``step`` (None: of every step); how many."""
        with self._lock:
            steps = list(self._steps) if step is None else [step] if step in self._steps else []
            calls = [call for s in steps for call in self._steps.pop(s)]
            size = sum(call[3] for call in calls)
            self._queue.unreserve(size)
            self.held_bytes -= size
            self.discarded += len(calls)
            return len(calls)

    def stop(self, run: str) -> int:
        """The job stops: discard what is held and say so once (with the drops); how many were discarded."""
        with self._lock:
            steps = sorted(self._steps)
        discarded = self.discard()
        if discarded or self.dropped:
            log.warning("run %s: %d grader calls of steps never completed (%s) not published, as seed 001 has it; "
                        "%d discarded and %d dropped at the buffer's bound in all (grader_calls='step')", run, discarded,
                        ", ".join(map(str, steps)) or "none", self.discarded, self.dropped)
        return discarded

    def renewed(self, queue: EventQueue) -> HeldGraderCalls:
        """A forked child's, on its own queue: empty (the parent's calls are the parent's), the same last step."""
        return HeldGraderCalls(queue, self.completed)


class StepCalls:
    """The calls of the step stream; ``TrainingTelemetry`` sets the attributes."""

    run_id: str
    attempt: int
    step_count: int
    _sender: Sender
    _put: Callable[..., bool]
    _clock: Callable[[], int]
    _step_lock: threading.Lock
    _step_channel: Channel
    _counts_steps: bool
    _held: HeldGraderCalls | None

    def step_completed(self, step: int, tokens: int = 0, duration_s: float = 0.0, mfu: float | None = None,
                       metrics: Mapping[str, float] | None = None) -> None:
        """Record a completed step; ``step_count`` goes up by one (a repeated step after a restore
        counts again). ``mfu``: model FLOPs utilization, a fraction from 0 to 1 (seed 001).
        ``metrics``: the trainer's own scalars of the step (loss, kl, grad_norm, ``clip_ratio/*``),
        at most MAX_METRICS names of at most MAX_NAME characters, finite values. With
        ``grader_calls="step"`` the grader calls held for this step and earlier ones go out first,
        on every rank. On a rank other than 0 no STEP is sent: rank 0 counts the run's steps."""
        v.require_step("step", step)  # every check before step_count changes
        v.require_step("tokens", tokens)
        duration_s = v.require_duration("duration_s", duration_s)
        if mfu is not None:
            mfu = v.require_finite("mfu", mfu)
            if not 0.0 <= mfu <= 1.0:
                raise ValueError(f"mfu must be a fraction from 0 to 1 (model FLOPs utilization; seed 001), got {mfu!r}; "
                                 "a percentage must be divided by 100")
        checked = v.float_map("metrics", metrics, v.MAX_METRICS)
        if self._held is not None:
            self._held.complete(step)
        if self._counts_steps:
            self._step_event("STEP", step, tokens, duration_s, mfu, completed=1, metrics=checked)

    def discard_step(self, step: int) -> int:
        """Never publish the grader calls held for ``step`` (``grader_calls="step"``): a step the job
        abandoned, say before a restore that repeats it. Returns how many; 0 in the default mode."""
        v.require_step("step", step)
        return 0 if self._held is None else self._held.discard(step)

    @property
    def held_graders(self) -> HeldGraderCalls | None:
        """The grader calls held for their step and their counts (``held``, ``published``,
        ``discarded``, ``dropped``); None in the default mode, ``grader_calls="call"``."""
        return self._held

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record the trainer's scalars of ``step`` without completing it (a METRICS event); the
        same limits as ``step_completed``'s ``metrics``. On a rank other than 0 this does nothing."""
        v.require_step("step", step)
        checked = v.float_map("metrics", metrics, v.MAX_METRICS)
        if checked and self._counts_steps:
            self._step_event("METRICS", step, metrics=checked)

    def heartbeat(self) -> None:
        """Publish the current ``step_count`` now (the background timer calls this)."""
        self._step_event("HEARTBEAT")

    def _step_event(self, type_: str, step: int = -1, tokens: int = 0, duration_s: float = 0.0, mfu: float | None = None,
                    completed: int = 0, metrics: dict[str, float] = _NO_METRICS, status: str | None = None,
                    config: dict[str, str] = _NO_CONFIG, time_ns: int | None = None) -> None:
        """Queue one step event; ``config`` (RUN_START only) is a ``flatten_config`` map, ``time_ns`` None: now."""
        with self._step_lock:  # so step_count and the sequence id rise together across threads
            self.step_count += completed
            # RUN_END says how many spans this writer numbered, so the streams can close the run as
            # soon as they have applied the last one instead of waiting for it to go quiet.
            spans_sent = self._sender.queue.last_sequence(SPANS) if type_ == "RUN_END" else 0
            size = STEP_QUEUED_BYTES
            if metrics:
                size += DICT_QUEUED_BYTES + sum(map(len, metrics)) + ENTRY_BYTES * len(metrics)
            if config:
                size += DICT_QUEUED_BYTES + sum(len(k) + len(x) for k, x in config.items()) + ENTRY_BYTES * len(config)
            self._put(
                STEPS,
                self._step_channel,
                (self._clock() if time_ns is None else time_ns, type_, step, self.step_count, tokens, duration_s, mfu,
                 spans_sent, metrics, status, config),
                size,
            )

    def _stop_held(self) -> None:
        """The job stops: grader calls of steps never completed are not published (counted, logged once)."""
        if self._held is not None:
            self._held.stop(f"{self.run_id}/{self.attempt}")
