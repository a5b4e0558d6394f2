"""rlpulse: telemetry pipeline for RL and distillation training jobs.

Installed, everything lives under this one name: ``rlpulse.base`` (the ground: settings, files,
errors), ``rlpulse.schemas`` (the wire: Avro schemas, codec, catalogue of names),
``rlpulse.producers`` (the SDK), ``rlpulse.streams``, ``rlpulse.sinks``, and the wiring here (CLI,
local services). A training repository with its own ``schemas`` or ``producers`` package cannot
shadow them.

``rlpulse.Error`` is the base class of every error rlpulse raises on purpose: ``except
rlpulse.Error`` catches them all. ``from rlpulse import TrainingTelemetry`` is the SDK's entry
point; it loads the SDK on first use only, so ``import rlpulse`` stays free of Kafka, Faust and
ClickHouse.
"""

from __future__ import annotations

from typing import Any

from rlpulse.base.errors import Error

__version__ = "0.1.0"
__all__ = ["AsyncTrainingTelemetry", "Error", "TrainingTelemetry"]
_SDK = ("AsyncTrainingTelemetry", "TrainingTelemetry")


def __getattr__(name: str) -> Any:
    if name in _SDK:
        from rlpulse import producers

        return getattr(producers, name)
    raise AttributeError(f"module 'rlpulse' has no attribute {name!r}")
