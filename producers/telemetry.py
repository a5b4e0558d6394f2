"""``TrainingTelemetry``: the calls a training loop makes (see DESIGN.md, "SDK")."""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from producers import events as v
from producers.sender import DEFAULT_BUFFER_BYTES, Outgoing, Sender

if TYPE_CHECKING:
    from producers.aio import AsyncTrainingTelemetry
    from producers.otel import RlpulseSpanExporter
from rlpulse.settings import Settings

log = logging.getLogger(__name__)

MAX_TERMS = 64  # distinct reward terms per run: a high-cardinality guard (seed 000)


def _span_id(*parts: object) -> bytes:
    """Deterministic 8-byte id, so a rollout's children can name it as their parent."""
    return hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()


def _trace_id(*parts: object) -> bytes:
    return hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=16).digest()


class TrainingTelemetry:
    """Publishes a run's rollouts, grader calls and steps without blocking the training thread.

    Use as a context manager (RUN_START on enter, RUN_END and a final flush on exit). A
    background timer sends a HEARTBEAT with the current ``step_count`` every
    ``heartbeat_interval`` seconds, which the stall detector relies on.
    """

    def __init__(
        self,
        project: str,
        run_id: str,
        attempt: int = 1,
        trainer: str = "rl",
        stage: str = "",
        settings: Settings | None = None,
        clock: Callable[[], int] = time.time_ns,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    ):
        self.project = v.require_str("project", project)
        self.run_id = v.require_str("run_id", run_id)
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
            raise ValueError(f"attempt must be a positive integer, got {attempt!r}")
        self.attempt = attempt
        self.trainer = v.require_choice("trainer", trainer, v.TRAINERS)
        self.stage = v.require_str("stage", stage, allow_empty=True)
        self.settings = settings or Settings.load()
        self._clock = clock
        self._sender = Sender(self.settings, buffer_bytes=buffer_bytes)
        self._sequence = itertools.count(1)
        self._seq_lock = threading.Lock()
        self._terms: set[str] = set()
        self.step_count = 0
        self._stop_heartbeat = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self._open = False

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "TrainingTelemetry":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the sender and the heartbeat timer; publish RUN_START."""
        if self._open:
            return
        self._open = True
        self._sender.start()
        self._step_event("RUN_START")
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="rlpulse-heartbeat", daemon=True)
        self._heartbeat_thread.start()

    def flush(self, timeout: float = 30.0) -> int:
        """Deliver everything buffered; returns how many events are still undelivered."""
        return self._sender.flush(timeout)

    def close(self, timeout: float = 30.0) -> int:
        """Publish RUN_END, deliver what is buffered, stop; returns the undelivered count."""
        if not self._open:
            return 0
        self._open = False
        self._stop_heartbeat.set()
        self._step_event("RUN_END")
        undelivered = self._sender.close(timeout)
        if undelivered or self._sender.dropped:
            log.warning("run %s/%d: %d events undelivered, %d dropped (buffer full)", self.run_id, self.attempt, undelivered, self._sender.dropped)
        return undelivered

    def abandon(self, timeout: float = 30.0) -> int:
        """Stop as a crashed job would, without RUN_END (for simulations); delivers what is buffered."""
        self._open = False
        self._stop_heartbeat.set()
        return self._sender.close(timeout)

    @property
    def dropped(self) -> int:
        """Events dropped because the buffer was full."""
        return self._sender.dropped

    @property
    def aio(self) -> "AsyncTrainingTelemetry":
        """The asyncio face of this object, sharing its sender."""
        from producers.aio import AsyncTrainingTelemetry

        return AsyncTrainingTelemetry(telemetry=self)

    @property
    def delivered(self) -> int:
        """Events the broker has acknowledged."""
        return self._sender.delivered

    # -- the calls a training loop makes -----------------------------------------------------
    def rollout(
        self,
        step: int,
        rollout_id: str,
        reward: float,
        term_shares: Mapping[str, float] | None = None,
        completion_tokens: int | None = None,
        max_tokens: int | None = None,
        sample_id: str | None = None,
        clipped: bool | None = None,
        duration_s: float = 0.0,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        """Record one rollout: its total reward, each term's weighted share and its completion length.

        ``clipped`` defaults to ``completion_tokens >= max_tokens`` when both are given.
        """
        v.require_step("step", step)
        v.require_str("rollout_id", rollout_id)
        reward = v.require_finite("reward", reward)
        shares = v.float_map("term_shares", term_shares, MAX_TERMS)
        for term in shares:
            self._check_term(term)
        completion_tokens = v.require_count("completion_tokens", completion_tokens)
        max_tokens = v.require_count("max_tokens", max_tokens)
        if clipped is None and completion_tokens is not None and max_tokens is not None:
            clipped = completion_tokens >= max_tokens
        if sample_id is not None:
            v.require_str("sample_id", sample_id)
        duration_s = v.require_finite("duration_s", duration_s, minimum=0.0)
        attributes = v.attribute_map("attributes", attributes)
        self._span(
            kind="ROLLOUT", name="rollout", step=step, rollout_id=rollout_id, duration_s=duration_s,
            span_id=_span_id(self.run_id, self.attempt, rollout_id, "rollout"), parent=None,
            fields=dict(reward=reward, term_shares=shares, completion_tokens=completion_tokens,
                        max_tokens=max_tokens, clipped=clipped, sample_id=sample_id),
            attributes=attributes,
        )

    def grader(
        self,
        step: int,
        rollout_id: str,
        term: str,
        outcome: str,
        duration_s: float,
        score: float | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
    ) -> None:
        """Record one score of one reward term; ``outcome`` is ok or the failure cause."""
        v.require_step("step", step)
        v.require_str("rollout_id", rollout_id)
        self._check_term(v.require_str("term", term))
        v.require_choice("outcome", outcome, v.GRADER_OUTCOMES)
        duration_s = v.require_finite("duration_s", duration_s, minimum=0.0)
        score = v.optional_finite("score", score)
        if outcome != "ok":
            score = 0.0  # a failed score counts as zero for its term (seed 001)
        self._span(
            kind="GRADER", name=f"grader {term}", step=step, rollout_id=rollout_id, duration_s=duration_s,
            span_id=os.urandom(8), parent=_span_id(self.run_id, self.attempt, rollout_id, "rollout"),
            fields=dict(term=term, outcome=outcome, score=score,
                        judge_input_tokens=v.require_count("input_tokens", input_tokens),
                        judge_output_tokens=v.require_count("output_tokens", output_tokens)),
            status="OK" if outcome == "ok" else "ERROR",
            status_message="" if outcome == "ok" else outcome,
        )

    def step_completed(self, step: int, tokens: int = 0, duration_s: float = 0.0, mfu: float | None = None) -> None:
        """Record a completed step; ``step_count`` goes up by one (a repeated step after a restore counts again)."""
        v.require_step("step", step)
        v.require_step("tokens", tokens)
        duration_s = v.require_finite("duration_s", duration_s, minimum=0.0)
        mfu = v.optional_finite("mfu", mfu, minimum=0.0)
        with self._seq_lock:
            self.step_count += 1
        throughput = tokens / duration_s if duration_s > 0 else 0.0
        self._step_event("STEP", step=step, tokens=tokens, duration_s=duration_s, throughput=throughput, mfu=mfu)

    def span_exporter(self) -> "RlpulseSpanExporter":
        """An OpenTelemetry SpanExporter publishing the job's own spans (see ``producers.otel``)."""
        from producers.otel import RlpulseSpanExporter

        return RlpulseSpanExporter(self)

    def heartbeat(self) -> None:
        """Publish the current ``step_count`` now (the background timer calls this)."""
        self._step_event("HEARTBEAT")

    # -- internals -------------------------------------------------------------------------
    def _check_term(self, term: str) -> None:
        if term not in self._terms:
            if len(self._terms) >= MAX_TERMS:
                raise ValueError(f"term {term!r} would be distinct term number {MAX_TERMS + 1} for this run; at most {MAX_TERMS} are allowed")
            self._terms.add(term)

    def _identity(self) -> dict[str, Any]:
        return {"project": self.project, "run_id": self.run_id, "attempt": self.attempt, "stage": self.stage}

    def _next_sequence(self) -> int:
        with self._seq_lock:
            return next(self._sequence)

    def _span(self, *, kind: str, name: str, step: int, rollout_id: str, duration_s: float, span_id: bytes,
              parent: bytes | None, fields: dict[str, Any], attributes: Mapping[str, Any] | None = None,
              status: str = "OK", status_message: str = "") -> None:
        end = self._clock()
        record = {
            **self._identity(), "time_ns": end, "trace_id": _trace_id(self.run_id, self.attempt, rollout_id),
            "span_id": span_id, "parent_span_id": parent, "name": name, "kind": kind,
            "start_time_ns": end - int(duration_s * 1e9), "end_time_ns": end, "status": status,
            "status_message": status_message, "rollout_id": rollout_id, "attempt_id": "",
            "sequence_id": self._next_sequence(), "step": step, "attributes": dict(attributes or {}), **fields,
        }
        self._sender.offer(Outgoing(self.settings.topic("spans"), f"{self.run_id}/{self.attempt}/{rollout_id}", "Span", record))

    def _publish_span(self, fields: dict[str, Any]) -> None:
        """Publish a span converted by the OpenTelemetry exporter; identity and sequence are added here."""
        record = {**self._identity(), "sequence_id": self._next_sequence(), "term": None, "outcome": None,
                  "score": None, "judge_input_tokens": None, "judge_output_tokens": None, "term_shares": {},
                  "completion_tokens": None, "max_tokens": None, "clipped": None, "sample_id": None, **fields}
        key = f"{self.run_id}/{self.attempt}/{record['rollout_id']}"
        self._sender.offer(Outgoing(self.settings.topic("spans"), key, "Span", record))

    def _step_event(self, type_: str, step: int = -1, **fields: Any) -> None:
        record = {**self._identity(), "time_ns": self._clock(), "type": type_, "trainer": self.trainer,
                  "step": step, "step_count": self.step_count, "dropped_events": self._sender.dropped, **fields}
        self._sender.offer(Outgoing(self.settings.topic("steps"), f"{self.run_id}/{self.attempt}", "Step", record))

    def _heartbeat_loop(self) -> None:
        while not self._stop_heartbeat.wait(self.settings.heartbeat_interval):
            self.heartbeat()
