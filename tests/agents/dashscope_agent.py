"""DashScope's ``Generation`` class traced, run in the agent venv (real dashscope 2.0.2) against
``tests/dashscope_server.py``: ``python tests/agents/dashscope_agent.py DASHSCOPE_BASE_URL``.

``trace_client(Generation)`` (seed 000: the class itself) when the lead's dispatch is there, else
``dashscope_client.trace_generation(Generation)``; ``AioGeneration`` through ``trace_generation``.
In one ``@observe_processor`` rollout (``ds-1``, step 2) under ``Tracer(tel, content=True)``, in order:

0. plain, ``result_format='message'``; 1. a prompt, text format; 2. streamed, ``incremental_output=True``;
3. streamed, cumulative chunks; 4. streamed, ``incremental_output=False`` (the SDK merges);
5. model ``fail-500`` (a response with status 500, not an exception); 6. model ``bad-400`` streamed;
7. with ``outgoing_headers`` giving a header and the caller's own ``headers=``; 8. ``AioGeneration``
plain; 9. ``AioGeneration`` streamed; then a call to a closed port (an exception, no request).

Prints ``{"observed": ...}`` (each call's responses as dicts, the stream's chunk times, whether the
dispatch was there) then ``{"span": ...}`` per span, in sequence order.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from typing import Any

import dashscope
from dashscope import AioGeneration, Generation

import rlpulse.producers.tracing.spans as spans
from publish import transport
from rlpulse.producers import TrainingTelemetry
from rlpulse.producers.tracing import Tracer, observe_processor, trace_client
from rlpulse.producers.tracing.dashscope_client import trace_generation

API_KEY = "sk-dashscope-agent-key-0123"
observed: dict[str, Any] = {"calls": [], "stream_times": {}}


def messages(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]


def drain(label: str, stream: Any) -> list[Any]:
    """The stream's chunks, with the time the first arrived and the last was read."""
    chunks, first = [], None
    for chunk in stream:
        first = first or time.time_ns()
        chunks.append(dict(chunk))
    observed["stream_times"][label] = {"first": first, "last": time.time_ns()}
    return chunks


async def adrain(stream: Any) -> list[Any]:
    return [dict(chunk) async for chunk in stream]


@observe_processor
def rollout(*, step: int, rollout_id: str) -> None:
    calls: list[Any] = observed["calls"]
    common = {"api_key": API_KEY, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "max_tokens": 64, "seed": 7}
    calls.append(Generation.call(model="qwen-plus", messages=messages("plain"), result_format="message", **common))
    calls.append(Generation.call(model="qwen-turbo", prompt="a prompt", api_key=API_KEY))
    started = time.time_ns()
    calls.append(drain("incremental", Generation.call(model="qwen-plus", messages=messages("incremental"),
                                                      result_format="message", stream=True, incremental_output=True,
                                                      api_key=API_KEY)))
    observed["stream_times"]["incremental"]["called"] = started
    calls.append(drain("cumulative", Generation.call(model="qwen-plus", messages=messages("cumulative"),
                                                     result_format="message", stream=True, api_key=API_KEY)))
    calls.append(drain("merged", Generation.call(model="qwen-plus", messages=messages("merged"), result_format="message",
                                                 stream=True, incremental_output=False, api_key=API_KEY)))
    calls.append(Generation.call(model="fail-500", messages=messages("fails"), result_format="message", api_key=API_KEY))
    calls.append(drain("failing", Generation.call(model="bad-400", messages=messages("fails streamed"), stream=True,
                                                  api_key=API_KEY)))
    original = spans.outgoing_headers
    spans.outgoing_headers = lambda span: {"traceparent": f"00-{span.trace_id.hex()}-{span.span_id.hex()}-01",
                                           "x-caller": "from-rlpulse"}
    try:
        caller = {"x-caller": "from-caller"}
        calls.append(Generation.call(model="qwen-plus", messages=messages("headers"), result_format="message",
                                     headers=caller, api_key=API_KEY))
        observed["caller_headers_after"] = caller
    finally:
        spans.outgoing_headers = original
    calls.append(asyncio.run(AioGeneration.call(model="qwen-plus", messages=messages("aio"), result_format="message",
                                                api_key=API_KEY)))
    calls.append(asyncio.run(adrain_call()))
    with socket.socket() as s:  # a port nobody listens on: the call raises
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/api/v1"
    try:
        Generation.call(model="qwen-plus", messages=messages("refused"), base_address=closed, api_key=API_KEY)
    except Exception as exc:  # noqa: BLE001 - whatever requests raises
        observed["refused"] = f"{type(exc).__module__}.{type(exc).__qualname__}"


async def adrain_call() -> list[Any]:
    stream = await AioGeneration.call(model="qwen-plus", messages=messages("aio stream"), result_format="message",
                                      stream=True, incremental_output=True, api_key=API_KEY)
    return await adrain(stream)


def main(base_url: str) -> None:
    dashscope.base_http_api_url = base_url
    try:
        assert trace_client(Generation) is Generation
        observed["dispatch"] = True
    except ValueError:  # the lead's dispatch in openai_client.trace_client is not there yet
        observed["dispatch"] = False
        trace_generation(Generation)
    assert trace_generation(Generation) is Generation and trace_generation(AioGeneration) is AioGeneration
    memory = transport()
    with TrainingTelemetry(project="agents", run_id="dashscope", transport=memory) as tel, \
            Tracer(tel, content=True) as tracer:
        rollout(step=2, rollout_id="ds-1")
    observed["tracer"] = {"published": tracer.published, "refused": tracer.refused}
    print(json.dumps({"observed": observed}, default=str))
    for record in sorted(memory.records("spans") if memory else [], key=lambda r: r["sequence_id"]):
        print(json.dumps({"span": {k: (x.hex() if isinstance(x, bytes) else x) for k, x in record.items()}}, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
