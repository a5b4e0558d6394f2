"""``SenderFaces``: what a writer (``TrainingTelemetry``) shows of its sender, and the records it
publishes through the sender's queue beside the calls a training loop makes.

A base class of ``TrainingTelemetry``, kept apart so the module of the calls stays about them.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Mapping

from rlpulse.producers.sdk import events as v
from rlpulse.producers.sdk.queue import SPANS, Channel
from rlpulse.producers.sdk.sender import Outgoing, Sender
from rlpulse.producers.sdk.span_fields import span_fields
from rlpulse.base.settings import Settings


class SenderFaces:
    """The sender's counters and the publishing of other records; the writer sets the attributes."""

    settings: Settings
    _sender: Sender
    _put: Callable[..., bool]
    _span_channel: Channel
    _span_limit: int
    _span_encoded_bytes: int

    @property
    def dropped(self) -> int:
        """Events dropped because the buffer was full."""
        return self._sender.dropped

    @property
    def delivered(self) -> int:
        """Events the broker has acknowledged."""
        return self._sender.delivered

    @property
    def kafka_refused(self) -> str | None:
        """Why the broker refuses the Kafka credentials or certificate, while it does (logged once); else None."""
        return self._sender.refused

    @property
    def pending(self) -> int:
        """Events accepted and not yet acknowledged."""
        return self._sender.pending

    @property
    def sender(self) -> Sender:
        """The sender this writer queues on (its counters, ``queued_records`` for inspection)."""
        return self._sender

    # -- publishing other records through this writer's queue --------------------------------
    def publish_span(self, span: Mapping[str, Any]) -> bool:
        """Queue one span given as Span record fields (what ``rlpulse.producers.sdk.otel`` converts a span to).

        ``time_ns``, ``trace_id``, ``span_id``, ``name``, ``kind``, ``start_time_ns`` and
        ``end_time_ns`` are required; the identity, ``writer_id`` and ``writer_sequence`` are this
        writer's and override any given. ``sequence_id`` (the start order, see
        ``rlpulse.producers.sdk.sequence``) is kept when given, as a tracer takes it when the span
        starts; else it is the id of ``start_time_ns``. Returns False when the buffer was full (counted in
        ``dropped``); raises ValueError naming the field for a value the Span schema refuses (NaN,
        infinity, an int beyond Avro long, a lone surrogate, a wrong type or kind) or a span that
        can never fit a message.
        """
        fields = span_fields(span, self._sender.check, self._span_limit, self._span_encoded_bytes)
        return self._put(SPANS, self._span_channel, fields, v.queued_bytes(fields))

    def publish_hardware(self, record_type: str, key: str, record: Mapping[str, Any]) -> bool:
        """Queue a ``GpuSample`` or ``Placement`` record on ``<prefix>.hardware`` under ``key`` (the hw_id).

        Checked against its schema at the call (ValueError naming the field); False when the
        buffer was full. The GPU poller publishes the same way through ``Sender.offer``.
        """
        return self._sender.offer(Outgoing(self.settings.topic("hardware"), key, record_type, record))
