"""Publishers: the training-job SDK, its OpenTelemetry exporter, the GPU poller and the simulator.

``import rlpulse.producers`` needs only aiokafka, fastavro and opentelemetry-sdk.
"""

from rlpulse.producers.aio import AsyncTrainingTelemetry
from rlpulse.producers.telemetry import TrainingTelemetry

__all__ = ["AsyncTrainingTelemetry", "TrainingTelemetry"]
