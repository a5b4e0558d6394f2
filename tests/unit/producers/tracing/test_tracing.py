"""Traced LLM and tool calls (``rlpulse.producers.tracing``) with the real ``openai`` client against an
OpenAI-compatible server on loopback (``tests.openai_server``), through the SDK into an
``InMemoryTransport``: the exact span tree, GenAI attributes, errors, content on and off and its cap,
the API key kept out, metrics and their limits, async nesting, bindings."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest

from rlpulse.producers import InMemoryTransport, TrainingTelemetry
from rlpulse.producers.tracing import content as tc
from rlpulse.producers.sdk.records import span_id as rollout_span_id
from rlpulse.producers.tracing import (MAX_METRIC_NAMES, Tracer, bind_rollout, content_from_env, observe_llm,
                                       observe_processor, observe_tool, reward_metrics, rollout_metrics, set_reward,
                                       trace_client)
from rlpulse.base.env import TRACE_CONTENT
from tests.openai_server import ECHO_KEY, TOOL_ARGUMENTS, FakeOpenAI
from tests.traced_agent import API_KEY, SYSTEM, TOOLS, Agent, AsyncAgent, Task

openai = pytest.importorskip("openai")
CONTENT_KEYS = ("gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.tool.definitions",
                "gen_ai.tool.call.arguments", "gen_ai.tool.call.result")
TASKS = [Task(step=3, rollout_id="r-0", sample_id="s-a", question="what is 6*7?"),
         Task(step=3, rollout_id="r-1", sample_id="s-a", question="and 6*7 again?")]


def traced(fn: Any, content: bool | None = False, **tracer: Any) -> tuple[list[dict[str, Any]], Tracer, InMemoryTransport]:
    """Runs ``fn()`` under a Tracer on a fresh telemetry; its spans as decoded records, in publish order."""
    transport = InMemoryTransport()
    with TrainingTelemetry(project="p", run_id="run", transport=transport) as tel, Tracer(tel, content=content, **tracer) as t:
        fn()
    records = sorted(transport.records("spans"), key=lambda r: r["writer_sequence"])
    return records, t, transport


def tree(records: list[dict[str, Any]]) -> list[tuple]:
    """(kind, name, parent's name, status, status message) per span, in the records' order."""
    names = {r["span_id"]: f'{r["name"]}[{r["rollout_id"]}]' for r in records}
    return [(r["kind"], r["name"], names.get(r["parent_span_id"], r["parent_span_id"]), r["status"], r["status_message"])
            for r in records]


def run_tasks(fake: FakeOpenAI, tasks: list[Task]) -> None:
    agent = Agent(fake.base_url)
    for task in tasks:
        try:
            agent.rollout(task)
        except openai.APIStatusError:
            pass  # the failing task's error reached the caller; its spans say ERROR


def test_the_span_tree_of_rollouts_with_a_tool_call_a_reward_and_an_http_error() -> None:
    failing = [Task(step=4, rollout_id="r-500", sample_id="s-b", question="q", model="fail-500"),
               Task(step=4, rollout_id="r-400", sample_id="s-b", question="q", model="bad-400")]
    with FakeOpenAI() as fake:
        records, tracer, _ = traced(lambda: run_tasks(fake, TASKS + failing))
    ok = [("LLM", "chat policy-7b", "Agent.rollout[{r}]", "OK", ""), ("TOOL", "calculator", "Agent.rollout[{r}]", "OK", ""),
          ("LLM", "chat policy-7b", "Agent.rollout[{r}]", "OK", ""), ("REWARD", "Agent.reward", "Agent.rollout[{r}]", "OK", ""),
          ("ROLLOUT", "Agent.rollout", None, "OK", "")]
    expected = [(k, n, p and p.format(r=t.rollout_id), s, m) for t in TASKS for k, n, p, s, m in ok]
    expected += [("LLM", "chat fail-500", "Agent.rollout[r-500]", "ERROR", "InternalServerError"),
                 ("ROLLOUT", "Agent.rollout", None, "ERROR", "InternalServerError"),
                 ("LLM", "chat bad-400", "Agent.rollout[r-400]", "ERROR", "BadRequestError"),
                 ("ROLLOUT", "Agent.rollout", None, "ERROR", "BadRequestError")]
    assert tree(records) == expected  # published as each ends: children before their entry
    assert [r["writer_sequence"] for r in records] == list(range(1, len(records) + 1))  # the writer's publish order
    # sequence_id is start order: each entry before its calls, the calls as they were made
    started = [(k, n) for t in TASKS for k, n, *_ in (ok[-1], *ok[:-1])]
    started += [("ROLLOUT", "Agent.rollout"), ("LLM", "chat fail-500"), ("ROLLOUT", "Agent.rollout"), ("LLM", "chat bad-400")]
    assert [(r["kind"], r["name"]) for r in sorted(records, key=lambda r: r["sequence_id"])] == started
    assert (tracer.published, tracer.refused) == (len(records), 0)
    for task in TASKS + failing:
        spans = [r for r in records if r["rollout_id"] == task.rollout_id]
        assert {(r["trace_id"], r["step"]) for r in spans} == {(spans[-1]["trace_id"], task.step)}
        assert spans[-1]["span_id"] == rollout_span_id(f"run/1/{task.rollout_id}/rollout")  # tel.rollout's own ids


def test_llm_spans_name_the_model_tokens_finish_reason_tool_calls_and_server() -> None:
    with FakeOpenAI() as fake:
        records, _, _ = traced(lambda: run_tasks(fake, TASKS[:1]))
    llm = [r for r in records if r["kind"] == "LLM"]
    replies = [body for _, body in fake.replies]
    for span, reply in zip(llm, replies):
        a = span["attributes"]
        assert (a["gen_ai.request.model"], a["gen_ai.response.model"], a["gen_ai.response.id"]) == (
            "policy-7b", "policy-7b-served", reply["id"])
        assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
            reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"])
        assert (a["gen_ai.provider.name"], a["server.address"], a["gen_ai.request.max_tokens"]) == ("openai", "127.0.0.1", 256)
        assert span["end_time_ns"] >= span["start_time_ns"]  # the latency
        assert not set(CONTENT_KEYS) & set(a)  # content is off unless turned on
    assert (llm[0]["attributes"]["gen_ai.response.finish_reasons"], llm[0]["attributes"]["rlpulse.tool_calls"],
            llm[0]["attributes"]["rlpulse.tool_call_names"]) == ("tool_calls", 1, "calculator")
    assert llm[1]["attributes"]["gen_ai.response.finish_reasons"] == "stop" and "rlpulse.tool_calls" not in llm[1]["attributes"]
    rollout, reward = records[-1], records[-2]
    assert (rollout["reward"], rollout["sample_id"], rollout["finish_reason"], rollout["clipped"]) == (1.0, "s-a", "stop", False)
    assert rollout["completion_tokens"] == sum(r["usage"]["completion_tokens"] for r in replies)
    assert rollout["metrics"] == {"turns": 2.0, "tool_calls": 1.0}
    assert (reward["reward"], reward["metrics"]) == (1.0, {"exact": 1.0, "length": float(len(replies[-1]["choices"][0]
                                                                                              ["message"]["content"]))})


def test_content_when_turned_on_is_what_was_sent_and_received_and_the_key_never_appears(caplog) -> None:
    caplog.set_level(logging.DEBUG)
    echo = Task(step=0, rollout_id="r-echo", sample_id="s", question=f"{ECHO_KEY}, then 6*7")
    with FakeOpenAI() as fake:
        records, _, transport = traced(lambda: run_tasks(fake, [TASKS[0], echo]), content=True)
    assert set(fake.tokens) == {API_KEY}  # the server did get the key...
    assert all(API_KEY.encode() not in value for value in transport.values())  # ...no span carries it
    assert API_KEY not in caplog.text
    llm = [r["attributes"] for r in records if r["kind"] == "LLM"]
    for attrs, sent, (_, reply) in zip(llm, fake.requests, fake.replies):
        assert json.loads(attrs["gen_ai.input.messages"]) == sent["messages"]
        assert json.loads(attrs["gen_ai.tool.definitions"]) == TOOLS
        output = json.loads(attrs["gen_ai.output.messages"])
        if API_KEY in json.dumps(reply):
            assert output[0]["content"] == reply["choices"][0]["message"]["content"].replace(API_KEY, "***")
        else:
            assert output == [reply["choices"][0]["message"]]
    tool = next(r["attributes"] for r in records if r["kind"] == "TOOL")
    assert (json.loads(tool["gen_ai.tool.call.arguments"]), json.loads(tool["gen_ai.tool.call.result"])) == (
        json.loads(TOOL_ARGUMENTS), "42")


def test_content_over_the_cap_is_cut_marked_and_counted_and_stays_json() -> None:
    long = Task(step=0, rollout_id="r-long", sample_id="s", question="x" * 5000)
    with FakeOpenAI() as fake:
        records, tracer, _ = traced(lambda: run_tasks(fake, [long]), content=True, content_limit=1024)
    first = records[0]["attributes"]
    kept = json.loads(first["gen_ai.input.messages"])  # still JSON
    assert len(first["gen_ai.input.messages"]) <= 1024
    assert kept[0] == {"role": "system", "content": SYSTEM}  # short strings are kept whole
    question = kept[1]["content"]
    cut = 5000 - question.index("…")
    assert question == "x" * (5000 - cut) + f"…[rlpulse: {cut} characters cut]"
    assert first[tc.CUT_CHARS] >= cut  # the tool definitions fit; the whole span's cut characters
    assert tracer.content_cut == sum(1 for r in records if tc.CUT_CHARS in r["attributes"]) >= 1


def test_the_cap_falls_back_to_cutting_text_when_structure_alone_is_too_large() -> None:
    text, cut = tc.capped_json([{"role": "user", "content": ""}] * 100, 300)
    assert len(text) <= 300 and text.endswith(" characters cut]") and cut == len(json.dumps(
        [{"role": "user", "content": ""}] * 100, separators=(",", ":"))) - text.index("…")
    assert tc.capped_json({"a": "b"}, 300) == ('{"a":"b"}', 0)


def test_async_client_and_concurrent_rollouts_keep_their_own_trees() -> None:
    tasks = [Task(step=1, rollout_id=f"a-{i}", sample_id="s", question=f"6*7 ({i})?") for i in range(3)]

    async def run(agent: AsyncAgent) -> None:
        await asyncio.gather(*(agent.run(t) for t in tasks))

    with FakeOpenAI() as fake:
        records, _, _ = traced(lambda: asyncio.run(run(AsyncAgent(fake.base_url))))
    for task in tasks:
        mine = [r for r in records if r["rollout_id"] == task.rollout_id]
        assert [r["kind"] for r in mine] == ["LLM", "TOOL", "LLM", "ROLLOUT"]
        assert {r["parent_span_id"] for r in mine[:-1]} == {mine[-1]["span_id"]}
        assert (mine[-1]["reward"], mine[-1]["name"]) == (1.0, "AsyncAgent.run")


def test_metrics_follow_the_seeds_cardinality_advice() -> None:
    @observe_processor
    def rollout(*, step: int, rollout_id: str, metrics: dict[str, Any]) -> None:
        rollout_metrics(metrics)

    def calls() -> None:
        with pytest.raises(ValueError, match=r"rollout_metrics has 11 keys; at most 10"):
            rollout(step=0, rollout_id="a", metrics={f"m{i}": 1.0 for i in range(11)})
        with pytest.raises(ValueError, match=r"rollout_metrics\['ok'\] must be a float"):
            rollout(step=0, rollout_id="b", metrics={"ok": "yes"})
        with pytest.raises(ValueError, match=r"rollout_metrics\['x'\] must be a finite number"):
            rollout(step=0, rollout_id="c", metrics={"x": float("nan")})
        for i in range(MAX_METRIC_NAMES):
            rollout(step=0, rollout_id=f"d{i}", metrics={f"user_{i}": 1.0})  # ids as names: the 11th is refused
        with pytest.raises(ValueError, match=r"rollout_metrics name 'user_10' would be distinct name number 11"):
            rollout(step=0, rollout_id="e", metrics={"user_3": 0.5, "user_10": 1.0})
        rollout(step=0, rollout_id="f", metrics={"user_3": 2})  # a known name, an int: fine
        with pytest.raises(ValueError, match="inside a ROLLOUT entry"):
            rollout_metrics({"x": 1.0})
        with pytest.raises(ValueError, match="main score goes to set_reward"):
            observe_processor(kind="REWARD")(lambda rollout_id: reward_metrics({"reward_score": 1.0}))(rollout_id="g")

    records, _, _ = traced(calls)
    by_id = {r["rollout_id"]: r for r in records}
    assert by_id["f"]["metrics"] == {"user_3": 2.0} and by_id["a"]["metrics"] == {}  # a refused dict left nothing
    assert by_id["a"]["status"] == "ERROR" and by_id["a"]["status_message"] == "ValueError"


def test_bound_rollouts_generated_ids_observe_llm_and_entries_inferred_from_their_arguments() -> None:
    @observe_llm(name="local-model")
    def generate(*, model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
        return {"model": model, "usage": {"prompt_tokens": 3, "completion_tokens": 4},
                "choices": [{"finish_reason": "length", "message": {"role": "assistant", "content": "…"}}]}

    @observe_processor
    def run(task: dict[str, Any]) -> None:
        generate(model="m", messages=[{"role": "user", "content": task["q"]}])

    def calls() -> None:
        with bind_rollout(step=7, rollout_id="bound"):
            generate(model="m", messages=[])  # no entry: under the rollout tel.rollout publishes
        run({"q": "hi", "step": 2, "rollout_id": "from-input", "sample_id": "s"})
        run({"q": "no id"})

    records, _, _ = traced(calls)
    bound, child, entry, child2, entry2 = records
    assert (bound["parent_span_id"], bound["rollout_id"], bound["step"]) == (rollout_span_id("run/1/bound/rollout"), "bound", 7)
    assert (entry["kind"], entry["step"], entry["rollout_id"], entry["sample_id"]) == ("ROLLOUT", 2, "from-input", "s")
    assert (entry["finish_reason"], entry["clipped"], entry["completion_tokens"]) == ("length", True, 4)
    assert child["parent_span_id"] == entry["span_id"] and child2["parent_span_id"] == entry2["span_id"]
    assert entry2["attributes"]["rlpulse.rollout_id_generated"] is True and len(entry2["rollout_id"]) == 16


def test_untraced_without_a_tracer_and_wrapping_is_idempotent(caplog, monkeypatch) -> None:
    from rlpulse.producers.tracing import spans as tracing_spans
    monkeypatch.setattr(tracing_spans, "_warned", [False])  # warned once per process: whichever test ran first

    @observe_tool
    def tool(x: int) -> int:
        return x + 1

    assert tool(1) == 2  # no tracer installed: the call runs, once warned
    assert "no Tracer installed" in caplog.text
    with FakeOpenAI() as fake:
        client = openai.OpenAI(base_url=fake.base_url, api_key=API_KEY, max_retries=0)
        assert trace_client(trace_client(client)) is client

        def call() -> None:
            with bind_rollout(rollout_id="x"):
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        records, _, _ = traced(call)
    assert [r["name"] for r in records] == ["chat m"]
    with pytest.raises(ValueError, match="trace_client takes an openai"):
        trace_client(object())


def test_content_switch_from_the_environment() -> None:
    assert content_from_env({}) is False
    assert content_from_env({TRACE_CONTENT: "1"}) is True and content_from_env({TRACE_CONTENT: "off"}) is False
    with pytest.raises(ValueError, match=TRACE_CONTENT):
        content_from_env({TRACE_CONTENT: "maybe"})
    with pytest.raises(ValueError, match="content_limit"):
        Tracer(TrainingTelemetry(project="p", run_id="r", transport=InMemoryTransport()), content_limit=10**6)


def test_set_reward_outside_an_entry_names_what_is_missing() -> None:
    with pytest.raises(ValueError, match="set_reward must be called inside an entry"):
        set_reward(1.0)


def test_the_demos_simulated_traced_agent() -> None:
    from rlpulse.producers.simulators.tracing_sim import simulate_traced_agent
    from rlpulse.base.settings import Settings

    transport = InMemoryTransport()
    truth = simulate_traced_agent(Settings.load(), run_id="sim-traced", steps=2, rollouts_per_step=4, seed=3,
                                  transport=transport)
    records = sorted(transport.records("spans"), key=lambda r: r["sequence_id"])
    assert (truth.spans, truth.undelivered, len(records)) == (len(records), 0, len(records))
    assert len(truth.rollouts) == 8 and truth.rollouts[truth.failed] is None
    entries = {r["rollout_id"]: r for r in records if r["kind"] == "ROLLOUT"}
    assert {k: r["reward"] for k, r in entries.items()} == truth.rollouts
    assert (entries[truth.failed]["status"], entries[truth.failed]["status_message"]) == ("ERROR", "SimulatedAPIError")
    example = [(r["kind"], r["name"]) for r in records if r["rollout_id"] == truth.example]
    assert example == [("ROLLOUT", "SimulatedAgent.rollout"), ("LLM", "chat sim-policy"), ("TOOL", "calculator"),
                       ("LLM", "chat sim-policy"), ("REWARD", "SimulatedAgent.reward")]  # in start order
    assert all(r["end_time_ns"] <= time.time_ns() for r in records)  # simulated latencies, never ahead of the clock
    assert sum(1 for r in records if r["kind"] == "LLM") == truth.llm_calls


def test_an_async_telemetry_traces_too() -> None:
    from rlpulse.producers import AsyncTrainingTelemetry

    @observe_processor
    async def rollout(*, step: int, rollout_id: str) -> None:
        set_reward(0.5)

    async def run(transport: InMemoryTransport) -> None:
        async with AsyncTrainingTelemetry(project="p", run_id="run", transport=transport) as tel:
            with Tracer(tel):
                await rollout(step=1, rollout_id="x")

    transport = InMemoryTransport()
    asyncio.run(run(transport))
    [span] = transport.records("spans")
    assert (span["kind"], span["rollout_id"], span["reward"], span["step"]) == ("ROLLOUT", "x", 0.5, 1)


def test_what_tracing_cannot_record_never_reaches_the_traced_call(caplog) -> None:
    class Odd:
        choices = 7  # not a list of choices
        usage = None

    @observe_llm
    def odd(*, model: str, messages: list[Any]) -> Any:
        return Odd()

    @observe_processor(kind="REWARD")
    def nan_score(*, rollout_id: str) -> float:
        return float("nan")

    def calls() -> None:
        with bind_rollout(rollout_id="x"):
            assert isinstance(odd(model="m", messages=[]), Odd)
            assert nan_score(rollout_id="x") != 0.0  # NaN comes back as it was; the span has no reward
            assert observe_tool(name="n" * 300)(lambda: 1)() == 1  # a name over the limit: published cut

    records, tracer, _ = traced(calls)
    assert (tracer.refused, [r["kind"] for r in records]) == (1, ["REWARD", "TOOL"])
    assert records[0]["reward"] is None and len(records[1]["name"]) == 256
    assert "traced span 'odd' not published" in caplog.text


@pytest.mark.full
def test_server_address_is_left_out_when_a_password_could_be_read_as_the_host() -> None:
    # urlsplit reads http://alice:s3cr/et@host as host "alice", port "s3cr": neither reaches a span.
    from types import SimpleNamespace

    from rlpulse.producers.tracing import dashscope_client, openai_client

    assert dashscope_client._server({"base_address": "http://alice:s3cr/et@host/api"}) == {}
    assert dashscope_client._server({"base_address": "https://dashscope.example/api/v1"}) == {
        "server.address": "dashscope.example", "server.port": 443}
    leaky = SimpleNamespace(_client=SimpleNamespace(api_key=None, base_url="http://alice:s3cr/et@host/v1"))
    assert openai_client._server(leaky) == {}
