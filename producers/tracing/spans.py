"""The spans behind ``rlpulse.producers.tracing``'s decorators: the ``Tracer`` that publishes them through
a ``TrainingTelemetry``, the current span (a context variable) and the rollout a block is bound to.

A span is opened when a traced call starts and published (``publish_span``: the run's identity and
a ``sequence_id`` from the telemetry) when it ends, so a child goes out before its entry. An entry
(ROLLOUT or REWARD) knows its rollout; a ROLLOUT entry takes the ids ``TrainingTelemetry.rollout``
would give that rollout's span, so graders published with ``tel.grader`` nest under it too.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import quote
from typing import Any, Protocol
from collections.abc import Callable, Iterator, Mapping

from rlpulse.producers.sdk import events as v
import rlpulse.producers.tracing.content as tc
from rlpulse.producers.sdk.records import random_span_id, span_id, trace_id
from rlpulse.producers.sdk.sequence import StartSequence
from rlpulse.base.env import TRACE_CONTENT

log = logging.getLogger(__name__)

DEFAULT_CONTENT_LIMIT = 32 * 1024  # characters per content attribute
MIN_CONTENT_LIMIT = 256
MAX_METRIC_NAMES = 10  # seed 000: "keep key metrics <= 10": per call, and distinct names per run and kind
MAX_METRIC_NAME = 64  # characters of a metric's name
REFUSED_LOG_INTERVAL_S = 10.0
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


class SpanWriter(Protocol):
    """What a tracer publishes through: a ``TrainingTelemetry``."""

    run_id: str
    attempt: int

    def publish_span(self, span: Mapping[str, Any]) -> bool: ...


def content_from_env(environ: Mapping[str, str] = os.environ) -> bool:
    """``RLPULSE_TRACE_CONTENT``: 1/true/yes/on records content; unset, 0/false/no/off does not."""
    value = environ.get(TRACE_CONTENT, "").strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(f"{TRACE_CONTENT} must be 1 or 0 (true/false, yes/no, on/off), got {value!r}")


@dataclass(eq=False)
class OpenSpan:
    """A span opened by a traced call, published by ``Tracer.finish`` when the call ends."""

    tracer: Tracer
    kind: str
    name: str
    trace_id: bytes
    span_id: bytes
    parent_id: bytes | None
    rollout_id: str
    step: int | None
    start_ns: int
    entry: OpenSpan | None  # the nearest entry span (itself, for an entry)
    outer: OpenSpan | None = None  # an entry's enclosing entry
    content: tc.Content | None = None
    attributes: dict[str, Any] = field(default_factory=dict)
    fields: dict[str, Any] = field(default_factory=dict)  # an entry's typed fields (reward, sample_id, ...)
    metrics: dict[str, float] = field(default_factory=dict)
    output_tokens: int | None = None  # summed over an entry's LLM calls
    finish_reason: str | None = None  # its last LLM call's
    max_tokens: int | None = None  # its last LLM call's request
    failure: str | None = None  # an entry whose result says it failed (seed 000's status / error): ERROR
    sequence_id: int = 0  # taken when it opened (rlpulse.producers.sdk.sequence): start order across processes


CURRENT: contextvars.ContextVar[OpenSpan | None] = contextvars.ContextVar("rlpulse_span", default=None)
BINDING: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("rlpulse_rollout", default=None)
_installed: list[Tracer] = []  # the process's tracers, innermost last
_warned = [False]


class Tracer:
    """Publishes the spans of decorated functions and wrapped clients through ``telemetry``.

    ``content``: record message content (None: ``RLPULSE_TRACE_CONTENT``); ``content_limit``: the most
    characters of one content attribute (256 to 65,536). Active while installed (``with tracer:``
    or ``install()``), for the whole process. ``stream_usage``: a traced streamed chat call without the
    caller's ``stream_options`` asks for usage (the extra chunk is swallowed); ``token_ids``: record vLLM's
    token ids and logprobs (capped); ``request_token_ids``: ask vLLM for them (``trace_client``).
    """

    def __init__(self, telemetry: SpanWriter | Any, content: bool | None = None, content_limit: int = DEFAULT_CONTENT_LIMIT,
                 clock: Callable[[], int] = time.time_ns, stream_usage: bool = True, token_ids: bool = False,
                 request_token_ids: bool = False):
        if type(content_limit) is not int or not MIN_CONTENT_LIMIT <= content_limit <= v.MAX_VALUE:
            raise ValueError(f"content_limit must be an integer from {MIN_CONTENT_LIMIT} to {v.MAX_VALUE} "
                             f"(characters of one attribute), got {content_limit!r}")
        if content is not None and type(content) is not bool:
            raise ValueError(f"content must be True, False or None ({TRACE_CONTENT}), got {content!r}")
        # an AsyncTrainingTelemetry publishes through its sync telemetry (publish_span is a plain call there)
        self.telemetry: SpanWriter = getattr(telemetry, "sync", telemetry)
        self.content = content_from_env() if content is None else content
        self.content_limit = content_limit
        self.clock = clock
        self._own_sequence = StartSequence(clock)  # for a telemetry without a start-order clock of its own
        self.stream_usage, self.token_ids, self.request_token_ids = stream_usage, token_ids, request_token_ids
        self.published = 0  # spans handed to the telemetry (a full buffer counts in telemetry.dropped)
        self.refused = 0  # spans the Span schema or the input limits refused: logged, never raised
        self.content_cut = 0  # spans whose content the cap cut (rlpulse.content.cut_chars says how much)
        self._metric_names: dict[str, set[str]] = {"rollout_metrics": set(), "reward_metrics": set()}
        self._lock = threading.Lock()
        self._last_log = -REFUSED_LOG_INTERVAL_S

    @property
    def sequence(self) -> StartSequence:
        """The writer's start-order clock, so traced spans and tel.rollout / tel.grader spans share one
        order; read each time, since a forked child's writer gets a clock (and a lock) of its own."""
        return getattr(self.telemetry, "sequence", None) or self._own_sequence

    def install(self) -> Tracer:
        _installed.append(self)
        return self

    def uninstall(self) -> None:
        if self in _installed:
            _installed.reverse()
            _installed.remove(self)  # the innermost installation of it
            _installed.reverse()

    def __enter__(self) -> Tracer:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # -- spans ---------------------------------------------------------------------------------
    def open_entry(self, kind: str, name: str, found: Mapping[str, Any]) -> OpenSpan:
        parent, binding = CURRENT.get(), BINDING.get() or {}
        outer = parent.entry if parent is not None else None

        def pick(key: str) -> Any:  # the call's own, then the enclosing entry's, then bind_rollout's
            if found.get(key) is not None:
                return found[key]
            if outer is not None:
                inherited = {"step": outer.step, "rollout_id": outer.rollout_id}.get(key, outer.fields.get(key))
                if inherited is not None:
                    return inherited
            return binding.get(key)

        rollout_id, step = pick("rollout_id"), pick("step")
        attributes: dict[str, Any] = {"code.function.name": name}
        if rollout_id is None or rollout_id == "":
            rollout_id = os.urandom(8).hex()
            attributes["rlpulse.rollout_id_generated"] = True
        v.require_name("rollout_id", rollout_id)
        if step is not None:
            v.require_step("step", step)
        fields: dict[str, Any] = {}
        if kind == "ROLLOUT":
            if pick("sample_id") is not None:
                fields["sample_id"] = v.require_name("sample_id", pick("sample_id"))
            if pick("policy_version") is not None:
                fields["policy_version"] = v.require_step("policy_version", pick("policy_version"))
        ids = f"{self.telemetry.run_id}/{self.telemetry.attempt}/{rollout_id}"
        rollout_span = span_id(f"{ids}/rollout")  # the ids TrainingTelemetry.rollout gives the rollout's span
        remote = binding if parent is None and binding.get("remote_span_id") and \
            binding.get("remote_rollout_id") == rollout_id else None  # a propagated context (continue_trace) of it
        if kind == "ROLLOUT":
            own, parent_id = rollout_span, None
        else:
            own = random_span_id()
            parent_id = parent.span_id if parent is not None and parent.rollout_id == rollout_id else \
                remote["remote_span_id"] if remote is not None else rollout_span
        after = parent.sequence_id if parent is not None else binding.get("remote_sequence_id", 0)
        span = OpenSpan(self, kind, name, trace_id(ids), own, parent_id, rollout_id, step, self.clock(), None, outer,
                        attributes=attributes, fields=fields, sequence_id=self.sequence.take(after))
        span.entry = span
        return span

    def open_child(self, kind: str, name: str) -> OpenSpan:
        parent, binding = CURRENT.get(), BINDING.get()
        content = tc.Content(self.content_limit) if self.content else None
        if parent is not None:
            return OpenSpan(self, kind, name, parent.trace_id, random_span_id(), parent.span_id, parent.rollout_id,
                            parent.step, self.clock(), parent.entry, content=content,
                            sequence_id=self.sequence.take(parent.sequence_id))
        seq = self.sequence.take((binding or {}).get("remote_sequence_id", 0))
        if binding and binding.get("rollout_id"):
            ids = f"{self.telemetry.run_id}/{self.telemetry.attempt}/{binding['rollout_id']}"
            remote = binding.get("remote_span_id") if binding.get("remote_rollout_id") == binding["rollout_id"] else None
            return OpenSpan(self, kind, name, trace_id(ids), random_span_id(), remote or span_id(f"{ids}/rollout"),
                            binding["rollout_id"],
                            binding.get("step"), self.clock(), None, content=content, sequence_id=seq)
        return OpenSpan(self, kind, name, os.urandom(16), random_span_id(), None, "", None, self.clock(), None,
                        content=content, sequence_id=seq)

    def finish(self, span: OpenSpan, error: BaseException | None) -> None:
        end = self.clock()
        record: dict[str, Any] = {
            "time_ns": end, "trace_id": span.trace_id, "span_id": span.span_id, "parent_span_id": span.parent_id,
            "name": span.name[:v.MAX_NAME], "kind": span.kind, "start_time_ns": min(span.start_ns, end), "end_time_ns": end,
            "status": "OK", "rollout_id": span.rollout_id, "step": span.step, "attributes": span.attributes,
            "sequence_id": span.sequence_id,
        }
        if error is None and span.failure is not None:
            record["status"], record["status_message"] = "ERROR", span.failure[:v.MAX_VALUE]
        if error is not None:
            record["status"], record["status_message"] = "ERROR", type(error).__name__
            span.attributes["error.type"] = f"{type(error).__module__}.{type(error).__qualname__}"[:v.MAX_VALUE]
            status_code = getattr(error, "status_code", None)
            if type(status_code) is int:
                span.attributes["http.response.status_code"] = status_code
        if span.entry is span:
            record.update(self._entry_fields(span))
        elif span.fields:  # a reward annotation's typed reward (emit_reward)
            record.update(span.fields)
        if span.content is not None and span.content.cut:
            with self._lock:
                self.content_cut += 1
        self._publish(record)

    def _entry_fields(self, span: OpenSpan) -> dict[str, Any]:
        fields = dict(span.fields)
        if span.metrics:
            fields["metrics"] = dict(span.metrics)
        if span.kind == "ROLLOUT":
            fields.setdefault("completion_tokens", span.output_tokens)
            fields.setdefault("finish_reason", span.finish_reason)
            fields.setdefault("max_tokens", span.max_tokens)
            reason, tokens, limit = fields["finish_reason"], fields["completion_tokens"], fields["max_tokens"]
            if reason is not None:  # as TrainingTelemetry.rollout decides clipped
                fields["clipped"] = reason == "length"
            elif tokens is not None and limit is not None:
                fields["clipped"] = tokens >= limit
        elif span.outer is not None and span.outer.kind == "ROLLOUT" and "reward" in fields:
            span.outer.fields.setdefault("reward", fields["reward"])  # the rollout's reward, so the streams count it
        elif span.outer is not None and span.outer.kind == "ROLLOUT" and span.failure is not None:
            span.outer.failure = span.outer.failure or f"reward {span.failure}"  # scored by no one: a failed rollout
        return fields

    def _publish(self, record: dict[str, Any]) -> None:
        try:
            self.telemetry.publish_span(record)  # False (buffer full) is counted in the telemetry's dropped
            with self._lock:
                self.published += 1
        except Exception as exc:  # a value the Span schema refuses: this span only, never the traced call
            self.refuse(record["name"], exc)

    def refuse(self, name: str, exc: Exception) -> None:
        """Count a span that could not be published, and log it at most every REFUSED_LOG_INTERVAL_S."""
        with self._lock:
            self.refused += 1
            now, due = time.monotonic(), False
            if now - self._last_log >= REFUSED_LOG_INTERVAL_S:
                self._last_log, due = now, True
        if due:
            log.warning("traced span %r not published: %s (%d refused so far; see Tracer.refused)", name, exc, self.refused)

    def register_metrics(self, field_name: str, names: list[str]) -> None:
        with self._lock:
            known = self._metric_names[field_name]
            new = [n for n in names if n not in known]
            if len(known) + len(new) > MAX_METRIC_NAMES:
                raise ValueError(
                    f"{field_name} name {new[MAX_METRIC_NAMES - len(known)]!r} would be distinct name number "
                    f"{MAX_METRIC_NAMES + 1} of {field_name} for run {self.telemetry.run_id}; at most {MAX_METRIC_NAMES} "
                    "are allowed (seed 000: keep key metrics <= 10, never ids such as user or request ids as names)")
            known.update(new)


def current_tracer() -> Tracer | None:
    current = CURRENT.get()
    if current is not None:
        return current.tracer
    if _installed:
        return _installed[-1]
    if not _warned[0]:
        _warned[0] = True
        log.warning("rlpulse tracing: a traced function ran with no Tracer installed (`with Tracer(tel):`); "
                    "its calls are not traced")
    return None


@contextlib.contextmanager
def bind_rollout(*, step: int | None = None, rollout_id: str | None = None, sample_id: str | None = None,
                 policy_version: int | None = None) -> Iterator[None]:
    """Name the rollout that entries and LLM/TOOL spans opened in this block belong to."""
    given = {"step": step, "rollout_id": rollout_id, "sample_id": sample_id, "policy_version": policy_version}
    token = BINDING.set({**(BINDING.get() or {}), **{k: x for k, x in given.items() if x is not None}})
    try:
        yield
    finally:
        BINDING.reset(token)


def start_llm(tracer: Tracer, name: str, request: Mapping[str, Any]) -> OpenSpan:
    """An open LLM span for a chat request given as keyword arguments (``trace_client`` uses it too)."""
    span = tracer.open_child("LLM", name)
    span.attributes.update(tc.request_attributes(request, span.content))
    limit = request.get("max_completion_tokens") or request.get("max_tokens")
    if type(limit) is int and span.entry is not None:
        span.entry.max_tokens = limit
    return span


def finish_llm(span: OpenSpan, response: Any, error: BaseException | None) -> None:
    """Close an LLM span with its response's usage, finish reason, tool calls and (content on) messages."""
    if error is None and response is not None:
        attrs, tokens_out, reason = tc.response_attributes(response, span.content)
        span.attributes.update(attrs)
        if span.entry is not None:
            if tokens_out is not None:
                span.entry.output_tokens = (span.entry.output_tokens or 0) + tokens_out
            span.entry.finish_reason = reason or span.entry.finish_reason
    span.tracer.finish(span, error)



HEADER_SAFE = "-._~"  # id characters sent as they are; any other is percent-encoded (headers are ASCII)


def outgoing_headers(span: OpenSpan) -> dict[str, str]:
    """The headers a request made inside ``span`` carries so that a span the server (or a process it
    calls) opens joins this rollout after ``span``: W3C ``traceparent``, rlpulse's ``baggage`` (run,
    attempt, rollout, step, sequence id) and seed 003's ``x-rollout-id`` / ``x-attempt-id`` (the run's
    attempt) / ``x-sequence-id``. ``rlpulse.producers.tracing.continue_trace`` reads them back."""
    telemetry = span.tracer.telemetry
    # the writer's latest start, not only this span's: a span started from these headers comes after
    # every span this process started before the request (an entry's earlier calls too)
    sequence = max(span.sequence_id, span.tracer.sequence.last())
    headers = {"traceparent": f"00-{span.trace_id.hex()}-{span.span_id.hex()}-01"}
    if not span.rollout_id:  # a root span of no rollout: the trace context only
        return headers
    rollout = quote(span.rollout_id, safe=HEADER_SAFE)
    baggage = [f"rlpulse.run_id={quote(str(telemetry.run_id), safe=HEADER_SAFE)}", f"rlpulse.attempt={telemetry.attempt}",
               f"rlpulse.rollout_id={rollout}", f"rlpulse.sequence_id={sequence}"]
    if span.step is not None:
        baggage.append(f"rlpulse.step={span.step}")
    headers.update({"baggage": ",".join(baggage), "x-rollout-id": rollout, "x-attempt-id": str(telemetry.attempt),
                    "x-sequence-id": str(sequence)})
    return headers
