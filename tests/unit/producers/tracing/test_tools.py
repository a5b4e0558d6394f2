"""``trace_tool`` without the agent packages: plain callables (sync and async, a custom provider),
containers of them, idempotence, errors, nesting and what it refuses, through the SDK into an
``InMemoryTransport``. LangChain tools, a LangGraph ToolNode and a real MCP session are
``tests/integration/producers/tracing/test_agent_tools.py`` (the real packages, in the agent venv)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from rlpulse.producers import InMemoryTransport, TrainingTelemetry
from rlpulse.producers.tracing import Tracer, observe_llm, observe_processor, observe_tool, trace_tool
from rlpulse.producers.tracing.tools import PROVIDER


def traced(fn: Any, content: bool = True) -> list[dict[str, Any]]:
    """Runs ``fn()`` inside a ROLLOUT entry under a Tracer; the spans, in sequence order."""
    transport = InMemoryTransport()
    entry = observe_processor(lambda: fn(), name="rollout")
    with TrainingTelemetry(project="p", run_id="run", transport=transport) as tel, Tracer(tel, content=content) as tracer:
        entry()
    records = sorted(transport.records("spans"), key=lambda r: r["sequence_id"])
    assert (tracer.published, tracer.refused) == (len(records), 0)
    return records


def tools_of(records: list[dict[str, Any]]) -> list[tuple]:
    """(name, provider, status, status message, arguments, result) per TOOL span."""
    def content(r: dict[str, Any], key: str) -> Any:
        return json.loads(r["attributes"][key]) if key in r["attributes"] else None
    return [(r["name"], r["attributes"][PROVIDER], r["status"], r["status_message"],
             content(r, "gen_ai.tool.call.arguments"), content(r, "gen_ai.tool.call.result"))
            for r in records if r["kind"] == "TOOL"]


def score(text: str, weight: float = 1.0) -> float:
    return len(text) * weight


async def judge(answer: str) -> str:
    await asyncio.sleep(0)
    return "good"


def test_a_custom_tool_is_one_span_a_call_with_its_provider_arguments_and_result() -> None:
    custom, plain = trace_tool(score, provider="my-plugin"), trace_tool(judge)
    assert custom is not score and custom.__name__ == "score"  # a wrapper, as observe_tool gives
    records = traced(lambda: (custom("abc", weight=2.0), asyncio.run(plain("x"))))
    assert tools_of(records) == [("score", "my-plugin", "OK", "", {"text": "abc", "weight": 2.0}, 6.0),
                                 ("judge", "function", "OK", "", {"answer": "x"}, "good")]
    entry = records[[r["kind"] for r in records].index("ROLLOUT")]
    for r in records:
        if r["kind"] == "TOOL":
            assert (r["parent_span_id"], r["trace_id"], r["attributes"]["gen_ai.operation.name"],
                    r["attributes"]["gen_ai.tool.name"]) == (entry["span_id"], entry["trace_id"], "execute_tool", r["name"])
            assert "gen_ai.tool.call.id" not in r["attributes"]


def test_tracing_twice_or_over_observe_tool_makes_one_span() -> None:
    once = trace_tool(score, provider="my-plugin")
    assert trace_tool(once) is once and trace_tool(once, provider="other") is once
    # the same tool seen through two layers: trace_tool inside observe_tool's span opens none of its own
    # (observe_tool inside trace_tool's would, until observe_tool learns the same check)
    decorated = observe_tool(trace_tool(score, provider="inner"))
    records = traced(lambda: (once("a"), decorated("b")))
    assert [(r["name"], r["attributes"].get(PROVIDER)) for r in records if r["kind"] == "TOOL"] == [
        ("score", "my-plugin"), ("score", None)]


def test_containers_are_traced_and_returned() -> None:
    listed, mapped = [score, judge], {"s": score}
    assert trace_tool(listed) is listed and trace_tool(mapped) is mapped
    assert listed[0] is not score and mapped["s"] is not score  # their wrappers took the functions' places
    tupled = trace_tool((score,), provider="t")
    assert type(tupled) is tuple and tupled[0] is not score
    assert trace_tool(tupled, provider="t") is tupled  # already traced: the same tuple back
    records = traced(lambda: (listed[0]("l"), asyncio.run(listed[1]("x")), mapped["s"]("m"), tupled[0]("t")))
    assert [(n, p) for n, p, *_ in tools_of(records)] == [("score", "function"), ("judge", "function"),
                                                           ("score", "function"), ("score", "t")]


def test_the_tool_span_is_current_while_it_runs_and_a_model_call_inside_nests_under_it() -> None:
    @observe_llm
    def ask(*, model: str, messages: list) -> str:
        return "forty-two"

    def agentic(question: str) -> str:
        return ask(model="m", messages=[{"role": "user", "content": question}])

    tool = trace_tool(agentic, provider="agent")
    records = traced(lambda: tool("q"))
    by_kind = {r["kind"]: r for r in records}
    assert by_kind["LLM"]["parent_span_id"] == by_kind["TOOL"]["span_id"]
    assert by_kind["TOOL"]["parent_span_id"] == by_kind["ROLLOUT"]["span_id"]


def test_a_failing_tool_is_an_error_span_and_its_error_reaches_the_caller() -> None:
    def broken(x: int) -> int:
        raise KeyError("secret message")

    tool = trace_tool(broken)

    def call() -> None:
        with pytest.raises(KeyError):
            tool(1)
    records = traced(call)
    assert tools_of(records) == [("broken", "function", "ERROR", "KeyError", {"x": 1}, None)]
    assert "secret message" not in json.dumps([r["attributes"] for r in records])


def test_content_off_records_no_arguments_or_result() -> None:
    records = traced(lambda: trace_tool(score)("abc"), content=False)
    [tool] = [r for r in records if r["kind"] == "TOOL"]
    assert not {"gen_ai.tool.call.arguments", "gen_ai.tool.call.result"} & set(tool["attributes"])


def test_no_tracer_no_span_and_the_call_unchanged() -> None:
    assert trace_tool(score)("abcd") == 4.0


class CallToolResult:
    """The names of ``mcp_types.CallToolResult`` that the tracer reads."""

    def __init__(self, text: str, is_error: bool):
        self.content = [{"type": "text", "text": text}]
        self.is_error = is_error

    def model_dump(self, exclude_unset: bool = True) -> dict[str, Any]:
        return {"content": self.content, "is_error": self.is_error}


class ClientSession:
    """``mcp.client.session.ClientSession``'s ``call_tool(name, arguments)``, the module name included:
    the tracer recognises MCP objects by it (the real one: the agent test)."""

    async def call_tool(self, name: str, arguments: dict[str, Any] | None = None) -> CallToolResult:
        return CallToolResult("9" if name == "add" else "no", is_error=name != "add")


ClientSession.__module__ = "mcp.client.session"


def test_an_mcp_session_call_is_a_span_named_after_the_tool_and_is_error_an_error_span() -> None:
    session = ClientSession()
    assert trace_tool(session) is session and trace_tool(session) is session

    async def calls() -> None:
        await session.call_tool("add", {"a": 4, "b": 5})
        await session.call_tool("fail", arguments={})
    records = traced(lambda: asyncio.run(calls()))
    assert tools_of(records) == [
        ("add", "mcp", "OK", "", {"a": 4, "b": 5}, {"content": [{"type": "text", "text": "9"}], "is_error": False}),
        ("fail", "mcp", "ERROR", "ToolCallError", {}, {"content": [{"type": "text", "text": "no"}], "is_error": True})]


@pytest.mark.parametrize("target", [42, "tool", None, int])
def test_what_it_does_not_take_is_refused_naming_what_it_does(target: Any) -> None:
    with pytest.raises(ValueError, match="trace_tool takes a LangChain BaseTool, a list, tuple or dict of tools, "
                                         "a LangGraph ToolNode, an MCP ClientSession, or a callable"):
        trace_tool(target)


def test_a_bad_provider_is_refused() -> None:
    with pytest.raises(ValueError, match="provider"):
        trace_tool(score, provider="")
