"""rlpulse: telemetry pipeline for RL and distillation training jobs.

Installed, everything lives under this one name: ``rlpulse.schemas`` (the ground: Avro schemas,
codec, catalogue of names, settings and file helpers), ``rlpulse.producers`` (the SDK),
``rlpulse.streams``, ``rlpulse.sinks``, and the wiring here (CLI, local services). A training
repository with its own ``schemas`` or ``producers`` package cannot shadow them.

``from rlpulse import TrainingTelemetry`` is the SDK's entry point; it loads the SDK on first use
only, so ``import rlpulse`` stays free of Kafka, Faust and ClickHouse.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["AsyncTrainingTelemetry", "TrainingTelemetry"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rlpulse import producers

        return getattr(producers, name)
    raise AttributeError(f"module 'rlpulse' has no attribute {name!r}")
