"""Publishers: the training-job SDK, its OpenTelemetry exporter, the GPU poller and the simulator.

``import producers`` needs only aiokafka, fastavro and opentelemetry-sdk.
"""

from producers.aio import AsyncTrainingTelemetry
from producers.telemetry import TrainingTelemetry

__all__ = ["AsyncTrainingTelemetry", "TrainingTelemetry"]
