"""``trace_tool`` and DashScope's ``Generation`` traced with the real agent packages: the scripts
``tests/agents/tools_agent.py`` and ``tests/agents/dashscope_agent.py`` run in the agent venv
(``.venv-agents``: langchain-core, langgraph, mcp, dashscope, openai, the SDK from this checkout),
from a folder of their own, against loopback servers this test starts (``tests.openai_server``,
``tests.dashscope_server``; the MCP server is a stdio subprocess of the script). Each prints the
spans its telemetry published; this test holds them to what the calls did and what the servers saw.

Under ``CI=true`` a venv that cannot be built fails the test; elsewhere it skips, saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.dashscope_server import CHUNK_DELAY_S, CHUNKS, FakeDashScope
from tests.openai_server import FakeOpenAI

pytestmark = [pytest.mark.integration, pytest.mark.full]

AGENTS = Path(__file__).resolve().parents[4] / "tests" / "agents"


@pytest.fixture(scope="module")
def python(agent_python: Path) -> Path:
    return agent_python  # conftest.py builds it


def run(python: Path, script: str, url: str, workdir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The script's ``observed`` line and its spans."""
    env = {k: val for k, val in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "RLPULSE_TRACE_CONTENT")}
    # from its own folder, as a user runs it: nothing of this checkout is on its path but the installed SDK
    done = subprocess.run([str(python), str(AGENTS / script), url], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{script} failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    [observed] = [line["observed"] for line in lines if "observed" in line]
    return observed, [line["span"] for line in lines if "span" in line]


# -- trace_tool --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tools(python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    with FakeOpenAI() as fake:
        observed, spans = run(python, "tools_agent.py", fake.base_url, tmp_path_factory.mktemp("tools"))
    return {"observed": observed, "spans": spans, "requests": fake.requests, "replies": fake.replies}


def attrs(span: dict[str, Any], *keys: str) -> tuple:
    return tuple(span["attributes"].get(k) for k in keys)


def test_one_tool_span_per_call_with_its_name_provider_arguments_and_result(tools: dict[str, Any]) -> None:
    observed, spans = tools["observed"], tools["spans"]
    calls = [s for s in spans if s["kind"] == "TOOL"]
    got = [(s["name"], s["status"], s["status_message"], *attrs(s, "rlpulse.tool.provider", "gen_ai.tool.call.id"),
            json.loads(s["attributes"]["gen_ai.tool.call.arguments"]),
            json.loads(s["attributes"]["gen_ai.tool.call.result"]) if "gen_ai.tool.call.result" in s["attributes"] else None)
           for s in calls]
    node = {m["id"]: m["content"] for m in observed["tool_node"]}
    ok, failed = observed["mcp"]
    assert got == [
        ("add", "OK", "", "langchain", None, {"a": 2, "b": 3}, 5),
        ("add", "OK", "", "langchain", "call-add-1", {"a": 1, "b": 1}, "2"),  # a tool call: the ToolMessage's content
        ("add", "OK", "", "langchain", None, {"a": 10, "b": 20}, 30),  # run() directly
        ("lookup", "OK", "", "langchain", None, {"key": "k1"}, "value of k1"),  # ainvoke of an async tool
        ("add", "OK", "", "langchain", None, {"a": 7, "b": 0}, 7),  # traced twice: one span
        ("add", "OK", "", "langchain", None, {"a": 0, "b": 1}, 1),  # a model_copy of a traced tool
        ("in_list", "OK", "", "langchain", None, {"text": "l"}, "in_list:l"),
        ("in_tuple", "OK", "", "langchain", None, {"text": "t"}, "in_tuple:t"),
        ("in_dict", "OK", "", "langchain", None, {"text": "d"}, "in_dict:d"),
        ("add", "OK", "", "langchain", "tc-add", {"a": 6, "b": 7}, node["tc-add"]),  # the ToolNode's three calls
        ("ask", "OK", "", "langchain", "tc-ask", {"question": "what is 6*7?"}, node["tc-ask"]),
        ("broken", "ERROR", "RuntimeError", "langchain", "tc-broken", {"x": 1}, None),
        ("add", "OK", "", "mcp", None, {"a": 4, "b": 5}, ok),  # the MCP session
        ("fail", "ERROR", "ToolCallError", "mcp", None, {"reason": "testing"}, failed),
        ("score", "OK", "", "my-plugin", None, {"text": "hello", "weight": 2.0}, 10.0),  # custom tools
        ("judge", "OK", "", "function", None, {"answer": "answer: 42"}, "good"),
    ]
    assert observed["add"] == [5, "2", 30, 7, 1] and observed["custom"] == [10.0, "good"]
    assert (ok["is_error"], failed["is_error"], ok["structured_content"]) == (False, True, {"result": 9})
    assert {s["attributes"]["gen_ai.operation.name"] for s in calls} == {"execute_tool"}
    assert [s["attributes"]["gen_ai.tool.name"] for s in calls] == [s["name"] for s in calls]
    assert calls[11]["attributes"]["error.type"] == "builtins.RuntimeError"
    assert calls[13]["attributes"]["error.type"] == "rlpulse.producers.tracing.tools.ToolCallError"
    assert observed["tracer"] == {"published": len(spans), "refused": 0}


def test_tool_spans_nest_under_the_rollout_and_an_llm_call_inside_a_tool_under_its_span(tools: dict[str, Any]) -> None:
    spans = tools["spans"]
    [entry] = [s for s in spans if s["kind"] == "ROLLOUT"]
    [llm] = [s for s in spans if s["kind"] == "LLM"]
    [ask] = [s for s in spans if s["name"] == "ask"]
    assert (entry["name"], entry["rollout_id"], entry["step"], entry["parent_span_id"]) == ("rollout", "tools-1", 1, None)
    assert len(spans) == 18  # the entry, 16 tool calls, one LLM call
    for span in spans:
        assert (span["trace_id"], span["rollout_id"], span["step"]) == (entry["trace_id"], "tools-1", 1)
        if span["kind"] == "TOOL":
            assert span["parent_span_id"] == entry["span_id"], span["name"]
    assert llm["parent_span_id"] == ask["span_id"]  # the model call the tool made
    assert ask["start_time_ns"] <= llm["start_time_ns"] <= llm["end_time_ns"] <= ask["end_time_ns"]
    [request] = tools["requests"]  # one model call, the one in the span
    assert json.loads(llm["attributes"]["gen_ai.input.messages"]) == request["messages"]
    assert llm["attributes"]["gen_ai.response.id"] == tools["replies"][0][1]["id"]


# -- DashScope --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dashscope(python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    with FakeDashScope() as fake:
        observed, spans = run(python, "dashscope_agent.py", fake.base_url, tmp_path_factory.mktemp("dashscope"))
    return {"observed": observed, "spans": spans, "requests": fake.requests, "replies": fake.replies,
            "port": fake.server.server_address[1]}


def reply_message(reply: dict[str, Any]) -> dict[str, Any]:
    output = reply["output"]
    return output["choices"][0]["message"] if "choices" in output else {"role": "assistant", "content": output["text"]}


def test_one_llm_span_per_request_with_what_the_server_sent(dashscope: dict[str, Any]) -> None:
    spans, requests, replies = dashscope["spans"], dashscope["requests"], dashscope["replies"]
    llm = [s for s in spans if s["kind"] == "LLM"]
    assert len(requests) == len(replies) == 10 and len(llm) == 11  # the last call never reached the server
    for span, request, (status, reply) in zip(llm, requests, replies):
        a = span["attributes"]
        body = request["body"]
        assert (span["name"], a["gen_ai.provider.name"], a["gen_ai.request.model"]) == (
            f"chat {body['model']}", "dashscope", body["model"])
        sent = body["input"].get("messages") or [{"role": "user", "content": body["input"].get("prompt")}]
        assert json.loads(a["gen_ai.input.messages"]) == sent
        assert a.get("gen_ai.request.stream") == (True if request["headers"].get("X-DashScope-SSE") == "enable" else None)
        chunks = reply if isinstance(reply, list) else [reply]
        if status != 200:
            assert (span["status"], span["status_message"], a["http.response.status_code"], a["dashscope.error.code"],
                    a["gen_ai.response.id"]) == ("ERROR", "DashScopeError", status, chunks[0]["code"], chunks[0]["request_id"])
            assert "gen_ai.output.messages" not in a
            continue
        last = chunks[-1]
        incremental = body["parameters"].get("incremental_output") is True
        content = "".join(reply_message(c)["content"] for c in chunks) if incremental else reply_message(last)["content"]
        assert (span["status"], a["gen_ai.response.id"], a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"],
                a["gen_ai.response.finish_reasons"]) == ("OK", last["request_id"], last["usage"]["input_tokens"],
                                                         last["usage"]["output_tokens"], "stop")
        assert json.loads(a["gen_ai.output.messages"]) == [{"role": "assistant", "content": content}]
    first = llm[0]["attributes"]
    assert {k: first.get(f"gen_ai.request.{k}") for k in ("temperature", "top_p", "top_k", "max_tokens", "seed")} == \
        {k: requests[0]["body"]["parameters"][k] for k in ("temperature", "top_p", "top_k", "max_tokens", "seed")}
    assert (first["server.address"], first["server.port"]) == ("127.0.0.1", dashscope["port"])
    refused = llm[-1]
    assert (refused["status"], refused["attributes"]["error.type"]) == ("ERROR", dashscope["observed"]["refused"])
    assert dashscope["observed"]["tracer"] == {"published": len(spans), "refused": 0}


def test_the_calls_answered_what_the_server_sent_and_spans_nest_under_the_rollout(dashscope: dict[str, Any]) -> None:
    spans, observed = dashscope["spans"], dashscope["observed"]
    [entry] = [s for s in spans if s["kind"] == "ROLLOUT"]
    assert (entry["rollout_id"], entry["step"], entry["status"]) == ("ds-1", 2, "OK")
    assert {(s["parent_span_id"], s["trace_id"]) for s in spans if s["kind"] == "LLM"} == {(entry["span_id"], entry["trace_id"])}
    assert observed["calls"][0]["output"]["choices"][0]["message"] == reply_message(dashscope["replies"][0][1])
    assert (observed["calls"][5]["status_code"], [c["status_code"] for c in observed["calls"][6]]) == (500, [400])
    assert "sk-dashscope-agent-key-0123" not in json.dumps(spans)


def test_a_streamed_span_lasts_until_the_stream_is_read(dashscope: dict[str, Any]) -> None:
    llm = [s for s in dashscope["spans"] if s["kind"] == "LLM"]
    times = dashscope["observed"]["stream_times"]
    for index, label in ((2, "incremental"), (3, "cumulative"), (4, "merged")):
        span = llm[index]
        assert span["attributes"]["gen_ai.request.stream"] is True
        assert span["end_time_ns"] - span["start_time_ns"] >= (CHUNKS - 1) * CHUNK_DELAY_S * 1e9 * 0.9, label
        assert span["start_time_ns"] <= times[label]["first"] and span["end_time_ns"] <= times[label]["last"], label
        assert span["end_time_ns"] >= times[label]["first"], label
    assert llm[2]["start_time_ns"] >= times["incremental"]["called"]


def test_outgoing_headers_go_out_under_the_callers_own(dashscope: dict[str, Any]) -> None:
    spans, requests = dashscope["spans"], dashscope["requests"]
    llm = [s for s in spans if s["kind"] == "LLM"]
    headers = {k.lower(): val for k, val in requests[7]["headers"].items()}
    assert headers["traceparent"] == f"00-{llm[7]['trace_id']}-{llm[7]['span_id']}-01"
    assert headers["x-caller"] == "from-caller"  # the caller's header wins over the tracer's
    assert dashscope["observed"]["caller_headers_after"] == {"x-caller": "from-caller"}  # their dict untouched


def test_trace_client_dispatches_the_generation_class(dashscope: dict[str, Any]) -> None:
    if not dashscope["observed"]["dispatch"]:
        pytest.skip("rlpulse.producers.tracing.trace_client does not yet dispatch DashScope's Generation class to "
                    "dashscope_client.trace_generation (the lead adds it in openai_client.trace_client); the agent "
                    "traced it with trace_generation directly")
    assert len([s for s in dashscope["spans"] if s["kind"] == "LLM"]) == 11
