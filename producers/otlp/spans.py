"""OTLP spans as rlpulse ``Span`` records: one record per span, every field of ``span.avsc`` filled.

**Identity** (``identity.identity`` / ``step_of``): the span's own attributes, then its scope's, then its
resource's. Any span without a run id, an id of the wrong length (trace 16 bytes, span 8, parent
empty or 8), a time of 0 or an end before its start, or an attribute nesting too deep refuses the
WHOLE request (:class:`OtlpRejected` naming the span), so nothing of it is half-published. A span
with no rollout id, attempt id or step of its own takes its nearest ancestor's in the request, else its
trace's when the request's spans of that trace name a single one (children are exported before their entry).

**Kind**, the first rule that matches (the span's own attributes only):

1. ``rlpulse.kind`` naming a Span kind (what ``rlpulse.producers.sdk.otel`` reads): that kind.
2. LLM: OpenInference ``openinference.span.kind`` = LLM; GenAI ``gen_ai.operation.name`` in chat,
   text_completion, generate_content; OpenLLMetry ``llm.request.type`` chat or completion; or no
   operation / OpenInference kind but ``gen_ai.system`` or ``gen_ai.provider.name`` with
   ``gen_ai.request.model`` (GenAI before operation names). Embeddings (OpenInference EMBEDDING,
   GenAI ``embeddings``) are CUSTOM: ``rlpulse export`` takes every LLM span as a policy turn.
3. TOOL: OpenInference TOOL, GenAI ``execute_tool``, OpenLLMetry ``traceloop.span.kind`` = tool.
4. GRADER: OpenInference EVALUATOR, or a span carrying ``akka.optimize.training.rl.grader.outcome``.
5. ROLLOUT: a span with no parent (empty ``parent_span_id``: the trace's root, not merely a parent
   missing from this request) that is an agent entry (OpenInference AGENT or CHAIN, GenAI
   ``invoke_agent``, OpenLLMetry agent or workflow) or that names a rollout id (its own, its scope's
   or its resource's). An agent span under a parent (a propagated context) is CUSTOM: its rollout's
   entry is its caller's; in a run-wide trace a rollout's entry says ``rlpulse.kind`` = ROLLOUT.
6. CUSTOM otherwise.

**Attributes.** The span's attributes are kept (lists and maps as JSON, bytes as hex, an int beyond
an Avro long or a NaN as text), plus the keys rlpulse's own tracer writes, so ``rlpulse export`` and
the UI read an OTLP-born LLM span as an SDK-born one (``TARGETS`` below: the first source present
fills each key). Message content becomes ``gen_ai.input.messages`` / ``gen_ai.output.messages``:
JSON arrays of OpenAI chat messages (``role``, ``content``, ``tool_calls``, ``tool_call_id``), read
from GenAI's JSON (``parts`` turned into ``content``), OpenInference's ``llm.input_messages.N.message.*``
and ``llm.output_messages.N.*``, OpenLLMetry's ``gen_ai.prompt.N.*`` / ``gen_ai.completion.N.*``, and
last ``input.value`` / ``output.value``. The indexed message keys and, on LLM and TOOL spans,
``input.value`` / ``output.value`` are folded into those (not kept twice). Bounds as the SDK's: each
content attribute at most 32 KiB characters of JSON (the tracer's default cap: the longest strings cut
first, each ending in a marker saying how much it lost, counted in ``rlpulse.content.cut_chars``),
every other string cut so the span's strings stay within 256 KiB (``rlpulse.otlp.cut_chars``),
at most 128 keys of at most 256 characters (the rest counted in ``rlpulse.otlp.attributes_dropped``,
with OTLP's own ``dropped_attributes_count``).

**Typed fields.** LLM: ``completion_tokens`` (output tokens), ``finish_reason`` (the first),
``max_tokens``. GRADER: ``term`` (``…rl.term`` / ``rlpulse.term``), ``outcome`` (``…rl.grader.outcome`` /
``rlpulse.outcome``, else ``…rl.grader.failure.cause``, else error when the status is ERROR, else ok),
``score`` (``…rl.grader.score`` / ``rlpulse.score``; null unless ok), judge tokens from the usage.
ROLLOUT: ``reward`` (``…rl.reward`` / ``rlpulse.reward``), ``sample_id``, ``policy_version``, and
``finish_reason`` / ``completion_tokens`` / ``clipped`` when the span itself carries usage.

**Order.** ``sequence_id`` = (µs since 2020 of the span's start) << 12 | a tag hashed from its span id:
the layout of ``rlpulse.producers.sdk.sequence``, so a replay of a request gives the same ids (the spans
table's key holds them) and ``ORDER BY sequence_id`` is start order. ``time_ns`` is the end, as the SDK's.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from rlpulse.producers.otlp.genai import CONTENT_KEYS, canonical, json_value
from rlpulse.producers.otlp.identity import (ROLLOUT_ATTEMPT_KEYS, ROLLOUT_KEYS, SEED, Out, OtlpRejected, attributes,
                                             first, identity, integer, step_of, text)
from rlpulse.producers.sdk import events as v
from rlpulse.producers.tracing.content import MARKER, cut_strings
from rlpulse.producers.sdk.sequence import EPOCH_NS, MAX_TICK, TAG_BITS, TAG_MASK
from rlpulse.schemas.catalogue import OTLP_WRITER_PREFIX, SPANS_TOPIC, run_key
from rlpulse.schemas.enums import FINISH_TRUNCATED, GRADER_OUTCOMES, SPAN_KIND_DEFAULT, SPAN_KINDS, enum_symbols

# Span kinds by position (symbols are only ever appended to the enum), never as string literals.
ROLLOUT, _REWARD, LLM, TOOL, GRADER = SPAN_KINDS[:5]
CUSTOM = SPAN_KIND_DEFAULT
# The Span status enum is UNSET, OK, ERROR: OTLP's StatusCode numbers 0, 1, 2 in the same order.
STATUSES = enum_symbols("Span", "status")
ERROR_STATUS = STATUSES[2]
OK_OUTCOME, ERROR_OUTCOME = GRADER_OUTCOMES[0], GRADER_OUTCOMES[-1]  # ok, error

GENERATION_OPS = ("chat", "text_completion", "generate_content", "completion")
ENTRY_KINDS = ("agent", "chain")  # OpenInference kinds (lower case) of an agent's entry span
CONTENT_LIMIT = 32 * 1024  # characters of one content attribute: rlpulse's tracer's default cap
SPAN_BUDGET = 256 * 1024  # characters of all other strings of one span (a Kafka message holds 1 MiB)
CUT_CHARS = "rlpulse.content.cut_chars"
OTHER_CUT = "rlpulse.otlp.cut_chars"
DROPPED = "rlpulse.otlp.attributes_dropped"
LONG_MAX = 2**63 - 1

FOLDED = re.compile(r"^(llm\.(input|output)_messages|gen_ai\.(prompt|completion)|llm\.tools)\.\d+\.")


def translate_spans(request: ExportTraceServiceRequest, now_ns: int) -> list[Out]:
    """One ``Span`` record per span of ``request``, in start order; OtlpRejected for the whole request."""
    spans: list[dict[str, Any]] = []
    for rs in request.resource_spans:
        resource = _read(rs.resource.attributes, "a resource")
        writer = first(("service.instance.id", "service.name"), resource)
        writer_id = (OTLP_WRITER_PREFIX + writer)[:v.MAX_NAME] if isinstance(writer, str) else OTLP_WRITER_PREFIX
        for ss in rs.scope_spans:
            scope = _read(ss.scope.attributes, f"scope {ss.scope.name!r}")
            for span in ss.spans:
                spans.append(_read_span(span, resource, scope, writer_id))
    by_id = {(s["trace_id"], s["span_id"]): s for s in spans}
    spans.sort(key=lambda s: (s["start_time_ns"], s["span_id"]))
    for name in ("rollout_id", "attempt_id", "step"):
        _inherit(spans, by_id, name)
    # Publish order for the streams' replay marks (writer_sequence) is the ingest's to give: the
    # Kafka position of the request (rlpulse.producers.otlp.ingest.number), which a replay repeats.
    # Until then a plain rising count: 0 would make the streams fall back to sequence_id (start
    # order), and an entry span, started first and exported last, would look like a replay.
    out = []
    for i, s in enumerate(spans):
        s["writer_sequence"] = i + 1
        out.append(Out(SPANS_TOPIC, run_key(s["project"], s["run_id"]), "Span", s))
    return out


def _read(kvs: Iterable[Any], what: str) -> dict[str, Any]:
    try:
        return attributes(kvs)
    except OtlpRejected as exc:
        raise OtlpRejected(f"{what}: {exc}") from None


def _read_span(span: Any, resource: dict[str, Any], scope: dict[str, Any], writer_id: str) -> dict[str, Any]:
    where = f"span {span.name[:80]!r} ({span.span_id.hex() or 'no span id'})"
    attrs = _read(span.attributes, where)
    try:
        who = identity(attrs, scope, resource)
        step = step_of(attrs, scope, resource)
    except OtlpRejected as exc:
        raise OtlpRejected(f"{where}: {exc}") from None
    _check_ids(span, where)
    start, end = span.start_time_unix_nano, span.end_time_unix_nano
    if start <= 0 or end <= 0:
        raise OtlpRejected(f"{where}: start and end times must be set (ns since the epoch), got {start} and {end}")
    if end < start or end > LONG_MAX:
        raise OtlpRejected(f"{where}: end time {end} is before its start {start} or beyond an Avro long")
    if not 0 <= span.status.code < len(STATUSES):  # a negative code would index from the end
        raise OtlpRejected(f"{where}: unknown status code {span.status.code}")
    parent = span.parent_span_id if span.parent_span_id.strip(b"\0") else None  # all zeros: a root, as empty
    rollout = first(ROLLOUT_KEYS, attrs, scope, resource)
    attempt_id = first(ROLLOUT_ATTEMPT_KEYS, attrs, scope, resource)
    status = STATUSES[span.status.code]
    kind = kind_of(attrs, root=parent is None, names_rollout=rollout is not None)
    named = canonical(attrs, llm=kind == LLM, tool=kind == TOOL)
    tokens_out = named.get("gen_ai.usage.output_tokens")
    reason = named.get("gen_ai.response.finish_reasons")
    reason = reason.split(",")[0] if isinstance(reason, str) and reason else None
    record: dict[str, Any] = {
        **who.fields(), "time_ns": end, "trace_id": bytes(span.trace_id), "span_id": bytes(span.span_id),
        "parent_span_id": bytes(parent) if parent is not None else None, "name": span.name[:v.MAX_NAME], "kind": kind,
        "start_time_ns": start, "end_time_ns": end, "status": status, "status_message": span.status.message[:v.MAX_VALUE],
        "rollout_id": _name(rollout, f"{where}: the rollout id"),
        "attempt_id": _name(attempt_id, f"{where}: the rollout attempt id"),
        "sequence_id": start_order(start, bytes(span.span_id)), "writer_id": writer_id, "writer_sequence": 0,
        "step": step, "attributes": {}, "term": None, "outcome": None, "score": None, "judge_input_tokens": None,
        "judge_output_tokens": None, "reward": None, "term_shares": {}, "completion_tokens": None, "max_tokens": None,
        "clipped": None, "sample_id": None, "policy_version": None, "finish_reason": None, "checkpoint_op": None,
        "checkpoint_bytes": None, "metrics": {},
    }
    if kind in (LLM, ROLLOUT):
        record.update(completion_tokens=tokens_out, finish_reason=reason,
                      max_tokens=named.get("gen_ai.request.max_tokens"))
    if kind == GRADER:
        outcome = first((SEED + "rl.grader.outcome", "rlpulse.outcome", SEED + "rl.grader.failure.cause"), attrs)
        outcome = str(outcome)[:64] if outcome is not None else ERROR_OUTCOME if status == ERROR_STATUS else OK_OUTCOME
        term = first((SEED + "rl.term", "rlpulse.term"), attrs)
        record.update(term=None if term is None else _name(term, f"{where}: the term"), outcome=outcome,
                      score=_number(first((SEED + "rl.grader.score", "rlpulse.score"), attrs), f"{where}: the score")
                      if outcome == OK_OUTCOME else None,
                      judge_input_tokens=named.get("gen_ai.usage.input_tokens"), judge_output_tokens=tokens_out)
    if kind == ROLLOUT:
        sample = first((SEED + "rl.sample.id", "rlpulse.sample_id"), attrs)
        version = first((SEED + "rl.policy.version", "rlpulse.policy_version"), attrs)
        record.update(reward=_number(first((SEED + "rl.reward", "rlpulse.reward"), attrs), f"{where}: the reward"),
                      sample_id=None if sample is None else _name(sample, f"{where}: the sample id"),
                      policy_version=None if version is None else integer(version, f"{where}: the policy version"),
                      clipped=None if reason is None else reason == FINISH_TRUNCATED)
    record["attributes"] = _bounded(attrs, named, kind, span)
    return record


def _check_ids(span: Any, where: str) -> None:
    for field, value, size in (("trace_id", span.trace_id, 16), ("span_id", span.span_id, 8)):
        if len(value) != size or not value.strip(b"\0"):
            raise OtlpRejected(f"{where}: {field} must be {size} bytes, not all zero; got {len(value)} bytes")
    if len(span.parent_span_id) not in (0, 8):
        raise OtlpRejected(f"{where}: parent_span_id must be empty or 8 bytes, got {len(span.parent_span_id)}")


def _name(value: Any, what: str) -> str:
    if value is None:
        return ""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # an id some SDKs send as a number
    return text(value, what, v.MAX_NAME)


def _number(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise OtlpRejected(f"{what} must be a number, got {value[:40]!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise OtlpRejected(f"{what} must be a finite number, got {value!r}")
    return float(value)


def start_order(start_ns: int, span_id: bytes) -> int:
    """The span's ``sequence_id``: its start (µs since 2020) << 12 | 12 bits hashed from its span id."""
    tick = min(max((start_ns - EPOCH_NS) // 1000, 1), MAX_TICK)
    return tick << TAG_BITS | int.from_bytes(hashlib.blake2b(span_id, digest_size=2).digest(), "big") & TAG_MASK


def _inherit(spans: list[dict[str, Any]], by_id: dict[tuple[bytes, bytes], dict[str, Any]], name: str) -> None:
    """Give a span without ``name`` its nearest ancestor's in the request, else its trace's when the trace
    names one value only (a run-wide trace holding many rollouts names none for a span outside them)."""
    traces: dict[bytes, set[Any]] = {}
    for s in spans:
        if s[name] not in ("", None):
            traces.setdefault(s["trace_id"], set()).add(s[name])
    for s in spans:
        node: dict[str, Any] | None = s
        hops = 0
        while node is not None and s[name] in ("", None) and node["parent_span_id"] is not None and hops < 256:
            node = by_id.get((s["trace_id"], node["parent_span_id"]))
            if node is not None:
                s[name], hops = node[name], hops + 1
        named = traces.get(s["trace_id"], ())
        if s[name] in ("", None) and len(named) == 1:
            s[name] = next(iter(named))


def kind_of(attrs: Mapping[str, Any], root: bool, names_rollout: bool) -> str:
    """The rlpulse kind of a span with ``attrs`` (the rules in the module's docstring)."""
    own = attrs.get("rlpulse.kind")
    if isinstance(own, str) and own.upper() in SPAN_KINDS:
        return own.upper()
    oi = str(attrs.get("openinference.span.kind") or "").lower()
    op = str(attrs.get("gen_ai.operation.name") or "").lower()
    loop = str(attrs.get("traceloop.span.kind") or "").lower()
    if (oi == "llm" or op in GENERATION_OPS or str(attrs.get("llm.request.type") or "").lower() in ("chat", "completion")
            or (not oi and not op and (attrs.get("gen_ai.system") or attrs.get("gen_ai.provider.name"))
                and attrs.get("gen_ai.request.model"))):
        return LLM
    if oi == "tool" or op == "execute_tool" or loop == "tool":
        return TOOL
    if oi == "evaluator" or attrs.get(SEED + "rl.grader.outcome") is not None:
        return GRADER
    if root and (oi in ENTRY_KINDS or op == "invoke_agent" or loop in ("agent", "workflow") or names_rollout):
        return ROLLOUT
    return CUSTOM


# -- attributes ---------------------------------------------------------------------------------

def _scalar(value: Any) -> str | bool | int | float:
    if isinstance(value, bool) or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value if -LONG_MAX - 1 <= value <= LONG_MAX else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, bytes):
        return value.hex()
    return json.dumps(value, ensure_ascii=False, default=lambda b: b.hex() if isinstance(b, bytes) else str(b))


def _fit(value: Any, measure: Any, limit: int) -> tuple[Any, int] | None:
    """``value`` with its strings cut to the longest length at which ``measure`` of it is within ``limit``,
    and the characters cut; None when even empty strings do not fit."""
    if measure(value) <= limit:
        return value, 0
    lo, hi, best = 0, limit, None
    while lo <= hi:
        keep, counter = (lo + hi) // 2, [0]
        candidate = cut_strings(value, keep, counter)
        if measure(candidate) <= limit:
            best, lo = (candidate, counter[0]), keep + 1
        else:
            hi = keep - 1
    return best


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _bounded(attrs: Mapping[str, Any], named: dict[str, Any], kind: str, span: Any) -> dict[str, Any]:
    """The Span's attributes map: rlpulse's keys first, then the span's own, within the bounds."""
    content_cut = 0
    out: dict[str, Any] = {}
    for key in CONTENT_KEYS:  # JSON, as the tracer writes it, its longest strings cut first
        if key not in named:
            continue
        value = named.pop(key)
        value = json_value(value) if isinstance(value, str) and json_value(value) is not None else value
        fitted = _fit(value, lambda x: len(_dumps(x)), CONTENT_LIMIT)
        if fitted is None:  # too much structure for any string cut: the text itself is cut (no longer JSON)
            whole = _dumps(value)
            keep = CONTENT_LIMIT - 48
            out[key], cut = whole[:keep] + MARKER.format(len(whole) - keep), len(whole) - keep
        else:
            out[key], cut = _dumps(fitted[0]), fitted[1]
        content_cut += cut
    out.update({k: _scalar(x) for k, x in named.items()})
    for event in span.events:  # an exception recorded on the span: its type, as the tracer's error.type
        if event.name == "exception":
            exc = _read(event.attributes, "an exception event")
            if exc.get("exception.type") is not None:
                out.setdefault("error.type", _scalar(exc["exception.type"]))
            break
    folded = kind in (LLM, TOOL)
    dropped = span.dropped_attributes_count
    for key, value in attrs.items():
        if key in out or value is None or FOLDED.match(key) or key in ("llm.input_messages", "llm.output_messages") \
                or (folded and key in ("input.value", "output.value")):
            continue
        if len(out) >= v.MAX_ATTRIBUTES - 3 or not key or len(key) > v.MAX_KEY:
            dropped += 1
            continue
        out[key] = _scalar(value)
    strings = {k: x for k, x in out.items() if isinstance(x, str) and k not in CONTENT_KEYS}
    budget = SPAN_BUDGET - sum(len(out[k]) for k in CONTENT_KEYS if k in out)
    other_cut = [0]
    fitted = _fit(strings, lambda d: sum(len(x) for x in d.values()), budget) or (cut_strings(strings, 0, other_cut), 0)
    out.update(fitted[0])
    other_cut[0] += fitted[1]
    for key, count in ((CUT_CHARS, content_cut), (OTHER_CUT, other_cut[0]), (DROPPED, dropped)):
        if count:
            out[key] = count
    return out
