"""Agents on the real stacks, through the real broker, ``rlpulse streams`` and ``rlpulse sink``, into
ClickHouse: each script of ``tests/agents/`` runs in the agent venv (``.venv-agents``: openai,
langchain-openai, langgraph, mcp and dashscope, pinned; the SDK as a wheel) with AGENT_PUBLISH=kafka,
against servers started here on loopback, and what ClickHouse holds is checked against what those
servers saw:

* ``openai_agent.py``: streamed calls (sync and async, tool-call deltas, usage asked for by the
  tracer), 429 / timeout / 500, a stream cut mid-way, token ids; a grading service in another
  process whose clock is 30 s behind: ``ORDER BY sequence_id`` is start order across both;
  the step's completion lengths, clipped ratio and rollouts attempted vs failed;
* ``langchain_agent.py`` (invoke, ainvoke, stream, astream, batch), ``tools_agent.py`` (LangChain
  tools, a LangGraph ToolNode, an MCP session over stdio, custom tools) and ``dashscope_agent.py``
  (``Generation.call``, plain and streamed): one span per HTTP call or tool call, as the servers saw.

Under ``CI=true`` a venv that cannot be built fails; elsewhere the module skips, saying why.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rlpulse.base.settings import Settings
from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.schemas.topics import ensure_topics
from tests.dashscope_server import FakeDashScope
from tests.integration import until
from tests.openai_server import FakeOpenAI

pytestmark = [pytest.mark.integration, pytest.mark.full]
AGENTS = Path(__file__).resolve().parents[3] / "agents"
RUN = "stacks-openai"
SCORED, FAILED = ["r0", "r1", "r2", "r3", "r4"], ["r-broken", "r-500"]
COLUMNS = ("kind", "name", "rollout_id", "status", "status_message", "sequence_id", "writer_id", "span_id", "parent_span_id",
           "start_time_ns", "end_time_ns", "attributes", "reward", "completion_tokens", "clipped", "finish_reason", "step")


def spans(settings: Settings, project: str, run: str) -> list[dict[str, Any]]:
    rows = until.query(settings, f"SELECT {', '.join(COLUMNS)} FROM $db.spans FINAL WHERE project = '{project}' "
                                 f"AND run_id = '{run}' ORDER BY sequence_id, span_id")
    return [dict(zip(COLUMNS, row)) for row in rows or []]


@pytest.fixture(scope="module")
def ran(module_settings: Settings, agent_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    settings = module_settings
    ensure_topics(settings)
    cwd = tmp_path_factory.mktemp("agent")  # a folder of its own: nothing of the checkout on the path but the wheel
    env = {**settings_env(settings), "AGENT_PUBLISH": "kafka", "PYTHONPATH": ""}

    def run(script: str, *args: str) -> str:
        done = subprocess.run([str(agent_python), str(AGENTS / script), *args], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, (script, done.stderr[-4000:])
        return done.stdout

    with FakeOpenAI() as fake, FakeOpenAI() as lc_fake, FakeOpenAI() as tools_fake, FakeDashScope() as ds, \
            Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        seen = json.loads(run("openai_agent.py", fake.base_url, RUN))
        out = {"openai": seen, "langchain": json.loads(run("langchain_agent.py", lc_fake.base_url)),
               "tools": [json.loads(line) for line in run("tools_agent.py", tools_fake.base_url).splitlines()],
               "dashscope": [json.loads(line) for line in run("dashscope_agent.py", ds.base_url).splitlines()]}
        tools_observed = out["tools"][0]["observed"]
        expected = {  # every HTTP call a span, plus the entries (and the tools)
            f"SELECT count() FROM $db.spans FINAL WHERE run_id = '{RUN}'": len(fake.requests) + 7 + 5 + 1,
            "SELECT count() FROM $db.spans FINAL WHERE run_id = 'lc-run'": len(lc_fake.requests),
            "SELECT count() FROM $db.spans FINAL WHERE run_id = 'dashscope' AND kind = 'LLM'": len(ds.requests) + 1,
            "SELECT count() FROM $db.spans FINAL WHERE run_id = 'tools'": tools_observed["tracer"]["published"],
            f"SELECT count() FROM $db.step_stats FINAL WHERE run_id = '{RUN}'": 1}
        pipeline.wait_caught_up(until=until.counts(settings, expected))
        got = {name: spans(settings, project, run_id) for name, project, run_id in (
            ("openai", "stacks", RUN), ("langchain", "lc", "lc-run"), ("tools", "agents", "tools"),
            ("dashscope", "agents", "dashscope"))}
        stats = until.query(settings, "SELECT rollouts, rollouts_attempted, rollouts_failed, clipped, clipped_ratio, "
                                      "completion_mean, completion_min, completion_max, reward_mean FROM $db.step_stats FINAL "
                                      f"WHERE run_id = '{RUN}'")
        pipeline.stop()
    return {"out": out, "spans": got, "stats": stats, "fake": fake, "lc_fake": lc_fake, "tools_fake": tools_fake, "ds": ds,
            "expected": expected}


def test_every_http_call_is_one_span_as_the_server_saw_it(ran: dict[str, Any]) -> None:
    fake, rows = ran["fake"], ran["spans"]["openai"]
    llm = [r for r in rows if r["kind"] == "LLM"]
    assert len(llm) == len(fake.requests) and len(rows) == ran["expected"][next(iter(ran["expected"]))]
    ok = {r["attributes"]["gen_ai.response.id"]: r for r in llm if r["status"] == "OK"}
    for request, headers, (status, reply), chunks in zip(fake.requests, fake.headers, fake.replies, fake.chunks):
        if status != 200 or request["model"] in ("break-stream", "slow"):  # cut, or answered after the client gave up
            continue
        span = ok[reply["id"]]
        a = span["attributes"]
        assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
            str(reply["usage"]["prompt_tokens"]), str(reply["usage"]["completion_tokens"]))
        assert a["gen_ai.response.finish_reasons"] == reply["choices"][0]["finish_reason"]
        assert json.loads(a["gen_ai.output.messages"]) == [reply["choices"][0]["message"]]
        assert json.loads(a["gen_ai.input.messages"]) == request["messages"]
        if request["model"] == "policy":  # asked for by the tracer (request_token_ids), recorded as the server sent them
            assert (request["return_token_ids"], request["logprobs"]) == (True, True)
            assert json.loads(a["rlpulse.response_token_ids"]) == reply["choices"][0]["token_ids"]
            assert json.loads(a["rlpulse.prompt_token_ids"]) == reply["prompt_token_ids"]
        # the request named its rollout and its place in it, for a server-side span to join
        assert headers["x-rollout-id"] == span["rollout_id"] and headers["x-attempt-id"] == "1"
        assert int(headers["x-sequence-id"]) >= span["sequence_id"]
        assert headers["traceparent"].split("-")[2] == span["span_id"]  # the call's own span is the parent
        if chunks is not None:  # streamed: the span lasts until the last chunk, 20 ms apart
            assert request["stream_options"] == {"include_usage": True}
            assert span["end_time_ns"] - span["start_time_ns"] >= (len(chunks) - 1) * 20_000_000 * 0.9
    errors = sorted((r["name"], r["status_message"], r["attributes"].get("http.response.status_code")) for r in llm
                    if r["status"] == "ERROR")
    assert errors == [("chat break-stream", "APIConnectionError", None), ("chat fail-429", "RateLimitError", "429"),
                      ("chat fail-500", "InternalServerError", "500"), ("chat slow", "APITimeoutError", None)]
    assert ran["out"]["openai"]["tracer"] == {"published": len([r for r in rows if r["writer_id"] == rows[0]["writer_id"]]),
                                              "refused": 0, "dropped": 0}


def test_sequence_id_is_start_order_across_the_job_and_its_grading_service(ran: dict[str, Any]) -> None:
    rows = ran["spans"]["openai"]
    r0 = [r for r in rows if r["rollout_id"] == "r0"]
    assert [(r["kind"], r["name"]) for r in r0] == [("ROLLOUT", "sync_rollout"), ("LLM", "chat policy"), ("REWARD", "grade"),
                                                    ("LLM", "chat judge"), ("LLM", "chat policy")]
    job, grader = r0[0]["writer_id"], r0[2]["writer_id"]
    assert [r["writer_id"] == job for r in r0] == [True, True, False, False, True]
    # the grader's clock is 30 s behind: by the clocks it started first, by sequence_id after the call that sent it
    assert r0[2]["start_time_ns"] < r0[1]["start_time_ns"]
    assert r0[2]["parent_span_id"] == r0[0]["span_id"] and r0[3]["parent_span_id"] == r0[2]["span_id"]
    for rid in SCORED:  # every grading joined its rollout, under its entry, after the rollout's first call
        kinds = [r["kind"] for r in rows if r["rollout_id"] == rid]
        assert kinds[0] == "ROLLOUT" and kinds.count("REWARD") == 1 and grader != job
    r2 = [(r["kind"], r["name"]) for r in rows if r["rollout_id"] == "r2"]
    assert r2 == [("ROLLOUT", "async_rollout"), ("LLM", "chat policy"), ("TOOL", "calculator"), ("LLM", "chat policy"),
                  ("REWARD", "grade"), ("LLM", "chat judge")]


def test_the_steps_lengths_clipped_ratio_and_failed_rollouts_include_the_streamed_ones(ran: dict[str, Any]) -> None:
    fake, rows = ran["fake"], ran["spans"]["openai"]
    tokens: dict[str, int] = {}
    reasons: dict[str, str] = {}
    for request, headers, (status, reply) in zip(fake.requests, fake.headers, fake.replies):
        rid = headers["x-rollout-id"]
        if request["model"] == "policy" and status == 200 and rid in SCORED:
            tokens[rid] = tokens.get(rid, 0) + reply["usage"]["completion_tokens"]
            reasons[rid] = reply["choices"][0]["finish_reason"]
    entries = {r["rollout_id"]: r for r in rows if r["kind"] == "ROLLOUT"}
    assert {rid: (entries[rid]["completion_tokens"], entries[rid]["finish_reason"], entries[rid]["clipped"])
            for rid in SCORED} == {rid: (tokens[rid], reasons[rid], reasons[rid] == "length") for rid in SCORED}
    assert [reasons[rid] for rid in SCORED] == ["stop", "length", "stop", "length", "stop"]
    assert {rid: (entries[rid]["status"], entries[rid]["reward"]) for rid in FAILED} == {
        "r-broken": ("ERROR", None), "r-500": ("ERROR", None)}
    scores = ran["out"]["openai"]["scores"]
    [stats] = ran["stats"]
    lengths = [tokens[rid] for rid in SCORED]
    assert stats == (5, 7, 2, 2, 0.4, sum(lengths) / 5, min(lengths), max(lengths),
                     pytest.approx(sum(scores[rid] for rid in SCORED) / 5))


def test_langchain_tools_and_dashscope_as_the_servers_saw_them(ran: dict[str, Any]) -> None:
    lc = ran["spans"]["langchain"]
    replies = {reply["id"]: reply for _, reply in ran["lc_fake"].replies}
    assert [r["kind"] for r in lc] == ["LLM"] * len(ran["lc_fake"].requests) == ["LLM"] * 7
    for span in lc:
        reply = replies[span["attributes"]["gen_ai.response.id"]]
        assert span["attributes"]["gen_ai.usage.output_tokens"] == str(reply["usage"]["completion_tokens"])
        assert json.loads(span["attributes"]["gen_ai.output.messages"]) == [reply["choices"][0]["message"]]
    tools = ran["spans"]["tools"]
    providers = sorted((r["name"], r["attributes"].get("rlpulse.tool.provider"), r["status"]) for r in tools
                       if r["kind"] == "TOOL")
    assert ("add", "mcp", "OK") in providers and ("fail", "mcp", "ERROR") in providers
    assert ("broken", "langchain", "ERROR") in providers and ("score", "my-plugin", "OK") in providers
    assert len(providers) == 16
    [ask] = [r for r in tools if r["kind"] == "TOOL" and r["name"] == "ask"]
    [asked] = [r for r in tools if r["kind"] == "LLM"]
    assert asked["parent_span_id"] == ask["span_id"] and len(ran["tools_fake"].requests) == 1
    ds = [r for r in ran["spans"]["dashscope"] if r["kind"] == "LLM"]
    assert len(ds) == len(ran["ds"].requests) + 1  # and the call whose connection was refused
    ids = {r["attributes"].get("gen_ai.response.id") for r in ds} - {None}
    sent = {body.get("request_id") for _, reply in ran["ds"].replies for body in (reply if isinstance(reply, list) else [reply])
            if isinstance(body, dict)}
    assert ids == sent - {None} and len(ids) == len(ran["ds"].requests)
