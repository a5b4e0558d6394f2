"""Traced LLM and tool calls without hand-written spans: decorators, a wrapped client and the Tracer."""

from rlpulse.producers.tracing.decorators import (DEFAULT_CONTENT_LIMIT, MAX_METRIC_NAMES, Tracer, bind_rollout,
                                                  content_from_env, observe_llm, observe_processor, observe_tool,
                                                  reward_metrics, rollout_metrics, set_reward, trace_client)

__all__ = ["DEFAULT_CONTENT_LIMIT", "MAX_METRIC_NAMES", "Tracer", "bind_rollout", "content_from_env", "observe_llm",
           "observe_processor", "observe_tool", "reward_metrics", "rollout_metrics", "set_reward", "trace_client"]
