"""An OpenTelemetry ``SpanExporter`` that publishes a job's own spans on ``<prefix>.spans``.

Use it with the standard API::

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(tel.span_exporter()))
    tracer = provider.get_tracer("my-agent")
    with tracer.start_as_current_span("rollout", attributes={"rlpulse.kind": "ROLLOUT",
                                                             "rlpulse.rollout_id": "r-17"}):
        with tracer.start_as_current_span("llm", attributes={"rlpulse.kind": "LLM"}):
            ...

Attributes ``rlpulse.kind`` (ROLLOUT, REWARD, LLM, TOOL, GRADER, ANNOTATION, CUSTOM; default
CUSTOM), ``rlpulse.rollout_id``, ``rlpulse.attempt_id``, ``rlpulse.step`` and ``rlpulse.reward``
fill the typed fields. A span without ``rlpulse.rollout_id`` takes the one of its trace (seed
000's entry span names it for its LLM and TOOL children). Spans go through the same queue as
the SDK's own (``TrainingTelemetry.publish_span``), which assigns ``sequence_id`` in the
recording process, strictly increasing per writer on the spans topic, in order of start time
within each exported batch, so a trajectory's order survives clock skew between machines.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

if TYPE_CHECKING:
    from producers.telemetry import TrainingTelemetry

log = logging.getLogger(__name__)

KINDS = ("ROLLOUT", "REWARD", "LLM", "TOOL", "GRADER", "ANNOTATION", "CUSTOM")
MAX_TRACES = 10_000  # traces whose rollout id is remembered for late children


def _attribute_value(value: Any) -> str | float | int | bool:
    if isinstance(value, (str, bool, int, float)):
        return value
    return str(list(value))  # OpenTelemetry allows sequences; the Avro map holds scalars


class RlpulseSpanExporter(SpanExporter):
    def __init__(self, telemetry: "TrainingTelemetry"):
        self._tel = telemetry
        self._rollouts: OrderedDict[int, str] = OrderedDict()  # trace id -> rollout id

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:  # learn the batch's rollout ids first: children end before their entry span
            rollout = (span.attributes or {}).get("rlpulse.rollout_id")
            if rollout:
                self._rollouts[span.context.trace_id] = str(rollout)
                self._rollouts.move_to_end(span.context.trace_id)
        while len(self._rollouts) > MAX_TRACES:
            self._rollouts.popitem(last=False)
        for span in sorted(spans, key=lambda s: (s.start_time or 0, s.context.span_id)):
            try:
                self._tel.publish_span(self._record(span))  # False (buffer full) is counted in tel.dropped
            except ValueError as exc:  # e.g. an attribute too large for any message: skip this span only
                log.warning("span %r not exported: %s", span.name, exc)
        return SpanExportResult.SUCCESS

    def _record(self, span: ReadableSpan) -> dict[str, Any]:
        attrs = dict(span.attributes or {})
        kind = str(attrs.get("rlpulse.kind", "CUSTOM")).upper()
        step = attrs.get("rlpulse.step")
        reward = attrs.get("rlpulse.reward")
        end = span.end_time or span.start_time or 0
        return {
            "time_ns": end,
            "trace_id": span.context.trace_id.to_bytes(16, "big"),
            "span_id": span.context.span_id.to_bytes(8, "big"),
            "parent_span_id": span.parent.span_id.to_bytes(8, "big") if span.parent else None,
            "name": span.name,
            "kind": kind if kind in KINDS else "CUSTOM",
            "start_time_ns": span.start_time or end,
            "end_time_ns": end,
            "status": span.status.status_code.name,
            "status_message": span.status.description or "",
            "rollout_id": str(attrs.get("rlpulse.rollout_id") or self._rollouts.get(span.context.trace_id, "")),
            "attempt_id": str(attrs.get("rlpulse.attempt_id", "")),
            "step": int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None,
            "reward": float(reward) if isinstance(reward, (int, float)) and not isinstance(reward, bool) else None,
            "attributes": {k: _attribute_value(v) for k, v in attrs.items()},
        }

    def shutdown(self) -> None:
        self._tel.flush()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._tel.flush(timeout_millis / 1000) == 0
