"""An agent's tools traced with ``trace_tool``, run in the agent venv (real langchain-core, langgraph,
mcp, openai) as a user's job would: ``python tests/agents/tools_agent.py OPENAI_BASE_URL``.

In one ``@observe_processor`` rollout (``tools-1``, step 1) under ``Tracer(tel, content=True)``:

1. a LangChain tool: ``add`` invoked with a dict, again with a tool call (its id), ``run`` directly;
   an async tool through ``ainvoke``; ``add`` traced a second time (still one span a call) and a
   ``model_copy`` of it;
2. tools traced as a list, a tuple and a dict, each called once;
3. a LangGraph ``ToolNode`` in a graph, invoked with an ``AIMessage`` carrying three tool calls:
   ``add``, ``ask`` (which calls the traced ``openai`` client: its LLM span nests under the TOOL span)
   and ``broken`` (raises; the node, ``handle_tool_errors=True``, answers the model with the error);
4. an MCP ``ClientSession`` over stdio to ``tests/agents/mcp_server.py``: ``add``, then ``fail``
   (``isError``);
5. custom tools: a plain function with ``provider="my-plugin"``, an async one without provider.

Prints JSON lines: ``{"observed": ...}`` (what the calls returned) then ``{"span": ...}`` per span
published, in sequence order (ids as hex).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import openai
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from mcp import ClientSession, StdioServerParameters, stdio_client

from publish import transport
from rlpulse.producers import TrainingTelemetry
from rlpulse.producers.tracing import Tracer, observe_processor, trace_client, trace_tool

SERVER = Path(__file__).with_name("mcp_server.py")
observed: dict[str, Any] = {}


def make_tools(base_url: str) -> dict[str, Any]:
    client = trace_client(openai.OpenAI(base_url=base_url, api_key="sk-tools-agent-key"))

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @tool
    async def lookup(key: str) -> str:
        """Look a key up (async only)."""
        await asyncio.sleep(0)
        return f"value of {key}"

    @tool
    def ask(question: str) -> str:
        """Ask the model."""
        reply = client.chat.completions.create(model="policy-7b", messages=[{"role": "user", "content": question}])
        return reply.choices[0].message.content or ""

    @tool
    def broken(x: int) -> int:
        """Always raises."""
        raise RuntimeError("broken is broken")

    def make(name: str) -> Any:
        def echo(text: str) -> str:
            return f"{name}:{text}"
        echo.__name__ = name
        echo.__doc__ = f"The {name} tool."
        return tool(echo)

    return {"add": add, "lookup": lookup, "ask": ask, "broken": broken,
            **{n: make(n) for n in ("in_list", "in_tuple", "in_dict")}}


async def mcp_calls() -> None:
    params = StdioServerParameters(command=sys.executable, args=[str(SERVER)])
    with open("/dev/null", "w") as quiet:  # the server's log lines
        async with stdio_client(params, errlog=quiet) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            assert trace_tool(session) is session and trace_tool(session) is session
            ok = await session.call_tool("add", {"a": 4, "b": 5})
            failed = await session.call_tool("fail", {"reason": "testing"})
            observed["mcp"] = [r.model_dump(mode="json", exclude_unset=True) for r in (ok, failed)]


def score(text: str, weight: float = 1.0) -> float:
    return len(text) * weight


async def judge(answer: str) -> str:
    await asyncio.sleep(0)
    return "good" if "answer" in answer else "bad"


@observe_processor
def rollout(tools: dict[str, Any], graph: Any, *, step: int, rollout_id: str) -> None:
    add = tools["add"]
    observed["add"] = [add.invoke({"a": 2, "b": 3}),
                       add.invoke({"type": "tool_call", "id": "call-add-1", "name": "add", "args": {"a": 1, "b": 1}}).content,
                       add.run({"a": 10, "b": 20})]
    observed["lookup"] = asyncio.run(tools["lookup"].ainvoke({"key": "k1"}))
    trace_tool(add)  # twice: still one span a call
    observed["add"].append(add.invoke({"a": 7, "b": 0}))
    observed["add"].append(add.model_copy().invoke({"a": 0, "b": 1}))  # a copy of a traced tool is traced
    observed["containers"] = [tools["in_list"].invoke({"text": "l"}), tools["in_tuple"].invoke({"text": "t"}),
                              tools["in_dict"].invoke({"text": "d"})]
    message = AIMessage(content="", tool_calls=[
        {"id": "tc-add", "name": "add", "args": {"a": 6, "b": 7}},
        {"id": "tc-ask", "name": "ask", "args": {"question": "what is 6*7?"}},
        {"id": "tc-broken", "name": "broken", "args": {"x": 1}}])
    result = graph.invoke({"messages": [message]})
    observed["tool_node"] = [{"id": m.tool_call_id, "content": m.content, "status": m.status} for m in result["messages"][1:]]
    asyncio.run(mcp_calls())
    custom = trace_tool(score, provider="my-plugin")
    assert trace_tool(custom, provider="my-plugin") is custom
    observed["custom"] = [custom("hello", weight=2.0), asyncio.run(trace_tool(judge)("answer: 42"))]


def main(base_url: str) -> None:
    tools = make_tools(base_url)
    assert trace_tool(tools["add"]) is tools["add"]
    assert trace_tool([tools["lookup"]]) == [tools["lookup"]]
    listed, tupled, mapped = [tools["in_list"]], (tools["in_tuple"],), {"in_dict": tools["in_dict"]}
    assert trace_tool(listed) is listed and trace_tool(tupled) is tupled and trace_tool(mapped) is mapped
    node = ToolNode([tools["add"], tools["ask"], tools["broken"]], handle_tool_errors=True)
    assert trace_tool(node) is node
    builder = StateGraph(MessagesState)
    builder.add_node("tools", node)
    builder.add_edge(START, "tools")
    builder.add_edge("tools", END)
    graph = builder.compile()
    memory = transport()
    with TrainingTelemetry(project="agents", run_id="tools", transport=memory) as tel, Tracer(tel, content=True) as tracer:
        rollout(tools, graph, step=1, rollout_id="tools-1")
    observed["tracer"] = {"published": tracer.published, "refused": tracer.refused}
    print(json.dumps({"observed": observed}, default=str))
    for record in sorted(memory.records("spans") if memory else [], key=lambda r: r["sequence_id"]):
        print(json.dumps({"span": {k: (x.hex() if isinstance(x, bytes) else x) for k, x in record.items()}}, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
