"""One GRPO step of an agent on the real ``openai`` client, streamed, publishing to the real broker:
``python tests/agents/openai_agent.py OPENAI_BASE_URL RUN_ID`` in the agent venv, with the RLPULSE_*
settings in the environment (``tests/integration/producers/tracing/test_agent_stacks.py`` runs it).

Seven rollouts of step 0 under ``Tracer(tel, content=True, token_ids=True, request_token_ids=True)``:

* ``r0``: a sync stream (``stream=True``, no ``stream_options``: the tracer asks for usage and the job
  never sees that chunk), graded, then a non-streamed follow-up call;
* ``r1``: a sync stream cut at ``max_tokens`` (``finish_reason`` ``length``: clipped), graded;
* ``r2``: an async stream offering a tool: the tool call arrives in deltas, the tool runs
  (``@observe_tool``), a second async stream answers; graded, then the follow-up;
* ``r3``: an async stream cut at ``max_tokens``, graded;
* ``r4``: a call refused with 429 and one that times out, each caught and retried, then graded;
* ``r-broken``: a stream the server cuts mid-way: the rollout raises (a failed rollout);
* ``r-500``: a call answered 500: the rollout raises.

Grading runs in another process (``grader_service.py``, its clock 30 s behind), handed the rollout's
context by ``inject()``: its REWARD entry and judge call continue the rollout's ``sequence_id``.
Prints one JSON line: what the job saw (texts, the errors it caught, the scores).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai

from rlpulse.producers import TrainingTelemetry
from rlpulse.producers.tracing import Tracer, inject, observe_processor, observe_tool, set_reward, trace_client

HERE = Path(__file__).resolve().parent
API_KEY = "sk-agent-stacks-0123456789"
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "evaluates arithmetic",
                                           "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
seen: dict[str, Any] = {"texts": {}, "caught": [], "scores": {}, "tool_calls": {}}


def grade(base_url: str, run_id: str, answer: str) -> float:
    """The grading service: another process, given this rollout's context as request headers."""
    done = subprocess.run([sys.executable, str(HERE / "grader_service.py"), base_url, run_id],
                          input=json.dumps({"headers": inject(), "answer": answer}), capture_output=True, text=True,
                          timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"grader_service.py exited {done.returncode}: {done.stderr[-2000:]}")
    return float(json.loads(done.stdout.splitlines()[-1])["score"])


@observe_tool(name="calculator")
def calculator(expression: str) -> str:
    return "42" if expression == "6*7" else "?"


def drain(stream: Any) -> str:
    return "".join(c.choices[0].delta.content or "" for c in stream)  # every chunk has a choice: usage was not asked for


@observe_processor(kind="ROLLOUT")
def sync_rollout(client: openai.OpenAI, base_url: str, run_id: str, *, step: int, rollout_id: str, sample_id: str,
                 max_tokens: int = 256) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{rollout_id}: what is six times seven, in words?"}]
    if rollout_id == "r4":
        for model, error in (("fail-429", openai.RateLimitError), ("slow", openai.APITimeoutError)):
            try:
                client.chat.completions.create(model=model, messages=messages, timeout=0.5)
            except error as exc:
                seen["caught"].append(type(exc).__name__)
    model = {"r-broken": "break-stream", "r-500": "fail-500"}.get(rollout_id, "policy")
    if model == "fail-500":
        client.chat.completions.create(model=model, messages=messages)
    text = drain(client.chat.completions.create(model=model, messages=messages, stream=True, max_tokens=max_tokens))
    seen["texts"][rollout_id] = text
    score = seen["scores"][rollout_id] = grade(base_url, run_id, text)
    set_reward(score)
    if rollout_id == "r0":  # a follow-up, after the grading: it starts after the remote spans
        client.chat.completions.create(model="policy", messages=[*messages, {"role": "assistant", "content": text},
                                                                 {"role": "user", "content": "thanks"}])


@observe_processor(kind="ROLLOUT")
async def async_rollout(client: openai.AsyncOpenAI, base_url: str, run_id: str, *, step: int, rollout_id: str,
                        sample_id: str, max_tokens: int = 256, tools: bool = False) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{rollout_id}: what is 6*7?"}]
    extra: dict[str, Any] = {"tools": TOOLS} if tools else {}
    stream = await client.chat.completions.create(model="policy", messages=messages, stream=True, max_tokens=max_tokens,
                                                  **extra)
    text, calls = "", {}
    async for chunk in stream:
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for call in delta.tool_calls or []:  # the arguments arrive in pieces, by index
            entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += call.id or ""
            entry["name"] += (call.function.name or "") if call.function else ""
            entry["arguments"] += (call.function.arguments or "") if call.function else ""
    if calls:
        seen["tool_calls"][rollout_id] = list(calls.values())
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls.values()]})
        for c in calls.values():
            result = calculator(**json.loads(c["arguments"]))
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
        stream = await client.chat.completions.create(model="policy", messages=messages, stream=True, **extra)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
    seen["texts"][rollout_id] = text
    score = seen["scores"][rollout_id] = await asyncio.to_thread(grade, base_url, run_id, text)
    set_reward(score)


def main(base_url: str, run_id: str) -> None:
    client = trace_client(openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0))
    aclient = trace_client(openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0))
    with TrainingTelemetry(project="stacks", run_id=run_id) as tel, \
            Tracer(tel, content=True, token_ids=True, request_token_ids=True) as tracer:
        sync_rollout(client, base_url, run_id, step=0, rollout_id="r0", sample_id="s0")
        sync_rollout(client, base_url, run_id, step=0, rollout_id="r1", sample_id="s0", max_tokens=3)

        async def both() -> None:
            await async_rollout(aclient, base_url, run_id, step=0, rollout_id="r2", sample_id="s1", tools=True)
            await async_rollout(aclient, base_url, run_id, step=0, rollout_id="r3", sample_id="s1", max_tokens=4)
        asyncio.run(both())
        sync_rollout(client, base_url, run_id, step=0, rollout_id="r4", sample_id="s2")
        for rid, error in (("r-broken", openai.APIConnectionError), ("r-500", openai.InternalServerError)):
            try:
                sync_rollout(client, base_url, run_id, step=0, rollout_id=rid, sample_id="s2")
            except error as exc:
                seen["caught"].append(type(exc).__name__)
        tel.step_completed(0, tokens=1000, duration_s=1.0)
    seen["tracer"] = {"published": tracer.published, "refused": tracer.refused, "dropped": tel.dropped}
    print(json.dumps(seen))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
