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
the SDK's own (``TrainingTelemetry.publish_span``), which numbers them in publish order
(``writer_sequence``) and gives each the ``sequence_id`` of its start time
(``rlpulse.producers.sdk.sequence``), so a trajectory sorts in start order.

A span the Span schema cannot carry (an attribute or ``rlpulse.reward`` that is NaN or infinite,
an int beyond Avro long, a lone surrogate in a string) is dropped and counted in the exporter's
``refused``, with a log line at most every 10 s: it never raises into the exporter's thread and
never reaches the streams, where one bad record would stop the run's figures. Spans exported
after the telemetry was closed (a ``BatchSpanProcessor`` flushing at shutdown) are still
delivered: the writer's sender starts again for them.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Protocol
from collections.abc import Mapping, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from rlpulse.schemas.enums import SPAN_KIND_DEFAULT, SPAN_KINDS

log = logging.getLogger(__name__)

MAX_TRACES = 10_000  # traces whose rollout id is remembered for late children
REFUSED_LOG_INTERVAL_S = 10.0  # a stream of bad spans must not flood the job's log


def _attribute_value(value: Any) -> str | float | int | bool:
    if isinstance(value, (str, bool, int, float)):
        return value
    return str(list(value))  # OpenTelemetry allows sequences; the Avro map holds scalars


def _number(value: Any) -> Any:
    """An int or float attribute as it is (the Span checks refuse NaN, infinities, huge ints); anything else None."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class SpanWriter(Protocol):
    """What the exporter publishes through: a ``TrainingTelemetry`` (this module does not import it;
    ``TrainingTelemetry.span_exporter`` imports this one)."""

    def publish_span(self, span: Mapping[str, Any]) -> bool: ...

    def flush(self, timeout: float = 30.0) -> int: ...


class RlpulseSpanExporter(SpanExporter):
    def __init__(self, telemetry: SpanWriter):
        self._tel = telemetry
        self._rollouts: OrderedDict[int, str] = OrderedDict()  # trace id -> rollout id
        self.refused = 0  # spans dropped because a value could not be published (a full buffer counts in telemetry.dropped)
        self._last_log = -REFUSED_LOG_INTERVAL_S

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
            except Exception as exc:  # a bad value, or one too large for any message: drop this span only
                self._refuse(span, exc)
        return SpanExportResult.SUCCESS

    def _refuse(self, span: ReadableSpan, exc: Exception) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._last_log >= REFUSED_LOG_INTERVAL_S:
            self._last_log = now
            log.warning("span %r not exported: %s (%d spans refused so far; see RlpulseSpanExporter.refused)",
                        span.name, exc, self.refused)

    def _record(self, span: ReadableSpan) -> dict[str, Any]:
        attrs = dict(span.attributes or {})
        kind = str(attrs.get("rlpulse.kind", SPAN_KIND_DEFAULT)).upper()
        step = _number(attrs.get("rlpulse.step"))
        if type(step) is float and step.is_integer():  # 4.0 is step 4; NaN, infinities and 4.5 are refused
            step = int(step)
        end = span.end_time or span.start_time or 0
        return {
            "time_ns": end,
            "trace_id": span.context.trace_id.to_bytes(16, "big"),
            "span_id": span.context.span_id.to_bytes(8, "big"),
            "parent_span_id": span.parent.span_id.to_bytes(8, "big") if span.parent else None,
            "name": span.name,
            "kind": kind if kind in SPAN_KINDS else SPAN_KIND_DEFAULT,
            "start_time_ns": span.start_time or end,
            "end_time_ns": end,
            "status": span.status.status_code.name,
            "status_message": span.status.description or "",
            "rollout_id": str(attrs.get("rlpulse.rollout_id") or self._rollouts.get(span.context.trace_id, "")),
            "attempt_id": str(attrs.get("rlpulse.attempt_id", "")),
            "step": step,
            "reward": _number(attrs.get("rlpulse.reward")),
            "attributes": {k: _attribute_value(v) for k, v in attrs.items()},
        }

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        # BatchSpanProcessor.shutdown passes what is left of its own timeout
        self._tel.flush(timeout_millis / 1000)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._tel.flush(timeout_millis / 1000) == 0
