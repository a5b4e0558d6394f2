"""``policy.py``'s rollouts traced by rlpulse, published to the real broker:
``python tests/agentlightning/rlpulse_agent.py OPENAI_BASE_URL PROJECT RUN_ID`` in ``.venv-agentlightning``
(the SDK's wheel is installed there beside agent-lightning, so both sides use the same ``openai``),
with the RLPULSE_* settings in the environment; ``tests/integration/sinks/views/test_agentlightning_parity.py``
runs it with ``rlpulse streams`` and ``rlpulse sink`` taking the spans into ClickHouse.

As a user of rlpulse's tracing writes it: ``Tracer(tel, content=True, token_ids=True,
request_token_ids=True)`` and ``trace_client(openai.OpenAI(...))``; each rollout a ROLLOUT entry
(``@observe_processor``, step 0, its rollout and sample ids); the tool under ``observe_tool``; the
intermediate reward ``emit_reward(value)``; the reward step a REWARD entry whose return value (the
judge's verdict) is the final reward. Nothing of agent-lightning is imported here.
Prints one JSON line: the final rewards and what the tracer published.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import openai

from rlpulse.producers import TrainingTelemetry
from rlpulse.producers.tracing import Tracer, emit_reward, observe_processor, observe_tool, trace_client

import policy  # this folder is first on the path: the script runs as a file


@observe_processor(kind="REWARD", name="judge_reward")
def judge_reward(grade: Any) -> float:
    return grade()  # the judge's call is made in here: a grader call, not a turn of the trajectory


@observe_processor(kind="ROLLOUT", name="rollout")
def rollout(client: Any, question: str, *, step: int, rollout_id: str, sample_id: str) -> float:
    return policy.rollout(client, rollout_id, question, tool=lambda f: observe_tool(name="calculator")(f),
                          intermediate=lambda value: emit_reward(value), reward_step=judge_reward)


def main(base_url: str, project: str, run_id: str) -> None:
    client = trace_client(openai.OpenAI(base_url=base_url, api_key="sk-agentlightning-parity", max_retries=0))
    finals = {}
    with TrainingTelemetry(project=project, run_id=run_id) as tel, \
            Tracer(tel, content=True, token_ids=True, request_token_ids=True) as tracer:
        for rollout_id, sample_id, question in policy.TASKS:
            finals[rollout_id] = rollout(client, question, step=0, rollout_id=rollout_id, sample_id=sample_id)
    print(json.dumps({"finals": finals, "tracer": {"published": tracer.published, "refused": tracer.refused,
                                                    "dropped": tel.dropped}}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
