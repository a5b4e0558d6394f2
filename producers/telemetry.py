"""``TrainingTelemetry``: the calls a training loop makes (see DESIGN.md, "SDK").

A call only validates its arguments and queues them (a tuple) with a sequence id; the sender
thread builds and encodes the Avro record later. Validation tests exact types first because
that is cheapest; anything unusual goes to ``producers.events``, which converts or raises.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from producers import events as v
from producers.queue import SPANS, STEPS, Channel
from producers.sender import DEFAULT_BUFFER_BYTES, Outgoing, Sender, SenderConfig
from rlpulse.settings import Settings
from schemas.catalogue import run_key

if TYPE_CHECKING:
    from producers.aio import AsyncTrainingTelemetry
    from producers.otel import RlpulseSpanExporter

log = logging.getLogger(__name__)

MAX_TERMS = 64  # distinct reward terms per run: a high-cardinality guard (seed 000)
SPAN_KINDS = ("ROLLOUT", "REWARD", "LLM", "TOOL", "GRADER", "ANNOTATION", "CUSTOM")
# Encoded bytes of a span's fixed fields (ids, times, numbers, enum and union indexes), for
# the too-large check; the variable ones (strings, maps) are added from their lengths.
SPAN_ENCODED_BYTES = 160
# What one queued event holds in memory until it is acknowledged (its argument tuples, number
# objects, copied dicts; measured with tracemalloc), which is 2-4x its encoded size: counting
# this makes buffer_bytes bound the SDK's memory, not only the bytes it would put on the wire.
# Strings add their length (a rollout id made per call is kept alive by the queue).
ROLLOUT_QUEUED_BYTES = 480
GRADER_QUEUED_BYTES = 420
STEP_QUEUED_BYTES = 380
DICT_QUEUED_BYTES = 240  # a copied term_shares or attributes dict, plus ENTRY_BYTES an entry
ENTRY_BYTES = 60
_NO_SHARES: dict[str, float] = {}  # shared, never mutated: the builders only read it
_SPAN_NULLS = dict(parent_span_id=None, status_message="", attempt_id="", step=None, attributes={}, term=None,
                   outcome=None, score=None, judge_input_tokens=None, judge_output_tokens=None, reward=None,
                   term_shares={}, completion_tokens=None, max_tokens=None, clipped=None, sample_id=None)


def _span_id(text: str) -> bytes:
    """Deterministic 8-byte id, so a rollout's children can name it as their parent."""
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def _trace_id(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _random_span_id() -> bytes:
    # The module's generator: reseeded in a forked child, and ~15x cheaper than os.urandom's syscall.
    return random.getrandbits(64).to_bytes(8, "big")


class TrainingTelemetry:
    """Publishes a run's rollouts, grader calls and steps without blocking the training thread.

    Use as a context manager (RUN_START on enter, RUN_END and a final flush on exit). A
    background timer sends a HEARTBEAT with the current ``step_count`` every
    ``heartbeat_interval`` seconds, which the stall detector relies on. Each instance is one
    writer: a random ``writer_id`` and its own sequence of ids for spans and for steps.
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
        sender_config: SenderConfig | None = None,
    ):
        self.project = v.require_str("project", project)
        self.run_id = v.require_str("run_id", run_id)
        if type(attempt) is not int or attempt < 1:
            raise ValueError(f"attempt must be a positive integer, got {attempt!r}")
        self.attempt = attempt
        self.trainer = v.require_choice("trainer", trainer, v.TRAINERS)
        self.stage = v.require_str("stage", stage, allow_empty=True)
        self.settings = settings or Settings.load()
        self.writer_id = os.urandom(8).hex()
        self.key = run_key(self.project, self.run_id)
        self._clock = clock
        self._sender = Sender(self.settings, buffer_bytes=buffer_bytes if sender_config is None else None,
                              config=sender_config)
        self._put = self._sender.queue.put
        spans, steps = self.settings.topic("spans"), self.settings.topic("steps")
        self._rollout_channel = Channel(spans, self.key, "Span", self._build_rollout)
        self._grader_channel = Channel(spans, self.key, "Span", self._build_grader)
        self._span_channel = Channel(spans, self.key, "Span", self._build_span)
        self._step_channel = Channel(steps, self.key, "Step", self._build_step)
        identity = dict(project=self.project, run_id=self.run_id, attempt=attempt, stage=self.stage,
                        writer_id=self.writer_id)
        self._span_base = {**_SPAN_NULLS, **identity, "status": "OK"}
        self._step_base = {**identity, "trainer": self.trainer}
        self._span_encoded_bytes = SPAN_ENCODED_BYTES + sum(map(len, (self.project, self.run_id, self.stage, self.writer_id)))
        self._span_limit = self._sender.max_record_bytes("Span", self.key)
        # Below this many estimated bytes a span fits even if every character took 4 bytes in
        # UTF-8: only above it is the exact size worked out (refuse_oversized).
        self._span_quick_limit = self._span_limit // 4
        self._terms: set[str] = set()
        self._terms_lock = threading.Lock()
        self.step_count = 0
        self._step_lock = threading.Lock()  # step_count, its sequence id and its queueing: one step
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
            log.warning("run %s/%d: %d events undelivered, %d dropped (buffer full)", self.run_id, self.attempt,
                        undelivered, self._sender.dropped)
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
    def delivered(self) -> int:
        """Events the broker has acknowledged."""
        return self._sender.delivered

    @property
    def pending(self) -> int:
        """Events accepted and not yet acknowledged."""
        return self._sender.pending

    @property
    def sender(self) -> Sender:
        """The sender this writer queues on (its counters, ``queued_records`` for inspection)."""
        return self._sender

    @property
    def aio(self) -> "AsyncTrainingTelemetry":
        """The asyncio face of this object, sharing its sender."""
        from producers.aio import AsyncTrainingTelemetry

        return AsyncTrainingTelemetry(telemetry=self)

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
        # `x - x` is 0.0 for a finite float and NaN (truthy) for NaN and the infinities.
        if type(step) is not int or step < 0:
            v.require_step("step", step)
        if type(rollout_id) is not str or not rollout_id:
            v.require_str("rollout_id", rollout_id)
        if type(reward) is not float or reward - reward:
            reward = v.require_finite("reward", reward)
        size = ROLLOUT_QUEUED_BYTES + len(rollout_id)
        if term_shares:
            shares = self._checked_shares(term_shares)
            size += DICT_QUEUED_BYTES + sum(map(len, shares)) + ENTRY_BYTES * len(shares)
        elif term_shares is None or type(term_shares) is dict:
            shares = _NO_SHARES
        else:
            shares = self._checked_shares(term_shares)
        if completion_tokens is not None and (type(completion_tokens) is not int or completion_tokens < 0):
            v.require_count("completion_tokens", completion_tokens)
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 0):
            v.require_count("max_tokens", max_tokens)
        if clipped is None:
            if completion_tokens is not None and max_tokens is not None:
                clipped = completion_tokens >= max_tokens
        elif type(clipped) is not bool:
            raise ValueError(f"clipped must be True, False or None, got {clipped!r}")
        if sample_id is not None:
            if type(sample_id) is not str or not sample_id:
                v.require_str("sample_id", sample_id)
            size += len(sample_id)
        if type(duration_s) is not float or duration_s - duration_s or duration_s < 0.0:
            duration_s = v.require_finite("duration_s", duration_s, minimum=0.0)
        if attributes is not None:
            attributes, extra = v.sized_attributes("attributes", attributes)
            size += extra
        if size > self._span_quick_limit:
            v.refuse_oversized("Span", self._span_limit, self._span_encoded_bytes, dict(
                rollout_id=rollout_id, sample_id=sample_id, term_shares=shares, attributes=attributes))
        self._put(SPANS, self._rollout_channel, (self._clock(), step, rollout_id, reward, shares, completion_tokens,
                                                  max_tokens, clipped, sample_id, duration_s, attributes), size)

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
        if type(step) is not int or step < 0:
            v.require_step("step", step)
        if type(rollout_id) is not str or not rollout_id:
            v.require_str("rollout_id", rollout_id)
        if type(term) is not str or term not in self._terms:
            self._check_term(v.require_str("term", term))
        if type(outcome) is not str or outcome not in v.GRADER_OUTCOMES:
            v.require_choice("outcome", outcome, v.GRADER_OUTCOMES)
        if type(duration_s) is not float or duration_s - duration_s or duration_s < 0.0:
            duration_s = v.require_finite("duration_s", duration_s, minimum=0.0)
        if score is not None and (type(score) is not float or score - score):
            score = v.optional_finite("score", score)
        if input_tokens is not None and (type(input_tokens) is not int or input_tokens < 0):
            v.require_count("input_tokens", input_tokens)
        if output_tokens is not None and (type(output_tokens) is not int or output_tokens < 0):
            v.require_count("output_tokens", output_tokens)
        size = GRADER_QUEUED_BYTES + len(rollout_id) + 2 * len(term)
        if size > self._span_quick_limit:
            v.refuse_oversized("Span", self._span_limit, self._span_encoded_bytes, dict(rollout_id=rollout_id, term=term, name=term))
        self._put(SPANS, self._grader_channel, (self._clock(), step, rollout_id, term, outcome, duration_s, score,
                                                 input_tokens, output_tokens), size)

    def step_completed(self, step: int, tokens: int = 0, duration_s: float = 0.0, mfu: float | None = None) -> None:
        """Record a completed step; ``step_count`` goes up by one (a repeated step after a restore counts again)."""
        v.require_step("step", step)
        v.require_step("tokens", tokens)
        duration_s = v.require_finite("duration_s", duration_s, minimum=0.0)
        mfu = v.optional_finite("mfu", mfu, minimum=0.0)
        self._step_event("STEP", step, tokens, duration_s, mfu, completed=1)

    def heartbeat(self) -> None:
        """Publish the current ``step_count`` now (the background timer calls this)."""
        self._step_event("HEARTBEAT")

    def span_exporter(self) -> "RlpulseSpanExporter":
        """An OpenTelemetry SpanExporter publishing the job's own spans (see ``producers.otel``)."""
        from producers.otel import RlpulseSpanExporter

        return RlpulseSpanExporter(self)

    # -- publishing other records through this writer's queue --------------------------------
    def publish_span(self, span: Mapping[str, Any]) -> bool:
        """Queue one span given as Span record fields (what ``producers.otel`` converts a span to).

        ``time_ns``, ``trace_id``, ``span_id``, ``name``, ``kind``, ``start_time_ns`` and
        ``end_time_ns`` are required; the identity, ``writer_id`` and ``sequence_id`` are this
        writer's and override any given. Returns False when the buffer was full (counted in
        ``dropped``); raises ValueError for a bad kind or a span that can never fit a message.
        """
        fields = dict(span)
        kind = fields.get("kind")
        if kind not in SPAN_KINDS:
            raise ValueError(f"kind must be one of {', '.join(SPAN_KINDS)}; got {kind!r}")
        for name in ("time_ns", "trace_id", "span_id", "name", "start_time_ns", "end_time_ns"):
            if fields.get(name) is None:
                raise ValueError(f"span field {name} is required")
        variable = {k: fields.get(k) for k in ("name", "status_message", "rollout_id", "attempt_id", "attributes",
                                               "term", "outcome", "sample_id", "term_shares")}
        v.refuse_oversized("Span", self._span_limit, self._span_encoded_bytes, variable)
        return self._put(SPANS, self._span_channel, fields, v.queued_bytes(fields))

    def publish_hardware(self, record_type: str, key: str, record: Mapping[str, Any]) -> bool:
        """Queue a ``GpuSample`` or ``Placement`` record on ``<prefix>.hardware`` under ``key`` (the hw_id).

        Checked against its schema at the call (ValueError naming the field); False when the
        buffer was full. The GPU poller publishes the same way through ``Sender.offer``.
        """
        return self._sender.offer(Outgoing(self.settings.topic("hardware"), key, record_type, record))

    # -- internals -------------------------------------------------------------------------
    def _check_term(self, term: str) -> None:
        with self._terms_lock:
            if term not in self._terms:
                if len(self._terms) >= MAX_TERMS:
                    raise ValueError(f"term {term!r} would be distinct term number {MAX_TERMS + 1} for this run; "
                                     f"at most {MAX_TERMS} are allowed")
                self._terms.add(term)

    def _checked_shares(self, shares: Any) -> dict[str, float]:
        """A copy of ``term_shares``, checked: the common case (known terms, finite floats) in one loop."""
        if type(shares) is dict and len(shares) <= MAX_TERMS:
            terms = self._terms
            for term, share in shares.items():
                if type(share) is not float or share - share or term not in terms:
                    break
            else:
                return shares.copy()  # a copy: the caller may reuse its dict after the call
        checked = v.float_map("term_shares", shares, MAX_TERMS)
        for term in checked:
            self._check_term(term)
        return checked

    def _step_event(self, type_: str, step: int = -1, tokens: int = 0, duration_s: float = 0.0,
                    mfu: float | None = None, completed: int = 0) -> None:
        with self._step_lock:  # so step_count and the sequence id rise together across threads
            self.step_count += completed
            # RUN_END says how many spans this writer numbered, so the streams can close the run as
            # soon as they have applied the last one instead of waiting for it to go quiet.
            spans_sent = self._sender.queue.last_sequence(SPANS) if type_ == "RUN_END" else 0
            self._put(STEPS, self._step_channel,
                      (self._clock(), type_, step, self.step_count, tokens, duration_s, mfu, spans_sent), STEP_QUEUED_BYTES)

    def _heartbeat_loop(self) -> None:
        while not self._stop_heartbeat.wait(self.settings.heartbeat_interval):
            self.heartbeat()

    # -- record builders: these run on the sender's thread -----------------------------------
    def _build_rollout(self, seq: int, a: tuple) -> dict[str, Any]:
        now, step, rollout_id, reward, shares, completion_tokens, max_tokens, clipped, sample_id, duration_s, attrs = a
        ids = f"{self.run_id}/{self.attempt}/{rollout_id}"
        return {**self._span_base, "sequence_id": seq, "time_ns": now, "trace_id": _trace_id(ids),
                "span_id": _span_id(f"{ids}/rollout"), "name": "rollout", "kind": "ROLLOUT",
                "start_time_ns": now - int(duration_s * 1e9), "end_time_ns": now, "rollout_id": rollout_id,
                "step": step, "attributes": attrs or {}, "reward": reward, "term_shares": shares,
                "completion_tokens": completion_tokens, "max_tokens": max_tokens, "clipped": clipped,
                "sample_id": sample_id}

    def _build_grader(self, seq: int, a: tuple) -> dict[str, Any]:
        now, step, rollout_id, term, outcome, duration_s, score, input_tokens, output_tokens = a
        ids = f"{self.run_id}/{self.attempt}/{rollout_id}"
        ok = outcome == "ok"
        return {**self._span_base, "sequence_id": seq, "time_ns": now, "trace_id": _trace_id(ids),
                "span_id": _random_span_id(), "parent_span_id": _span_id(f"{ids}/rollout"), "name": f"grader {term}",
                "kind": "GRADER", "start_time_ns": now - int(duration_s * 1e9), "end_time_ns": now,
                "status": "OK" if ok else "ERROR", "status_message": "" if ok else outcome, "rollout_id": rollout_id,
                "step": step, "term": term, "outcome": outcome,
                "score": score if ok else 0.0,  # a failed score counts as zero for its term (seed 001)
                "judge_input_tokens": input_tokens, "judge_output_tokens": output_tokens}

    def _build_span(self, seq: int, fields: dict[str, Any]) -> dict[str, Any]:
        return {**self._span_base, **fields, **{k: self._span_base[k] for k in ("project", "run_id", "attempt",
                                                                                  "stage", "writer_id")},
                "sequence_id": seq}

    def _build_step(self, seq: int, a: tuple) -> dict[str, Any]:
        now, type_, step, step_count, tokens, duration_s, mfu, spans_sent = a
        return {**self._step_base, "sequence_id": seq, "time_ns": now, "type": type_, "step": step, "spans_sent": spans_sent,
                "step_count": step_count, "tokens": tokens, "duration_s": duration_s,
                "throughput": tokens / duration_s if duration_s > 0 else 0.0, "mfu": mfu,
                "dropped_events": self._sender.dropped}
