"""``TrainingTelemetry``: the calls a training loop makes (docs/sdk-and-tracing.md).

A call only validates its arguments and queues them (a tuple) with a sequence id; the sender
thread builds and encodes the Avro record later. Validation tests exact types first because
that is cheapest; anything unusual goes to ``rlpulse.producers.sdk.events``, which converts or raises.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterable, Mapping

from rlpulse.producers.sdk import events as v
from rlpulse.producers.sdk import process
from rlpulse.producers.sdk.process import run_status
from rlpulse.producers.sdk.aio import AsyncTelemetry
from rlpulse.producers.sdk.batch import RolloutBatch
from rlpulse.producers.sdk.checkpoints import CheckpointCalls
from rlpulse.producers.sdk.delivery import Transport
from rlpulse.producers.sdk.queue import DICT_QUEUED_BYTES, ENTRY_BYTES, GRADER_QUEUED_BYTES, ROLLOUT_QUEUED_BYTES, SPANS, Channel
from rlpulse.producers.sdk.records import SPAN_NULLS, Records
from rlpulse.producers.sdk.run_config import NO_CONFIG, ConfigCalls, flatten_config
from rlpulse.producers.sdk.sender import DEFAULT_BUFFER_BYTES, Sender, SenderConfig
from rlpulse.producers.sdk.sequence import StartSequence
from rlpulse.producers.sdk.span_fields import SPAN_ENCODED_BYTES
from rlpulse.producers.sdk.steps import GRADER_CALLS, GRADER_CALLS_WITH_STEP, HeldGraderCalls, StepCalls
from rlpulse.producers.sdk.writer import SenderFaces
from rlpulse.schemas.catalogue import run_key
from rlpulse.schemas.enums import FINISH_TRUNCATED, GRADER_OUTCOMES, RUN_STATUSES, TRAINERS
from rlpulse.base.settings import Settings

if TYPE_CHECKING:  # imported when first asked for: OpenTelemetry's SDK is slow to import
    from rlpulse.producers.sdk.otel import RlpulseSpanExporter

log = logging.getLogger(__name__)

MAX_TERMS = v.MAX_TERMS  # distinct reward terms per run: a high-cardinality guard (seed 000)
_NO_SHARES: dict[str, float] = {}  # shared, never mutated: the builders only read it
assert v.MAX_DURATION_S == 1e9 and v.MAX_NAME == 256  # the calls test these literals


class TrainingTelemetry(SenderFaces, StepCalls, CheckpointCalls, ConfigCalls):
    """Publishes a run's rollouts, grader calls and steps without blocking the training thread.

    Use as a context manager (RUN_START on enter, RUN_END and a final flush on exit). A background
    timer sends a HEARTBEAT with the current ``step_count`` every ``heartbeat_interval`` seconds,
    which the stall detector relies on. Each instance is one writer: a random ``writer_id`` and its
    own sequence of ids for spans and for steps. Its copy in a forked child (a DataLoader worker) is
    a writer of its own; an interpreter that exits with it open delivers what it holds; an event
    after ``close()`` is still delivered (``rlpulse.producers.sdk.process``, ``_after_fork_in_child``).
    Events go to Kafka (``settings``), or through ``transport`` (``rlpulse.producers.sdk.memory``'s
    ``InMemoryTransport``: no broker). ``grader_calls``: ``call`` (default) publishes each ``grader()``
    call when made; ``step`` holds them until their step completes and never publishes those of a step
    the job did not complete (seed 001; ``rlpulse.producers.sdk.steps``). ``config``: the run's
    settings, sent on RUN_START (``rlpulse.producers.sdk.run_config``; a bad one raises ValueError here).
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
        transport: Transport | None = None,
        rank: int = 0,
        world_size: int = 1,
        grader_calls: str = "call",
        config: Any = None,
    ):
        self.project = v.require_name("project", project)
        self.run_id = v.require_name("run_id", run_id)
        if type(attempt) is not int or not 1 <= attempt <= v.INT_MAX:
            raise ValueError(f"attempt must be a positive integer (Avro int), got {attempt!r}")
        self.attempt = attempt
        self.trainer = v.require_choice("trainer", trainer, TRAINERS)
        self.stage = v.require_name("stage", stage, allow_empty=True)
        if type(world_size) is not int or world_size < 1 or type(rank) is not int or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an integer in [0, world_size) and world_size a positive integer; "
                             f"got rank={rank!r}, world_size={world_size!r}")
        self.rank, self.world_size = rank, world_size
        grader_calls = v.require_choice("grader_calls", grader_calls, GRADER_CALLS)
        self._config = NO_CONFIG if config is None else flatten_config(config)  # checked here: a bad one raises now
        self._started_ns: int | None = None  # the time of this writer's RUN_START (set_config's second one has it)
        self.settings = settings or Settings.load()
        self.writer_id = os.urandom(8).hex()
        self.key = run_key(self.project, self.run_id)
        self._clock = clock
        self._sender = Sender(self.settings, buffer_bytes=buffer_bytes if sender_config is None else None,
                              config=sender_config, transport=transport)
        self._put = self._sender.queue.put
        # grader() hands each call to _grader_put: the queue's put, or (step mode) the held calls' put
        self._held = HeldGraderCalls(self._sender.queue) if grader_calls == GRADER_CALLS_WITH_STEP else None
        self._grader_put = self._put if self._held is None else self._held.put
        spans, steps = self.settings.topic("spans"), self.settings.topic("steps")
        identity = dict(project=self.project, run_id=self.run_id, attempt=attempt, stage=self.stage,
                        writer_id=self.writer_id)
        self._span_base = {**SPAN_NULLS, **identity, "status": "OK"}
        self._step_base = {**identity, "trainer": self.trainer}
        self.sequence = StartSequence(clock)  # the start order of this writer's spans (rlpulse.producers.sdk.sequence)
        records = Records(self.run_id, attempt, self._span_base, self._step_base, lambda: self._sender.dropped,
                          lambda: self.sequence)
        self._rollout_channel = Channel(spans, self.key, "Span", records.rollout)
        self._grader_channel = Channel(spans, self.key, "Span", records.grader)
        self._span_channel = Channel(spans, self.key, "Span", records.span)
        self._step_channel = Channel(steps, self.key, "Step", records.step)
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
        self._forked = False  # a copy in a forked child: a worker of the run (see _after_fork_in_child)
        # A rank other than 0 publishes spans only: no run or step events, so a step counts once
        # however many ranks report it, and the stall detector hears one step_count.
        self._counts_steps = rank == 0
        process.track(self)

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> TrainingTelemetry:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self.close(status=run_status(exc_type))

    def start(self) -> None:
        """Start the sender and the heartbeat timer; publish RUN_START."""
        if self._open:
            return
        self._open = True
        self._sender.start()
        if self._forked or not self._counts_steps:  # a worker of the run, not the run: no RUN_START, no heartbeat
            return
        self._started_ns = self._clock()
        self._step_event("RUN_START", config=self._config, time_ns=self._started_ns)
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="rlpulse-heartbeat", daemon=True)
        self._heartbeat_thread.start()

    def flush(self, timeout: float = 30.0) -> int:
        """Deliver everything buffered; returns how many events are still undelivered."""
        return self._sender.flush(timeout)

    def close(self, timeout: float = 30.0, status: str = "finished") -> int:
        """Publish RUN_END with ``status`` (finished, failed or cancelled: the context manager sets it
        from the exception that left the block), deliver what is buffered, stop; the undelivered count."""
        if not self._open:
            return 0
        status = v.require_choice("status", status, RUN_STATUSES)
        self._open = False
        self._stop_heartbeat.set()
        self._stop_held()
        if not self._forked and self._counts_steps:
            self._step_event("RUN_END", status=status)
        undelivered = self._sender.close(timeout)
        if undelivered or self._sender.dropped:
            refused = self._sender.refused
            log.warning("run %s/%d: %d events undelivered, %d dropped (buffer full)%s", self.run_id, self.attempt,
                        undelivered, self._sender.dropped, f"; {refused}" if refused else "")
        return undelivered

    def abandon(self, timeout: float = 30.0) -> int:
        """Stop as a crashed job would, without RUN_END (for simulations); delivers what is buffered."""
        self._open = False
        self._stop_heartbeat.set()
        self._stop_held()
        return self._sender.close(timeout)

    @property
    def aio(self) -> AsyncTrainingTelemetry:
        """The asyncio face of this object, sharing its sender."""
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
        policy_version: int | None = None,
        finish_reason: str | None = None,
    ) -> None:
        """Record one rollout: its total reward, each term's weighted share and its completion length.

        ``clipped`` (truncated at the length limit; not PPO's ratio clipping) defaults to
        ``finish_reason == "length"`` when a finish reason is given, else to ``completion_tokens
        >= max_tokens`` when both are. ``policy_version`` is the step whose weights generated it:
        the step's staleness is ``step - policy_version``.
        """
        # All checks before any change (new terms registered last). `x - x` is NaN (truthy) for NaN
        # and infinities; ints fit Avro long (a literal bound); only non-ASCII text is encoded.
        if type(step) is not int or step < 0 or step > 9223372036854775807:
            v.require_step("step", step)
        if type(rollout_id) is not str or not rollout_id or not rollout_id.isascii() or len(rollout_id) > 256:  # MAX_NAME
            v.require_name("rollout_id", rollout_id)
        if type(reward) is not float or reward - reward:
            reward = v.require_finite("reward", reward)
        size = ROLLOUT_QUEUED_BYTES + len(rollout_id)
        fresh = None  # term_shares naming terms not yet known: registered once every check passed
        if term_shares:
            # inline, not a method: the common case (known terms, finite floats) in one loop
            if type(term_shares) is dict and len(term_shares) <= MAX_TERMS:
                terms = self._terms
                for term, share in term_shares.items():
                    if type(share) is not float or share - share or term not in terms:
                        shares = fresh = v.float_map("term_shares", term_shares, MAX_TERMS)
                        break
                else:
                    shares = term_shares.copy()  # a copy: the caller may reuse its dict after the call
            else:
                shares = fresh = v.float_map("term_shares", term_shares, MAX_TERMS)
            size += DICT_QUEUED_BYTES + sum(map(len, shares)) + ENTRY_BYTES * len(shares)
        elif term_shares is None or type(term_shares) is dict:
            shares = _NO_SHARES
        else:
            shares = fresh = v.float_map("term_shares", term_shares, MAX_TERMS)
        if completion_tokens is not None and (
                type(completion_tokens) is not int or completion_tokens < 0 or completion_tokens > 9223372036854775807):
            v.require_count("completion_tokens", completion_tokens)
        if max_tokens is not None and (
                type(max_tokens) is not int or max_tokens < 0 or max_tokens > 9223372036854775807):
            v.require_count("max_tokens", max_tokens)
        if finish_reason is not None:
            v.require_name("finish_reason", finish_reason, limit=v.MAX_FINISH_REASON)
            size += len(finish_reason)
        if policy_version is not None and (type(policy_version) is not int or not 0 <= policy_version <= 9223372036854775807):
            v.require_step("policy_version", policy_version)
        if clipped is None:
            if finish_reason is not None:
                clipped = finish_reason == FINISH_TRUNCATED
            elif completion_tokens is not None and max_tokens is not None:
                clipped = completion_tokens >= max_tokens
        elif type(clipped) is not bool:
            raise ValueError(f"clipped must be True, False or None, got {clipped!r}")
        if sample_id is not None:
            if type(sample_id) is not str or not sample_id or not sample_id.isascii() or len(sample_id) > 256:
                v.require_name("sample_id", sample_id)
            size += len(sample_id)
        if type(duration_s) is not float or not 0.0 <= duration_s <= 1e9:  # MAX_DURATION_S; NaN fails both
            duration_s = v.require_duration("duration_s", duration_s)
        if attributes is not None:
            attributes, extra = v.sized_attributes("attributes", attributes)
            size += extra
        if size > self._span_quick_limit:
            v.refuse_oversized("Span", self._span_limit, self._span_encoded_bytes, dict(
                rollout_id=rollout_id, sample_id=sample_id, term_shares=shares, attributes=attributes))
        if fresh:
            self._register_terms(fresh)
        self._put(SPANS, self._rollout_channel, (self._clock(), step, rollout_id, reward, shares, completion_tokens,
                                                  max_tokens, clipped, sample_id, duration_s, attributes, policy_version,
                                                  finish_reason), size)

    def rollouts(self, step: int, policy_version: int | None = None) -> RolloutBatch:
        """A batch of ``step``'s rollouts given a reward term at a time (``rlpulse.producers.sdk.batch``)."""
        return RolloutBatch(self.rollout, v.require_step("step", step), policy_version)

    def grader(
        self,
        step: int,
        rollout_id: str,
        term: str,
        outcome: str,
        duration_s: float | None = None,
        score: float | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        start_ns: int | None = None,
        end_ns: int | None = None,
    ) -> None:
        """Record one score of one reward term; ``outcome`` is ok or the failure cause (``error``:
        the grader raised). A failed score is stored as null whatever ``score`` says.

        The span's time is the grading's own: ``end_ns`` (ns since the epoch; default now) and
        ``start_ns`` (default ``end_ns - duration_s``). Windows count it at its end.
        """
        # As in rollout(): every check first, a new term registered last
        if type(step) is not int or step < 0 or step > 9223372036854775807:
            v.require_step("step", step)
        if type(rollout_id) is not str or not rollout_id or not rollout_id.isascii() or len(rollout_id) > 256:  # MAX_NAME
            v.require_name("rollout_id", rollout_id)
        new_term = type(term) is not str or term not in self._terms  # known terms were checked when first seen
        if new_term:
            v.require_name("term", term)
        if type(outcome) is not str or outcome not in GRADER_OUTCOMES:
            v.require_choice("outcome", outcome, GRADER_OUTCOMES)
        if duration_s is not None and (type(duration_s) is not float or not 0.0 <= duration_s <= 1e9):  # MAX_DURATION_S
            duration_s = v.require_duration("duration_s", duration_s)
        end = self._clock() if end_ns is None else v.require_long("end_ns", end_ns, minimum=0)
        if start_ns is not None:
            start = v.require_long("start_ns", start_ns, minimum=0)
            if start > end:
                raise ValueError(f"start_ns {start} is after end_ns {end}")
        else:
            start = end - int((duration_s or 0.0) * 1e9)
        if score is not None and (type(score) is not float or score - score):
            score = v.optional_finite("score", score)
        if input_tokens is not None and (
                type(input_tokens) is not int or input_tokens < 0 or input_tokens > 9223372036854775807):
            v.require_count("input_tokens", input_tokens)
        if output_tokens is not None and (
                type(output_tokens) is not int or output_tokens < 0 or output_tokens > 9223372036854775807):
            v.require_count("output_tokens", output_tokens)
        size = GRADER_QUEUED_BYTES + len(rollout_id) + 2 * len(term)
        if size > self._span_quick_limit:
            named = dict(rollout_id=rollout_id, term=term, name=term)
            v.refuse_oversized("Span", self._span_limit, self._span_encoded_bytes, named)
        if new_term:
            self._register_terms((term,))
        self._grader_put(SPANS, self._grader_channel,
                         (start, end, step, rollout_id, term, outcome, score, input_tokens, output_tokens), size)

    def span_exporter(self) -> RlpulseSpanExporter:
        """An OpenTelemetry SpanExporter publishing the job's own spans (see ``rlpulse.producers.sdk.otel``)."""
        from rlpulse.producers.sdk.otel import RlpulseSpanExporter

        return RlpulseSpanExporter(self)

    # -- internals -------------------------------------------------------------------------
    def _register_terms(self, terms: Iterable[str]) -> None:
        """Add checked terms to the run's known ones, all or none (ValueError past MAX_TERMS)."""
        with self._terms_lock:
            new = [t for t in terms if t not in self._terms]
            if len(self._terms) + len(new) > MAX_TERMS:
                raise ValueError(
                    f"term {new[MAX_TERMS - len(self._terms)]!r} would be distinct term number "
                    f"{MAX_TERMS + 1} for this run; at most {MAX_TERMS} are allowed"
                )
            self._terms.update(new)

    # -- process life (called by rlpulse.producers.sdk.process) ------------------------------------------
    def _after_fork_in_child(self) -> None:
        """This writer's copy in a forked child becomes a worker's writer of the same run.

        Its own ``writer_id``, so its sequences restart at 1 without colliding with the parent's
        (the streams keep marks per run, attempt and writer); its own empty queue and sender (the
        parent's queued events stay the parent's); locks and events made anew, never inherited
        (``rlpulse.producers.sdk.process`` says why); terms and ``step_count`` carried over.

        A DataLoader worker neither starts nor ends the run: no RUN_START, RUN_END or heartbeat. Its
        RUN_END would end the attempt for the stall detector (resolving alerts while the job trains
        on) and end the open steps; its heartbeats would report a stale ``step_count``. Its spans
        stream, never closed by a RUN_END, stops holding back the run's event time once the run's
        other writers have been heard from for the retention without it, and an idle run closes by
        the wall clock: the run never looks unfinished for good; at worst its last windows close a
        retention later. A child that leaves by ``os._exit`` must ``flush()`` first; a normal exit
        and a ``multiprocessing`` worker's exit deliver.
        """
        self._sender._after_fork_in_child()
        self._put = self._sender.queue.put
        self._held = None if self._held is None else self._held.renewed(self._sender.queue)  # the parent's are its own
        self._grader_put = self._put if self._held is None else self._held.put
        self.writer_id = os.urandom(8).hex()
        self._span_base["writer_id"] = self._step_base["writer_id"] = self.writer_id
        self.sequence = StartSequence(self._clock)  # a writer of its own: its own tag (and a lock made anew)
        self._terms_lock, self._step_lock = threading.Lock(), threading.Lock()
        self._stop_heartbeat = threading.Event()
        self._heartbeat_thread = None
        self._forked = True

    def _stop_at_exit(self) -> None:
        self._stop_heartbeat.set()  # the exit delivers what is buffered; no new heartbeat joins it
        self._stop_held()  # the job stops: held grader calls of steps it never completed are not published

    def _heartbeat_loop(self) -> None:
        while not self._stop_heartbeat.wait(self.settings.heartbeat_interval):
            self.heartbeat()


class AsyncTrainingTelemetry(AsyncTelemetry):
    """``async with AsyncTrainingTelemetry(project=..., run_id=...) as tel: await tel.rollout(...)``.

    Takes ``TrainingTelemetry``'s arguments; pass ``telemetry=`` to share an existing sync object
    (and its sender) instead. The coroutines are ``rlpulse.producers.sdk.aio``'s.
    """

    def __init__(self, *args: Any, telemetry: TrainingTelemetry | None = None, **kwargs: Any):
        super().__init__(telemetry or TrainingTelemetry(*args, **kwargs))
