"""Publishers: the training-job SDK (and, later, the GPU poller and the simulator).

``import producers`` needs only aiokafka, fastavro and opentelemetry-sdk.
"""

from producers.telemetry import TrainingTelemetry

__all__ = ["TrainingTelemetry"]
