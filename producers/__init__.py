"""Publishers: the training-job SDK, its OpenTelemetry exporter, the GPU poller and the simulator.

``import rlpulse.producers`` needs only aiokafka, fastavro and opentelemetry-sdk.
"""

from rlpulse.producers.memory import InMemoryTransport
from rlpulse.producers.telemetry import AsyncTrainingTelemetry, TrainingTelemetry
from rlpulse.producers.tracing import Tracer, observe_llm, observe_processor, observe_tool, trace_client

__all__ = ["AsyncTrainingTelemetry", "InMemoryTransport", "Tracer", "TrainingTelemetry", "observe_llm", "observe_processor",
           "observe_tool", "trace_client"]
