"""A span given as Span record fields (``TrainingTelemetry.publish_span``, which ``rlpulse.producers.sdk.otel``
calls for each span it exports): checked at the call, so a value the Span schema or the input
limits refuse raises ValueError naming the field instead of failing on the sender's thread.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Mapping

from rlpulse.producers.sdk import events as v
from rlpulse.schemas.enums import SPAN_KINDS

# Encoded bytes of a span's fixed fields (ids, times, numbers, enum and union indexes), for
# the too-large check; the variable ones (strings, maps) are added from their lengths.
SPAN_ENCODED_BYTES = 160
OWN_FIELDS = frozenset(("project", "run_id", "attempt", "stage", "writer_id", "writer_sequence"))  # set by the writer


def span_fields(span: Mapping[str, Any], check: Callable[..., None], limit: int, base: int) -> dict[str, Any]:
    """The fields of ``span`` to queue, less the writer's own; ValueError naming a field it refuses.

    ``check``: the sender's schema check; ``limit``: the most bytes a Span record may take;
    ``base``: the encoded bytes of its fixed fields and the writer's identity.
    """
    fields = {k: x for k, x in span.items() if k not in OWN_FIELDS}
    kind = fields.get("kind")
    if kind not in SPAN_KINDS:
        raise ValueError(f"kind must be one of {', '.join(SPAN_KINDS)}; got {kind!r}")
    for name in ("time_ns", "trace_id", "span_id", "name", "start_time_ns", "end_time_ns"):
        if fields.get(name) is None:
            raise ValueError(f"span field {name} is required")
    if fields.get("sequence_id") is not None:  # a traced span's start-order id (rlpulse.producers.sdk.sequence)
        v.require_long("sequence_id", fields["sequence_id"], minimum=1)
    check("Span", fields, complete=False)
    v.check_span_limits(fields)
    v.require_count("step", fields.get("step"))
    variable = {k: fields.get(k) for k in ("name", "status_message", "rollout_id", "attempt_id", "attributes",
                                           "term", "outcome", "sample_id", "term_shares")}
    v.refuse_oversized("Span", limit, base, variable)
    return fields
