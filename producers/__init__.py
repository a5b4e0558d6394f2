"""Publishers: the training-job SDK, its OpenTelemetry exporter, the GPU poller and the simulator.

``import rlpulse.producers`` needs only aiokafka, fastavro and opentelemetry-sdk.
"""

from rlpulse.producers.memory import InMemoryTransport
from rlpulse.producers.telemetry import AsyncTrainingTelemetry, TrainingTelemetry

__all__ = ["AsyncTrainingTelemetry", "InMemoryTransport", "TrainingTelemetry"]
