"""A LangChain job traced with ``trace_client(llm)``, run in the agent venv (``.venv-agents``) by
``tests/integration/producers/tracing/test_langchain.py``: ``ChatOpenAI`` (langchain-openai) against the
OpenAI-compatible server whose base URL is the first argument, through ``invoke``, ``ainvoke``,
``stream``, ``astream`` (LangChain asking for no usage, so the tracer asks), ``stream(stream_usage=True)``
(LangChain asking for usage itself) and ``batch`` of two, under a ``Tracer`` with content on, publishing
through the SDK's ``InMemoryTransport``.

Prints one JSON object: ``seen`` (what LangChain handed the job: each call's text, and the usage of
the stream that asked for it) and ``spans`` (every span the job published, ids as hex).

    .venv-agents/bin/python tests/agents/langchain_agent.py http://127.0.0.1:PORT/v1
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from langchain_openai import ChatOpenAI

from publish import transport
from rlpulse.producers import TrainingTelemetry
from rlpulse.producers.tracing import Tracer, bind_rollout, trace_client

API_KEY = "sk-langchain-test-" + "0123456789abcdef" * 2
PROMPTS = {"invoke": "invoke me", "ainvoke": "ainvoke me", "stream": "stream me", "astream": "astream me",
           "stream_usage": "stream me with usage", "batch": ["batch one", "batch two"]}


def calls(llm: ChatOpenAI) -> dict[str, Any]:
    seen: dict[str, Any] = {"invoke": llm.invoke(PROMPTS["invoke"]).content,
                            "ainvoke": asyncio.run(llm.ainvoke(PROMPTS["ainvoke"])).content,
                            "stream": "".join(str(c.content) for c in llm.stream(PROMPTS["stream"]))}

    async def astream() -> str:
        return "".join([str(c.content) async for c in llm.astream(PROMPTS["astream"])])

    seen["astream"] = asyncio.run(astream())
    chunks = list(llm.stream(PROMPTS["stream_usage"], stream_usage=True))
    seen["stream_usage"] = "".join(str(c.content) for c in chunks)
    usage = [c.usage_metadata for c in chunks if c.usage_metadata]
    seen["stream_usage_metadata"] = usage[-1] if usage else None
    seen["batch"] = [m.content for m in llm.batch(PROMPTS["batch"])]
    return seen


def main(base_url: str) -> dict[str, Any]:
    llm = ChatOpenAI(model="policy-lc", base_url=base_url, api_key=API_KEY, max_retries=0, temperature=0.0)
    trace_client(llm)
    memory = transport()
    with TrainingTelemetry(project="lc", run_id="lc-run", transport=memory) as tel, Tracer(tel, content=True):
        with bind_rollout(rollout_id="lc-1", step=0):
            seen = calls(llm)
    records = memory.records("spans") if memory else []
    spans = [{k: (x.hex() if isinstance(x, bytes) else x) for k, x in r.items()} for r in records]
    return {"seen": seen, "spans": spans}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), default=str))
