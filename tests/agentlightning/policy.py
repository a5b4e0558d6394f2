"""The agent of the agent-lightning parity test, traced by neither tracer: ``al_agent.py`` runs it under
agent-lightning's own tracer, ``rlpulse_agent.py`` under rlpulse's, each against a fresh
``tests.openai_server.FakeOpenAI``, so that both servers see exactly the same requests (the test checks it).

Each rollout makes three policy calls and one judge call:

1. system + user, offering the calculator tool: the server answers with a tool call (``call_<n>``);
2. the same messages plus the assistant's tool call and the tool's result: the server answers text;
   then the **intermediate rewards** (``INTERMEDIATE[rollout]``: one, or two in a row for ``r2``);
3. the conversation plus that answer and a user follow-up, no tools: the server answers text;

then the **reward step**: a judge call (its own system prompt, model ``judge``) whose verdict gives the
**final reward** (``FINAL[rollout]``). Every call asks for vLLM's token ids and logprobs
(``return_token_ids``, ``logprobs``), as rlpulse's ``Tracer(request_token_ids=True)`` does by itself.

The tracers' own calls come in as hooks: ``tool`` wraps the tool function, ``intermediate(value)``
records the intermediate reward, ``reward_step(grade)`` runs ``grade()`` (the judge call) where the
tracer wants a reward step and records what it returns as the final reward.

Both scripts run as files from this folder (so ``import policy`` finds it) and import nothing of the
checkout: each venv has its own packages and, for rlpulse's side, the SDK's wheel.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

SYSTEM = "You are a careful assistant. Use the calculator for arithmetic."
JUDGE_SYSTEM = "You grade answers. Reply with a score between 0 and 1."
FOLLOW_UP = "Now say it in words."
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "evaluates a product of two integers",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
# (rollout id, sample id, question): one step, three samples
TASKS = [("r0", "s0", "What is 6*7?"), ("r1", "s1", "Please compute 6*7."), ("r2", "s2", "6*7 = ?")]
# the intermediate rewards, in order, after the 2nd call: r2 has two (both tools place two rewards that
# follow the same call differently: the test states how)
INTERMEDIATE = {"r0": (0.25,), "r1": (0.5,), "r2": (0.125, 0.375)}
FINAL = {"r0": 0.75, "r1": 1.0, "r2": 0.625}  # what the judge step returns
ASK_TOKEN_IDS: dict[str, Any] = {"extra_body": {"return_token_ids": True}, "logprobs": True}


def calculator(expression: str) -> str:
    left, _, right = expression.partition("*")
    return str(int(left) * int(right))


def rollout(client: Any, rollout_id: str, question: str, *, tool: Callable[[Callable[..., str]], Callable[..., str]],
            intermediate: Callable[[float], None], reward_step: Callable[[Callable[[], float]], float]) -> float:
    """One rollout (see the module docstring); returns the final reward."""
    calc = tool(calculator)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, **ASK_TOKEN_IDS)
    [call] = first.choices[0].message.tool_calls
    # no "content" key: agent-lightning 0.3's span model refuses the None that AgentOps records for
    # OpenAI's own shape of this message ("content": null), and the call raises (see docs/agentlightning.md)
    messages.append({"role": "assistant", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
    messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(**json.loads(call.function.arguments))})
    second = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, **ASK_TOKEN_IDS)
    for value in INTERMEDIATE[rollout_id]:
        intermediate(value)
    messages += [{"role": "assistant", "content": second.choices[0].message.content},
                 {"role": "user", "content": FOLLOW_UP}]
    third = client.chat.completions.create(model="policy", messages=messages, **ASK_TOKEN_IDS)
    answer = third.choices[0].message.content

    def grade() -> float:
        client.chat.completions.create(model="judge", messages=[
            {"role": "system", "content": JUDGE_SYSTEM},
            {"role": "user", "content": f"Question: {question}\nAnswer: {answer}"}], **ASK_TOKEN_IDS)
        return FINAL[rollout_id]

    return reward_step(grade)
