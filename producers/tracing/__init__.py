"""Traced LLM and tool calls without hand-written spans: decorators, a wrapped client and the Tracer."""

from rlpulse.producers.tracing.decorators import (DEFAULT_CONTENT_LIMIT, MAX_METRIC_NAMES, Tracer, bind_rollout,
                                                  content_from_env, emit_reward, observe_llm, observe_processor,
                                                  observe_tool, reward_metrics, rollout_metrics, set_reward, trace_client)
from rlpulse.producers.tracing.tools import trace_tool
from rlpulse.producers.tracing.context import Context, continue_trace, extract, inject

__all__ = ["Context", "continue_trace", "extract", "inject",
           "DEFAULT_CONTENT_LIMIT", "MAX_METRIC_NAMES", "Tracer", "bind_rollout", "content_from_env", "emit_reward",
           "observe_llm", "observe_processor", "observe_tool", "reward_metrics", "rollout_metrics", "set_reward",
           "trace_client", "trace_tool"]
