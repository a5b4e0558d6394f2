"""A simulated agent traced with ``rlpulse.producers.tracing``, for ``rlpulse demo``: traced-LLM trees from
simulated data, with no model, no network and no ``openai`` package.

Each rollout is an ENTRY (ROLLOUT) span over a simulated chat model (``@observe_llm``) that asks for a
calculator tool on some rollouts (``@observe_tool``) and answers, then a REWARD entry scoring the
answer with ``reward_metrics``; one rollout per run fails with a simulated HTTP 500, so its LLM and
ROLLOUT spans say ERROR. Deterministic for a seed. Spans take a simulated clock (latencies of
hundreds of milliseconds, without sleeping), set in the recent past so no span is ahead of the wall
clock; content is recorded (``content=True``) so ``rlpulse export`` has prompts and responses.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

from rlpulse.producers.sdk.delivery import Transport
from rlpulse.producers.sdk.telemetry import TrainingTelemetry
from rlpulse.producers.tracing import (Tracer, observe_llm, observe_processor, observe_tool, reward_metrics,
                                       rollout_metrics, set_reward)
from rlpulse.base.settings import Settings

MODEL = "sim-policy"
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "evaluates a product",
                                           "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


class SimulatedAPIError(RuntimeError):
    """What a model server's HTTP 500 looks like to the tracer: an exception with a status code."""

    status_code = 500


@dataclass
class TracedTruth:
    """What ``simulate_traced_agent`` sent."""

    project: str
    run_id: str
    rollouts: dict[str, float | None] = field(default_factory=dict)  # rollout id -> reward (None: it failed)
    llm_calls: int = 0
    tool_calls: int = 0
    spans: int = 0
    failed: str = ""  # the rollout whose model call failed
    example: str = ""  # a rollout with a tool call: its tree is ENTRY -> LLM, TOOL, LLM, REWARD
    undelivered: int = 0


class _Clock:
    """Simulated time: ``advance`` moves it on by a latency without sleeping."""

    def __init__(self, start_ns: int):
        self.now = start_ns

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: float) -> None:
        self.now += int(ms * 1e6)


class SimulatedAgent:
    def __init__(self, rng: random.Random, clock: _Clock, truth: TracedTruth):
        self.rng, self.clock, self.truth = rng, clock, truth

    @observe_llm(name=f"chat {MODEL}")
    def chat(self, *, model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]], fail: bool = False) -> Any:
        self.clock.advance(self.rng.uniform(200, 900))
        self.truth.llm_calls += 1
        if fail:
            raise SimulatedAPIError("simulated model server error")
        last = messages[-1]
        prompt_tokens = sum(len(str(m.get("content") or "")) for m in messages) // 4 + 8
        if last["role"] == "user" and "*" in str(last["content"]):
            expression = str(last["content"]).split()[-1].rstrip("?")
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{self.truth.llm_calls}", "type": "function",
                "function": {"name": "calculator", "arguments": f'{{"expression": "{expression}"}}'}}]}
            reason, completion = "tool_calls", 18
        else:
            text = f"The answer is {last['content']}." if last["role"] == "tool" else "I think it is 42."
            completion = self.rng.randint(12, 120)
            reason = "length" if completion > 110 else "stop"
            message = {"role": "assistant", "content": text}
        return {"id": f"sim-{self.truth.llm_calls}", "model": model, "choices": [{"finish_reason": reason, "message": message}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion}}

    @observe_tool(name="calculator")
    def calculator(self, expression: str) -> str:
        self.clock.advance(self.rng.uniform(20, 80))
        self.truth.tool_calls += 1
        left, _, right = expression.partition("*")
        return str(int(left) * int(right))

    @observe_processor(kind="ROLLOUT")
    def rollout(self, *, step: int, rollout_id: str, sample_id: str, question: str, fail: bool) -> None:
        messages: list[dict[str, Any]] = [{"role": "system", "content": "Answer briefly; use the calculator."},
                                          {"role": "user", "content": question}]
        reply = self.chat(model=MODEL, messages=messages, tools=TOOLS, fail=fail)
        message = reply["choices"][0]["message"]
        for call in message.get("tool_calls") or []:
            messages += [message, {"role": "tool", "tool_call_id": call["id"],
                                   "content": self.calculator(call["function"]["arguments"].split('"')[3])}]
            reply = self.chat(model=MODEL, messages=messages, tools=TOOLS)
        answer = reply["choices"][0]["message"]["content"]
        rollout_metrics({"turns": float(len(messages) // 2), "answer_chars": float(len(answer))})
        self.truth.rollouts[rollout_id] = self.reward(answer=answer, expected=question)

    @observe_processor(kind="REWARD")
    def reward(self, *, answer: str, expected: str) -> float:
        self.clock.advance(self.rng.uniform(5, 30))
        product = expected.split()[-1].rstrip("?")
        right = "*" in product and str(int(product.split("*")[0]) * int(product.split("*")[1])) in answer
        score = 1.0 if right else round(self.rng.uniform(0.0, 0.5), 3)
        reward_metrics({"correct": 1.0 if right else 0.0, "brevity": 1.0 / (1 + len(answer) / 100)})
        set_reward(score)
        return score


def simulate_traced_agent(settings: Settings, project: str = "sim", run_id: str = "traced-agent", steps: int = 2,
                          rollouts_per_step: int = 4, seed: int = 7, transport: Transport | None = None) -> TracedTruth:
    """Publish one run of a simulated traced agent through the SDK (Kafka per ``settings``, or ``transport``)."""
    rng = random.Random(seed)
    truth = TracedTruth(project, run_id)
    total = steps * rollouts_per_step
    clock = _Clock(time.time_ns() - total * 3 * 10**9)  # at most ~2.5 s of simulated time per rollout
    agent = SimulatedAgent(rng, clock, truth)
    fail_at = rng.randrange(total)
    with TrainingTelemetry(project=project, run_id=run_id, settings=settings, transport=transport) as tel:
        with Tracer(tel, content=True, clock=clock) as tracer:
            for step in range(steps):
                for i in range(rollouts_per_step):
                    n = step * rollouts_per_step + i
                    rollout_id, fail = f"s{step}-r{i}", n == fail_at
                    question = f"What is {rng.randint(2, 12)}*{rng.randint(2, 12)}?" if rng.random() < 0.75 else \
                        "What is the answer to everything?"
                    try:
                        agent.rollout(step=step, rollout_id=rollout_id, sample_id=f"p{step}-{i // 2}", question=question,
                                      fail=fail)
                        if not truth.example and "*" in question:
                            truth.example = rollout_id
                    except SimulatedAPIError:
                        truth.rollouts[rollout_id], truth.failed = None, rollout_id
                tel.step_completed(step, tokens=rollouts_per_step * 256, duration_s=1.0)
            truth.spans = tracer.published
        truth.undelivered = tel.close()
    return truth
