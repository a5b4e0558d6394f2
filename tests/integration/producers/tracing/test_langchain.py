"""LangChain's ``ChatOpenAI`` traced with ``trace_client(llm)``, as a user's job runs it: the script
``tests/agents/langchain_agent.py`` in the agent venv (``.venv-agents``: langchain-openai and the real
``openai`` package, the SDK installed as a wheel), against ``tests.openai_server.FakeOpenAI`` started
here. ``invoke`` (``with_raw_response.create`` and ``parse()``), ``ainvoke``, ``stream``, ``astream`` and
``batch``: one LLM span per HTTP request the server saw, with its usage, content and finish reason
exactly the server's reply, and LangChain handing the job the same text as without tracing.

Under ``CI=true`` a venv that cannot be built fails the test; elsewhere it skips, saying why.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.openai_server import FakeOpenAI

pytestmark = [pytest.mark.integration, pytest.mark.full]
SCRIPT = Path(__file__).resolve().parents[3] / "agents" / "langchain_agent.py"


def test_langchain_calls_are_one_llm_span_per_request_with_the_servers_usage_and_content(agent_python: Path,
                                                                                         tmp_path: Path) -> None:
    with FakeOpenAI() as fake:
        # from a folder of its own, as a user runs it: nothing of this checkout is on its path but the installed SDK
        done = subprocess.run([str(agent_python), str(SCRIPT), fake.base_url], cwd=tmp_path, env={"PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out: dict[str, Any] = json.loads(done.stdout)
    seen, spans = out["seen"], out["spans"]
    prompts = ["invoke me", "ainvoke me", "stream me", "astream me", "stream me with usage"]
    assert [seen[k] for k in ("invoke", "ainvoke", "stream", "astream", "stream_usage")] == [f"answer: {p}" for p in prompts]
    assert seen["batch"] == ["answer: batch one", "answer: batch two"]

    assert [s["kind"] for s in spans] == ["LLM"] * len(fake.requests) == ["LLM"] * 7  # one span per HTTP request
    by_id = {reply["id"]: (fake.requests[int(reply["id"].split("-")[1]) - 1], reply) for _, reply in fake.replies}
    assert {s["attributes"]["gen_ai.response.id"] for s in spans} == set(by_id)
    for span in spans:
        a = span["attributes"]
        request, reply = by_id[a["gen_ai.response.id"]]
        assert (span["status"], span["rollout_id"], a["gen_ai.request.model"], a["gen_ai.response.model"]) == (
            "OK", "lc-1", "policy-lc", "policy-lc-served")
        assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
            reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"])
        assert a["gen_ai.response.finish_reasons"] == reply["choices"][0]["finish_reason"] == "stop"
        assert json.loads(a["gen_ai.output.messages"]) == [reply["choices"][0]["message"]]
        assert json.loads(a["gen_ai.input.messages"]) == request["messages"]
        assert a.get("gen_ai.request.stream", False) is (request.get("stream") is True)
        assert "rlpulse.usage_missing" not in a
    # LangChain's streams: the tracer asked for usage where LangChain did not, and LangChain's own request stood
    streamed = [r for r in fake.requests if r.get("stream")]
    assert [r["stream_options"] for r in streamed] == [{"include_usage": True}] * 3
    [usage] = [reply["usage"] for request, reply in by_id.values() if request["messages"][0]["content"] == "stream me with usage"]
    assert (seen["stream_usage_metadata"]["input_tokens"], seen["stream_usage_metadata"]["output_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"])
