"""An agent whose LLM and tool calls become a span tree: ROLLOUT -> LLM, TOOL, LLM, and the judge's LLM.

Needs a Kafka broker (``rlpulse services up``) and an OpenAI-compatible server: the ``openai``
client reads ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (a vLLM or SGLang server, or OpenAI itself;
the model is ``--model``). The broker and topic prefix come from the usual ``RLPULSE_*`` variables;
``RLPULSE_TRACE_CONTENT=1`` records the messages too (off by default).

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=... python examples/traced_agent.py
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.request
from typing import Any

import openai

from rlpulse import TrainingTelemetry
from rlpulse.producers.tracing import Tracer, observe_llm, observe_processor, observe_tool, set_reward, trace_client

QUESTIONS = ["What is 6*7?", "What is 7*6?"]  # one rollout each, at step 0
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "evaluates a product such as 6*7",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


@observe_tool(name="calculator")  # a TOOL span around each call
def calculator(expression: str) -> str:
    left, _, right = expression.partition("*")
    return str(int(left) * int(right))


@observe_llm(name="judge")  # an LLM span for a model called without the openai client (usage read from the reply)
def judge(*, model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
                                     data=json.dumps({"model": model, "messages": messages}).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', '')}"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.load(answer)


@observe_processor  # the ROLLOUT span: its children nest under it; step and rollout_id come from the arguments
def rollout(client: Any, model: str, question: str, *, step: int, rollout_id: str) -> None:
    messages: list[Any] = [{"role": "user", "content": question}]
    reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
    for call in reply.tool_calls or []:  # the model asked for the calculator: run it, then ask again
        messages += [reply, {"role": "tool", "tool_call_id": call.id,
                             "content": calculator(**json.loads(call.function.arguments))}]
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
    verdict = judge(model=model, messages=[{"role": "user", "content": f"Is this 42? {reply.content}"}])
    set_reward(1.0 if "42" in (reply.content or "") + verdict["choices"][0]["message"]["content"] else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", default="examples")
    parser.add_argument("--run-id", default="traced-agent")
    parser.add_argument("--model", default="policy")
    args = parser.parse_args()
    client = trace_client(openai.OpenAI())  # every chat.completions.create becomes an LLM span
    with TrainingTelemetry(project=args.project, run_id=args.run_id) as tel, Tracer(tel):
        for i, question in enumerate(QUESTIONS):
            rollout(client, args.model, question, step=0, rollout_id=f"q{i}")
        tel.step_completed(step=0)
    print(f"traced {len(QUESTIONS)} rollouts for {args.project}/{args.run_id}")


if __name__ == "__main__":
    main()
