"""``rlpulse export`` against agent-lightning's own adapters on the same calls (issue 29).

One agent (``tests/agentlightning/policy.py``: three rollouts, each three policy calls — the first answered
with a tool call, the tool run, an intermediate reward after the second call (two for ``r2``) — then a
reward step whose judge call gives the final reward) runs twice in ``.venv-agentlightning`` (agent-lightning 0.3.0 and its
pinned stack, ``tests/agentlightning/al_venv.py``), each time against a fresh ``FakeOpenAI`` that returns
vLLM's token ids and logprobs:

* ``rlpulse_agent.py``: traced by rlpulse (``Tracer(content=True, token_ids=True, request_token_ids=True)``,
  ``trace_client``, ROLLOUT and REWARD entries, ``emit_reward``), published to the real broker, through
  ``rlpulse streams`` and ``rlpulse sink`` into ClickHouse, then ``rlpulse export`` (the CLI) in each shape;
* ``al_agent.py``: traced by agent-lightning's ``AgentOpsTracer`` (``emit_reward``, the judge under an
  ``operation`` named ``agentlightning.reward``), then ``TracerTraceToTriplet()`` and ``TraceToMessages()``
  over its spans.

Both servers must have seen the same requests and given the same replies; then the outputs are compared
field by field. Where they differ by design, an assertion states the difference (each is a row of the
table in ``docs/agentlightning.md``), so a change on either side shows here.

Under ``CI=true`` a venv that cannot be built fails; elsewhere the module skips, saying why.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlpulse.base.settings import Settings
from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.schemas.topics import ensure_topics
from tests.agentlightning import al_venv
from tests.agentlightning.policy import FINAL, INTERMEDIATE, TASKS, TOOLS
from tests.conftest import unavailable
from tests.integration import until
from tests.openai_server import FakeOpenAI

pytestmark = [pytest.mark.integration, pytest.mark.full]
REPO = Path(__file__).resolve().parents[4]
AGENT = REPO / "tests" / "agentlightning"
PROJECT, RUN = "alparity", "al-parity"
ROLLOUTS = [rid for rid, _, _ in TASKS]
CALLS = 4  # per rollout: three policy calls, then the judge's
EXPORTS = {  # name: `rlpulse export` arguments
    "triplets": ("triplets",),
    "triplets final": ("triplets", "--reward-to", "final"),
    "triplets every-call": ("triplets", "--reward-to", "every-call"),
    "triplets graders": ("triplets", "--include-grader-calls"),
    "messages": ("messages",),
    "messages per-call": ("messages", "--per-call"),
    "messages per-call graders": ("messages", "--per-call", "--include-grader-calls"),
}


@pytest.fixture(scope="module")
def al_python() -> Path:
    try:
        return al_venv.ensure(log=lambda line: print(f"agent-lightning venv: {line}"))
    except (al_venv.VenvError, OSError) as exc:
        unavailable(f"the agent-lightning venv {al_venv.VENV} could not be built "
                    f"(`python tests/agentlightning/al_venv.py` builds it): {exc}")


@pytest.fixture(scope="module")
def ran(module_settings: Settings, al_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    settings = module_settings
    ensure_topics(settings)
    cwd = tmp_path_factory.mktemp("agentlightning")  # nothing of the checkout on the agents' path but their folder
    env = {**settings_env(settings), "PYTHONPATH": "", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}

    def agent(script: str, *args: str) -> dict[str, Any]:
        done = subprocess.run([str(al_python), str(AGENT / script), *args], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, (script, done.stderr[-4000:])
        return json.loads(done.stdout.splitlines()[-1])

    def export(*args: str) -> list[dict[str, Any]]:
        out = cwd / "export.jsonl"
        done = subprocess.run([sys.executable, "-m", "rlpulse.cli", "export", *args, "--project", PROJECT, "--run", RUN,
                               "--output", str(out)], env={**settings_env(settings), "PYTHONPATH": str(REPO)}, cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (args, done.stderr[-4000:])
        return [json.loads(line) for line in out.read_text().splitlines()]

    with FakeOpenAI() as rl_fake, FakeOpenAI() as al_fake, Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        rl = agent("rlpulse_agent.py", rl_fake.base_url, PROJECT, RUN)
        al = agent("al_agent.py", al_fake.base_url)
        pipeline.wait_caught_up(until=until.counts(settings, {
            f"SELECT count() FROM $db.spans FINAL WHERE project = '{PROJECT}' AND run_id = '{RUN}'":
                rl["tracer"]["published"]}))
        exports = {name: export(*args) for name, args in EXPORTS.items()}
        pipeline.stop()
    return {"al": al, "rl": rl, "exports": exports, "rl_fake": rl_fake, "al_fake": al_fake}


# -- helpers -------------------------------------------------------------------------------------------
def calls(ran: dict[str, Any], rid: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(request body, reply body) of each call of rollout ``rid``, as the server saw and answered them:
    the rollouts ran one after another, ``CALLS`` calls each, the judge's last."""
    i = ROLLOUTS.index(rid)
    fake = ran["rl_fake"]
    return [(request, reply) for request, (_, reply) in
            zip(fake.requests[CALLS * i:CALLS * (i + 1)], fake.replies[CALLS * i:CALLS * (i + 1)])]


def exported(ran: dict[str, Any], name: str, rid: str) -> list[dict[str, Any]]:
    return [row for row in ran["exports"][name] if row["rollout_id"] == rid]


def al(ran: dict[str, Any], rid: str) -> dict[str, Any]:
    return ran["al"]["rollouts"][rid]


def agentops_prompt(message: dict[str, Any]) -> dict[str, Any]:
    """A request message as agent-lightning's triplet holds it (``prompt.raw_content``): AgentOps records
    ``gen_ai.prompt.<i>.role|content|tool_call_id`` and each tool call as ``tool_calls.<j>.id|name|arguments``
    (``agentops.instrumentation.providers.openai.wrappers.chat``), which the adapter unflattens."""
    out = {k: message[k] for k in ("role", "content", "tool_call_id") if k in message}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                             for c in message["tool_calls"]]
    return out


def trace_to_messages(message: dict[str, Any]) -> dict[str, Any]:
    """A request message as ``TraceToMessages`` rebuilds it: OpenAI's shape again, but an assistant message
    with tool calls always says ``content: None`` (``convert_to_openai_messages`` in
    ``agentlightning.adapter.messages``), whether it had the key or not."""
    if message["role"] == "assistant" and message.get("tool_calls"):
        return {"role": "assistant", "content": None, "tool_calls": message["tool_calls"]}
    return message


# -- the calls ---------------------------------------------------------------------------------------
def test_both_tracers_saw_the_same_calls(ran: dict[str, Any]) -> None:
    rl_fake, al_fake = ran["rl_fake"], ran["al_fake"]
    # the same request bodies (rlpulse's tracer asked for token ids itself; the agent asked for them
    # under agent-lightning) and the same replies, ids included: "the same calls"
    assert rl_fake.requests == al_fake.requests and rl_fake.replies == al_fake.replies
    assert [r["model"] for r in rl_fake.requests] == ["policy", "policy", "policy", "judge"] * len(TASKS)
    assert all(r["return_token_ids"] is True and r["logprobs"] is True for r in rl_fake.requests)
    assert ran["rl"]["finals"] == FINAL and ran["rl"]["tracer"]["refused"] == ran["rl"]["tracer"]["dropped"] == 0
    assert ran["al"]["versions"]["agentlightning"] == "0.3.0"


@pytest.mark.parametrize("rid", ROLLOUTS)
def test_triplets_are_the_policy_calls_in_order_and_the_judge_is_left_out(ran: dict[str, Any], rid: str) -> None:
    policy = [reply for request, reply in calls(ran, rid) if request["model"] == "policy"]
    triplets, rows = al(ran, rid)["triplets"], exported(ran, "triplets", rid)
    # agent-lightning: TracerTraceToTriplet(exclude_llm_call_in_reward=True) skips the judge's call under
    # the agentlightning.reward operation; rlpulse: a call under a REWARD entry is a grader call, left out
    assert [t["metadata"]["response_id"] for t in triplets] == [reply["id"] for reply in policy]
    assert len(rows) == len(policy) == 3
    # rlpulse numbers the turns and marks the last; agent-lightning's order is the list's (no turn, no final)
    assert [(r["turn"], r["final"], r["grader_call"]) for r in rows] == [(0, False, False), (1, False, False),
                                                                          (2, True, False)]
    # the model: agent-lightning keeps the requested one (metadata.request.model) and the served one
    # (metadata.response.model); rlpulse's `model` is the served one
    assert [r["model"] for r in rows] == [t["metadata"]["response"]["model"] for t in triplets] == ["policy-served"] * 3
    assert [t["metadata"]["request"]["model"] for t in triplets] == ["policy"] * 3
    assert [(r["status"], r["call_status"]) for r in rows] == [("OK", "OK")] * 3


@pytest.mark.parametrize("rid", ROLLOUTS)
def test_prompt(ran: dict[str, Any], rid: str) -> None:
    requests = [request for request, _ in calls(ran, rid)][:3]
    triplets, rows = al(ran, rid)["triplets"], exported(ran, "triplets", rid)
    for request, triplet, row in zip(requests, triplets, rows):
        # rlpulse: the chat messages the call sent, exactly
        assert row["prompt"] == request["messages"]
        # agent-lightning: the prompt is token ids plus raw_content, AgentOps's flattened record of the
        # messages: a tool call is {id, name, arguments} (no type, no function object)
        assert triplet["prompt"]["raw_content"] == [agentops_prompt(m) for m in request["messages"]]
        assert triplet["prompt"]["image_urls"] == []
    # so the two agree on plain messages and differ where the prompt holds a tool call
    assert triplets[0]["prompt"]["raw_content"] == rows[0]["prompt"]
    assert triplets[1]["prompt"]["raw_content"] != rows[1]["prompt"]
    assert triplets[1]["prompt"]["raw_content"][2]["tool_calls"] == [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in rows[1]["prompt"][2]["tool_calls"]]


@pytest.mark.parametrize("rid", ROLLOUTS)
def test_response(ran: dict[str, Any], rid: str) -> None:
    replies = [reply["choices"][0] for _, reply in calls(ran, rid)][:3]
    triplets, rows = al(ran, rid)["triplets"], exported(ran, "triplets", rid)
    for choice, triplet, row in zip(replies, triplets, rows):
        # rlpulse: the assistant message that came back, tool calls and all
        assert row["response"] == choice["message"]
        # agent-lightning: raw_content is [{role, finish_reason, content}]; a tool call is not in it
        # (AgentOps makes it a child span, tool_call.<name>, which only TraceToMessages reads)
        message = choice["message"]
        assert triplet["response"]["raw_content"] == [
            {"role": "assistant", "finish_reason": choice["finish_reason"],
             **({"content": message["content"]} if message["content"] is not None else {})}]
    assert "tool_calls" in rows[0]["response"] and "tool_calls" not in triplets[0]["response"]["raw_content"][0]


@pytest.mark.parametrize("rid", ROLLOUTS)
def test_token_ids_and_logprobs(ran: dict[str, Any], rid: str) -> None:
    replies = [reply for _, reply in calls(ran, rid)][:3]
    triplets, rows = al(ran, rid)["triplets"], exported(ran, "triplets", rid)
    for reply, triplet, row in zip(replies, triplets, rows):
        choice = reply["choices"][0]
        # the same ids on both sides, as the server sent them
        assert row["prompt_ids"] == triplet["prompt"]["token_ids"] == reply["prompt_token_ids"]
        assert row["response_ids"] == triplet["response"]["token_ids"] == choice["token_ids"]
        # logprobs: agent-lightning keeps OpenAI's entries ({token, bytes, logprob, top_logprobs}),
        # rlpulse the values, one per response id
        entries = triplet["response"]["logprobs"]
        assert entries == choice["logprobs"]["content"]
        assert row["response_logprobs"] == [e["logprob"] for e in entries]
        assert len(row["response_logprobs"]) == len(row["response_ids"])
        # rlpulse checks the ids against the usage counts (token_ids 'ok'); agent-lightning keeps no usage
        assert (row["token_ids"], row["input_tokens"], row["output_tokens"]) == (
            "ok", reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"])


# -- rewards -----------------------------------------------------------------------------------------
def al_rewards(ran: dict[str, Any], rid: str, which: str = "triplets") -> list[float | None]:
    return [t["reward"] for t in al(ran, rid)[which]]


def rl_rewards(ran: dict[str, Any], name: str, rid: str) -> list[float | None]:
    return [r["reward"] for r in exported(ran, name, rid)]


@pytest.mark.parametrize("rid", ["r0", "r1"])
def test_reward_placement_is_agent_lightnings(ran: dict[str, Any], rid: str) -> None:
    [intermediate] = INTERMEDIATE[rid]
    # each reward to the last policy call before it, the others None: --reward-to last-call, the default
    assert rl_rewards(ran, "triplets", rid) == al_rewards(ran, rid) == [None, intermediate, FINAL[rid]]
    # rlpulse also gives each row the trajectory's reward; agent-lightning has none per triplet (its
    # trainer takes the last non-None reward of the list: AgentModeDaemon in agentlightning.verl.daemon)
    assert [r["trajectory_reward"] for r in exported(ran, "triplets", rid)] == [FINAL[rid]] * 3
    assert next(r for r in reversed(al_rewards(ran, rid)) if r is not None) == FINAL[rid]


def test_two_rewards_after_one_call_are_placed_differently(ran: dict[str, Any]) -> None:
    first, second = INTERMEDIATE["r2"]
    # agent-lightning (RewardMatchPolicy.FIRST_OCCURRENCE): the first reward goes to the 2nd call; the
    # second finds that call taken and goes back to the 1st call, whose tool call it did not follow
    assert al_rewards(ran, "r2") == [second, first, FINAL["r2"]]
    # rlpulse: one reward per call, the later one (the final, else the latest); nothing moves back
    assert rl_rewards(ran, "triplets", "r2") == [None, second, FINAL["r2"]]


@pytest.mark.parametrize("rid", ROLLOUTS)
def test_reward_to_final_and_every_call(ran: dict[str, Any], rid: str) -> None:
    # agent-lightning's adapter has neither: `final` is rlpulse's alone (TraceTree.to_trajectory has a
    # final_reward argument that TracerTraceToTriplet never passes); `every-call` is what agent-lightning's
    # verl trainer does with the trajectory's reward (every transition of a rollout gets it)
    assert rl_rewards(ran, "triplets final", rid) == [None, None, FINAL[rid]]
    assert rl_rewards(ran, "triplets every-call", rid) == [FINAL[rid]] * 3


@pytest.mark.parametrize("rid", ROLLOUTS)
def test_grader_calls_when_asked_for(ran: dict[str, Any], rid: str) -> None:
    requests = [request for request, _ in calls(ran, rid)]
    rows = exported(ran, "triplets graders", rid)
    assert [r["prompt"] for r in rows] == [r["messages"] for r in requests]
    # rlpulse: the judge's call comes back marked, with no reward; the policy's rewards stay where they were
    assert [(r["grader_call"], r["final"], r["model"]) for r in rows] == [
        (False, False, "policy-served")] * 2 + [(False, True, "policy-served"), (True, False, "judge-served")]
    assert rl_rewards(ran, "triplets graders", rid) == rl_rewards(ran, "triplets", rid) + [None]
    # agent-lightning (exclude_llm_call_in_reward=False): the judge's call is a transition like the others,
    # and the final reward, emitted after it, goes to it: the policy's last call loses it
    judged = al(ran, rid)["triplets_with_judge"]
    assert [t["metadata"]["response_id"] for t in judged] == [
        reply["id"] for _, reply in calls(ran, rid)]
    assert al_rewards(ran, rid, "triplets_with_judge")[-2:] == [None, FINAL[rid]]
    assert al_rewards(ran, rid, "triplets_with_judge")[:2] == al_rewards(ran, rid)[:2]


# -- messages ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("rid", ROLLOUTS)
def test_messages_per_call_is_trace_to_messages(ran: dict[str, Any], rid: str) -> None:
    pairs = calls(ran, rid)
    conversations = al(ran, rid)["messages"]
    per_call, graders = exported(ran, "messages per-call", rid), exported(ran, "messages per-call graders", rid)
    # TraceToMessages: one conversation per LLM call, the judge's too (it knows nothing of rewards);
    # rlpulse --per-call: the policy's calls; with --include-grader-calls the judge's as well
    assert len(conversations) == len(graders) == CALLS and len(per_call) == CALLS - 1
    assert [r["messages"] for r in per_call] == [r["messages"] for r in graders[:-1]]
    for (request, reply), conversation, row in zip(pairs, conversations, graders):
        message = reply["choices"][0]["message"]
        # rlpulse: the messages the call sent, as sent, then its reply
        assert row["messages"] == request["messages"] + [message]
        # TraceToMessages: the same, but an assistant tool-call message of the prompt gains "content": None
        assert conversation["messages"] == [trace_to_messages(m) for m in request["messages"]] + [message]
        # the tools the call offered (null when none), on both sides
        assert row["tools"] == conversation["tools"] == request.get("tools")
        # an OpenAIMessages entry is messages and tools only; rlpulse's row also carries the placed reward
        assert set(conversation) == {"messages", "tools"}
    assert conversations[1]["messages"] != graders[1]["messages"]  # that one key
    assert [r["reward"] for r in per_call] == rl_rewards(ran, "triplets", rid)
    assert graders[-1]["grader_call"] and graders[-1]["reward"] is None
    assert [r["tools"] for r in per_call] == [TOOLS, TOOLS, None]


@pytest.mark.parametrize("rid", ROLLOUTS)
def test_messages_of_a_trajectory_is_the_policys_conversation(ran: dict[str, Any], rid: str) -> None:
    [row] = exported(ran, "messages", rid)
    conversations = al(ran, rid)["messages"]
    # rlpulse: the last policy call's messages plus its reply, the final reward; agent-lightning has no
    # per-trajectory conversation, and the last of TraceToMessages' list is the judge's
    assert row["messages"] == exported(ran, "messages per-call", rid)[-1]["messages"]
    assert row["messages"][0]["content"] == conversations[2]["messages"][0]["content"] != conversations[-1]["messages"][0][
        "content"]
    assert conversations[-1]["messages"][0]["role"] == "system" and "grade" in conversations[-1]["messages"][0]["content"]
    # tools: the latest policy call that offered any (the last offered none: TraceToMessages' third entry has None)
    assert (row["reward"], row["tools"], row["calls"]) == (FINAL[rid], conversations[1]["tools"], 3)
    assert conversations[2]["tools"] is None and row["tools"] == TOOLS
