"""Publishers, one room per job: ``sdk`` (the training job's calls and their delivery), ``tracing`` (traced LLM
and tool calls), ``pollers`` (GPUs, engines, capacity), ``integrations`` (TRL, verl, OpenRLHF) and
``simulators`` (the demo's runs). A room imports only the rooms below it: sdk < tracing < pollers,
integrations < simulators.

``import rlpulse.producers`` needs only aiokafka, fastavro and opentelemetry-sdk.
"""

from rlpulse.producers.sdk.memory import InMemoryTransport
from rlpulse.producers.sdk.telemetry import AsyncTrainingTelemetry, TrainingTelemetry
from rlpulse.producers.tracing import Tracer, observe_llm, observe_processor, observe_tool, trace_client

__all__ = ["AsyncTrainingTelemetry", "InMemoryTransport", "Tracer", "TrainingTelemetry", "observe_llm", "observe_processor",
           "observe_tool", "trace_client"]
