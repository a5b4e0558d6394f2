"""A rollout's trace continued in another process: ``inject`` the current span's context into a
request's headers, and ``continue_trace`` from such headers where the request is served.

What travels (``rlpulse.producers.tracing.spans.outgoing_headers``, which traced LLM clients add to
every request by themselves): W3C ``traceparent``; ``baggage`` with ``rlpulse.run_id``,
``rlpulse.attempt``, ``rlpulse.rollout_id``, ``rlpulse.step`` and ``rlpulse.sequence_id``; and seed
003's ``x-rollout-id``, ``x-attempt-id`` (rlpulse's run attempt) and ``x-sequence-id``, so an LLM proxy
or a server that knows only those joins too. Baggage wins over the ``x-`` headers where both name
the rollout or step; the larger sequence id of the two is continued from.

Inside ``with continue_trace(headers):`` an entry (a REWARD processor run in a grading service) or
an LLM / TOOL span opened outside any entry belongs to the propagated rollout, hangs under the span
that made the request, and takes a ``sequence_id`` larger than that span's
(``rlpulse.producers.sdk.sequence``): ``ORDER BY sequence_id`` is start order across both processes.
The process's own ``TrainingTelemetry`` names the run it writes for; a context from another run or
attempt is refused (``ValueError``), as is any header that is malformed, oversized or out of range.
Every header is hostile until checked: each is bounded in size, parsed against an allowlist of
keys, and never evaluated.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterator, Mapping
from urllib.parse import unquote

from rlpulse.producers.sdk import events as v
from rlpulse.producers.sdk.records import trace_id
import rlpulse.producers.tracing.spans as tracing

MAX_HEADER = 8192  # characters of one header value we read (W3C asks baggage to stay under 8192 bytes)
MAX_MEMBERS = 64  # baggage list members looked at (W3C: at least 64 must be supported)
LONG_MAX = 2**63 - 1
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_NUMBER = re.compile(r"[0-9]{1,19}")


@dataclass(frozen=True)
class Context:
    """A propagated context: the rollout it belongs to and the span that made the request."""

    rollout_id: str
    span_id: bytes | None  # the remote parent (from traceparent); None: the rollout's entry is the parent
    sequence_id: int  # the remote parent's; spans started here come after it
    trace_id: bytes | None = None  # traceparent's trace id, with span_id
    step: int | None = None
    run_id: str | None = None
    attempt: int | None = None


def _header(carrier: Mapping[str, Any], name: str) -> str | None:
    """``name``'s value, looked up without regard to case; ValueError when it is not a bounded string."""
    for key, value in carrier.items():
        if isinstance(key, bytes):  # ASGI's raw headers
            key = key.decode("latin-1")
        if isinstance(key, str) and key.lower() == name:
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            if not isinstance(value, str):
                raise ValueError(f"header {name} must be a string, got {type(value).__name__}")
            if len(value) > MAX_HEADER:
                raise ValueError(f"header {name} is {len(value)} characters, over the {MAX_HEADER} read")
            return value.strip()
    return None


def _number(name: str, text: str, maximum: int = LONG_MAX) -> int:
    if not _NUMBER.fullmatch(text) or int(text) > maximum:
        raise ValueError(f"{name} must be a whole number from 0 to {maximum}, got {text[:40]!r}")
    return int(text)


def _baggage(text: str) -> dict[str, str]:
    """rlpulse's members of a W3C baggage header (others, and member properties, are ignored)."""
    found: dict[str, str] = {}
    for member in text.split(",", MAX_MEMBERS)[:MAX_MEMBERS]:
        key, sep, value = member.split(";", 1)[0].partition("=")
        key = key.strip()
        if sep and key.startswith("rlpulse.") and key in ("rlpulse.run_id", "rlpulse.attempt", "rlpulse.rollout_id",
                                                           "rlpulse.step", "rlpulse.sequence_id"):
            found[key] = unquote(value.strip(), errors="strict")
    return found


def extract(carrier: Mapping[str, Any]) -> Context | None:
    """The context in ``carrier`` (request headers), None when it names no rollout; ValueError naming
    the header that is malformed."""
    if not isinstance(carrier, Mapping):  # (the annotation is a promise callers with hostile input may break)
        raise ValueError(f"the carrier of a trace context must be a mapping of header names to values, "
                         f"got {type(carrier).__name__}")
    parent = trace = None
    traceparent = _header(carrier, "traceparent")
    if traceparent:
        match = _TRACEPARENT.fullmatch(traceparent)
        if match is None or match.group(1) == "ff" or set(match.group(2)) == {"0"} or set(match.group(3)) == {"0"}:
            raise ValueError(f"header traceparent is not a W3C trace context: {traceparent[:80]!r}")
        parent, trace = bytes.fromhex(match.group(3)), bytes.fromhex(match.group(2))
    try:
        baggage = _baggage(_header(carrier, "baggage") or "")
    except UnicodeDecodeError as exc:
        raise ValueError(f"header baggage has a value that is not UTF-8 once percent-decoded: {exc}") from None
    x_rollout = _header(carrier, "x-rollout-id")
    try:
        rollout = baggage.get("rlpulse.rollout_id") or (unquote(x_rollout, errors="strict") if x_rollout else None)
    except UnicodeDecodeError as exc:
        raise ValueError(f"header x-rollout-id is not UTF-8 once percent-decoded: {exc}") from None
    if not rollout:
        return None
    v.require_name("rollout id (baggage rlpulse.rollout_id or header x-rollout-id)", rollout)
    sequences = [_number(name, text) for name, text in (("baggage rlpulse.sequence_id", baggage.get("rlpulse.sequence_id")),
                                                        ("header x-sequence-id", _header(carrier, "x-sequence-id")))
                 if text]
    step = baggage.get("rlpulse.step")
    attempt = baggage.get("rlpulse.attempt")
    x_attempt = _header(carrier, "x-attempt-id")
    if attempt is None and x_attempt and _NUMBER.fullmatch(x_attempt):  # seed 003's own attempt ids are not ours
        attempt = x_attempt
    run = baggage.get("rlpulse.run_id")
    return Context(rollout_id=rollout, span_id=parent, trace_id=trace,
                   sequence_id=max(sequences, default=0),
                   step=_number("baggage rlpulse.step", step) if step else None,
                   run_id=v.require_name("baggage rlpulse.run_id", run) if run else None,
                   attempt=_number("attempt (baggage rlpulse.attempt or header x-attempt-id)", attempt, v.INT_MAX)
                   if attempt else None)


def inject(carrier: dict[str, str] | None = None) -> dict[str, str]:
    """``carrier`` (a new dict when None) with the current span's context added, for a request this
    process makes by hand (traced LLM clients add it by themselves); unchanged outside any span."""
    carrier = {} if carrier is None else carrier
    current = tracing.CURRENT.get()
    if current is not None:
        carrier.update(tracing.outgoing_headers(current))
    return carrier


@contextlib.contextmanager
def continue_trace(carrier: Mapping[str, Any]) -> Iterator[Context | None]:
    """Spans opened in this block continue the rollout named in ``carrier`` (see the module's doc).

    Yields the context (None when the headers name no rollout: the block runs as it would without).
    ValueError for a malformed header, or a context of another run or attempt than the installed
    tracer's telemetry writes for."""
    context = extract(carrier)
    if context is None:
        yield None
        return
    tracer = tracing.current_tracer()
    if tracer is not None:
        run, attempt = tracer.telemetry.run_id, tracer.telemetry.attempt
        if (context.run_id is not None and context.run_id != run) or (context.attempt is not None and context.attempt != attempt):
            raise ValueError(f"the propagated context is of run {context.run_id!r} attempt {context.attempt}, but this "
                             f"process's telemetry writes for run {run!r} attempt {attempt}: open a TrainingTelemetry "
                             "of that run and attempt to continue it")
    binding: dict[str, Any] = {"rollout_id": context.rollout_id, "remote_rollout_id": context.rollout_id,
                               "remote_sequence_id": context.sequence_id}
    if context.step is not None:
        binding["step"] = context.step
    ours = tracer is not None and context.trace_id == trace_id(f"{tracer.telemetry.run_id}/{tracer.telemetry.attempt}/"
                                                               f"{context.rollout_id}")
    if context.span_id is not None and ours:
        # a traceparent of this rollout's trace: rlpulse's own (a client or mesh that rewrote it names a
        # span rlpulse never stores; the rollout's entry is the parent then)
        binding["remote_span_id"] = context.span_id
    # an enclosing context's remote parent and step belong to its rollout, not this one
    outer = {k: x for k, x in (tracing.BINDING.get() or {}).items() if not k.startswith("remote_") and k != "step"}
    token = tracing.BINDING.set({**outer, **binding})
    try:
        yield context
    finally:
        tracing.BINDING.reset(token)
