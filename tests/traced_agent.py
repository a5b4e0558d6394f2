"""A small agent traced with ``rlpulse.producers.tracing`` and the real ``openai`` client, for the tests of
tracing and of ``rlpulse export``; and the sink's own INSERT of what it published into a store.

Each rollout asks the model (``tests.openai_server.FakeOpenAI``) a question offering a calculator
tool; the model asks for the tool, the agent runs it (a TOOL span) and asks again with the result;
a REWARD entry scores the answer. A task whose model is ``fail-500`` or ``bad-400`` fails at its
first call: the rollout raises and its spans say ERROR.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from rlpulse.producers.tracing import (observe_processor, observe_tool, reward_metrics, rollout_metrics,
                                       set_reward, trace_client)

API_KEY = "sk-rlpulse-test-" + "0123456789abcdef" * 3  # must never reach a span, a message or a log
SYSTEM = "You are a careful assistant. Use the calculator for arithmetic."
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "evaluates an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


@dataclass
class Task:
    step: int
    rollout_id: str
    sample_id: str
    question: str
    model: str = "policy-7b"


@observe_tool(name="calculator")
def calculator(expression: str) -> str:
    left, _, right = expression.partition("*")
    return str(int(left) * int(right))


def score(answer: str | None) -> float:
    return 1.0 if answer and "42" in answer else 0.25


class Agent:
    """Sync: ``openai.OpenAI``; ``rollout(task)`` returns the conversation."""

    def __init__(self, base_url: str, async_client: bool = False):
        import openai

        kind = openai.AsyncOpenAI if async_client else openai.OpenAI
        self.client = trace_client(kind(base_url=base_url, api_key=API_KEY, max_retries=0))

    @observe_processor
    def rollout(self, task: Task) -> list[Any]:
        messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.question}]
        reply = self.client.chat.completions.create(model=task.model, messages=messages, tools=TOOLS, max_tokens=256)
        message = reply.choices[0].message
        for call in message.tool_calls or []:
            messages.append(message)  # as agents do: the reply object itself goes back in the conversation
            result = calculator(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            reply = self.client.chat.completions.create(model=task.model, messages=messages, tools=TOOLS, max_tokens=256)
        rollout_metrics({"turns": float(len(messages) // 2), "tool_calls": float(len(message.tool_calls or []))})
        self.reward(task, reply.choices[0].message.content)
        return messages

    @observe_processor  # kind REWARD: inferred from its name, as seed 000 infers it from the processor's class
    def reward(self, task: Task, answer: str | None) -> float:
        reward_metrics({"exact": 1.0 if answer and "42" in answer else 0.0, "length": float(len(answer or ""))})
        return score(answer)


class AsyncAgent(Agent):
    """The same agent on ``openai.AsyncOpenAI``, its processor a coroutine."""

    def __init__(self, base_url: str):
        super().__init__(base_url, async_client=True)

    @observe_processor(kind="ROLLOUT")
    async def run(self, task: Task) -> list[Any]:
        messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.question}]
        reply = await self.client.chat.completions.create(model=task.model, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        for call in message.tool_calls or []:
            messages.append(message)
            result = await asyncio.to_thread(calculator, **json.loads(call.function.arguments))  # a thread keeps the context
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            reply = await self.client.chat.completions.create(model=task.model, messages=messages, tools=TOOLS)
        set_reward(score(reply.choices[0].message.content))
        return messages


def load_spans(store: Any, containers: list[bytes]) -> None:
    """Insert Span containers (an InMemoryTransport's messages) with the sink's own INSERT plan and inserter."""
    from rlpulse.schemas.codec import read_header
    from rlpulse.sinks.store.avro_sql import Plans
    from rlpulse.sinks.store.clickhouse import table_columns
    from rlpulse.sinks.write.inserter import inserter_for

    plans, inserter = Plans(table_columns(store)), inserter_for(store)
    try:
        for i, value in enumerate(containers):
            inserter.insert(plans.plan("spans", "Span", read_header(value).schema_json), value, f"traced-{i}")
    finally:
        inserter.close()
