"""``policy.py``'s rollouts traced by agent-lightning's own tracer, and its own adapters run over them:
``python tests/agentlightning/al_agent.py OPENAI_BASE_URL`` in ``.venv-agentlightning``
(``tests/agentlightning/al_venv.py``); ``tests/integration/sinks/views/test_agentlightning_parity.py`` runs it.

Tracing as an agent-lightning user does, offline:

* ``AgentOpsTracer`` (the tracer agent-lightning's runners use by default): AgentOps instruments the
  ``openai`` client (spans ``openai.chat.completion``, ``gen_ai.prompt.*`` / ``gen_ai.completion.*``),
  and agent-lightning's patch adds vLLM's ``prompt_token_ids``, ``response_token_ids`` and
  ``logprobs.content``. Its exporters stay local (agent-lightning's default: the AgentOps service is
  off); ``AGENTOPS_API_KEY`` is a dummy and LiteLLM reads its bundled cost map, so nothing leaves the host;
* one ``trace_context`` per rollout; ``emit_reward(intermediate)`` after the 2nd call;
* the reward step inside ``operation(name=AGL_REWARD)`` (an ``agentlightning.operation`` span named
  ``agentlightning.reward``, which ``TraceTree.is_reward_span`` recognises, so the judge's call under
  it is left out by ``exclude_llm_call_in_reward``), ending with ``emit_reward(final)``.

Then, per rollout, ``TracerTraceToTriplet()`` and ``TraceToMessages()`` with their defaults over the
rollout's spans, and ``TracerTraceToTriplet(exclude_llm_call_in_reward=False)``. Prints one JSON object:
``{"rollouts": {rid: {"triplets": [...], "triplets_with_judge": [...], "messages": [...], "spans": [...]}},
"versions": {...}}`` (the spans as agent-lightning recorded them, for a failing test's message).
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before agentlightning imports LiteLLM: no cost-map fetch
os.environ.setdefault("AGENTOPS_API_KEY", "dummy")  # AgentOpsTracer's own default; the service stays off
os.environ.setdefault("AGENTOPS_LOG_LEVEL", "ERROR")

import asyncio  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from importlib.metadata import version  # noqa: E402
from typing import Any  # noqa: E402

import openai  # noqa: E402

from agentlightning import AgentOpsTracer, TraceToMessages, TracerTraceToTriplet, emit_reward, operation  # noqa: E402
from agentlightning.semconv import AGL_REWARD  # noqa: E402

import policy  # noqa: E402 - this folder is first on the path: the script runs as a file

logging.disable(logging.WARNING)  # agent-lightning and AgentOps log warnings about the local set-up on stderr


def jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=lambda v: v.model_dump() if hasattr(v, "model_dump") else repr(v)))


def reward_step(grade: Any) -> float:
    """The reward step: the judge's call inside an ``agentlightning.reward`` operation, then the final reward."""
    with operation(name=AGL_REWARD):
        final = grade()
        emit_reward(final)
    return final


async def traced(tracer: AgentOpsTracer, client: openai.OpenAI, rollout_id: str, question: str) -> None:
    async with tracer.trace_context(name=rollout_id):
        policy.rollout(client, rollout_id, question, tool=lambda f: f, intermediate=emit_reward, reward_step=reward_step)


def main(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="sk-agentlightning-parity", max_retries=0)
    tracer = AgentOpsTracer()
    out: dict[str, Any] = {"rollouts": {}, "versions": {
        name: version(name) for name in ("agentlightning", "agentops", "openai", "opentelemetry-sdk")}}
    with tracer.lifespan():
        for rollout_id, _sample, question in policy.TASKS:
            asyncio.run(traced(tracer, client, rollout_id, question))
            spans = tracer.get_last_trace()
            out["rollouts"][rollout_id] = {
                "triplets": [t.model_dump() for t in TracerTraceToTriplet().adapt(spans)],
                # the judge's call kept, as `rlpulse export --include-grader-calls` keeps it
                "triplets_with_judge": [t.model_dump() for t in
                                        TracerTraceToTriplet(exclude_llm_call_in_reward=False).adapt(spans)],
                "messages": jsonable(TraceToMessages().adapt(spans)),
                "spans": [{"name": s.name, "span_id": s.span_id, "parent_id": s.parent_id, "start_time": s.start_time,
                           "end_time": s.end_time, "attributes": jsonable(dict(s.attributes))} for s in spans]}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
