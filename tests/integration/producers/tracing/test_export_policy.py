"""``rlpulse export`` gives training data of the policy, not of its judge (issue 29), checked against what the
server saw: a traced agent (the real ``openai`` client against ``tests.openai_server``, token ids and
logprobs asked for and returned as vLLM does) makes three policy calls (a tool call, a reply, a reply
after a follow-up), emits an intermediate reward after the second, and is scored by a REWARD entry
that calls a judge. Its spans go into the store through the sink's own INSERT.

* Triplets are exactly the three policy calls, prompts and replies as sent and received, with the
  token ids and logprobs the server returned; ``--include-grader-calls`` adds the judge's call, marked.
* ``--reward-to`` gives the documented rewards; ``messages`` is the policy's conversation;
  ``--per-call`` one conversation per call.
* A call whose usage disagrees with its ids exports no ids and says ``mismatch``.
* The Parquet file loads with Hugging Face ``datasets.load_dataset("parquet", ...)`` (in the agent venv:
  ``datasets`` needs a click faust refuses), token ids as lists of ints.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlpulse.producers import InMemoryTransport, TrainingTelemetry
from rlpulse.producers.tracing import Tracer, emit_reward, observe_processor, trace_client
from rlpulse.sinks.store.clickhouse import migrate, open_reader, open_store
from rlpulse.sinks.read.queries import run_query, saved_sql
from rlpulse.sinks.views import trajectories
from rlpulse.sinks.views.export import Shape, export
from rlpulse.sinks.views.rewards import find_final_reward, find_reward_spans, reward_spans
from tests.openai_server import FakeOpenAI
from tests.traced_agent import API_KEY, TOOLS, load_spans

pytestmark = [pytest.mark.integration, pytest.mark.full]
openai = pytest.importorskip("openai")
pq = pytest.importorskip("pyarrow.parquet")

JUDGE = [{"role": "system", "content": "You grade answers. Reply with a score."}]
INTERMEDIATE, FINAL = 0.25, 0.75


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two rollouts of one run: 'r-ok' (ids consistent) and 'r-bad' (its second call's usage disagrees)."""
    url = f"chdb://{tmp_path_factory.mktemp('policy') / 'ch'}"
    with FakeOpenAI() as fake:
        client = trace_client(openai.OpenAI(base_url=fake.base_url, api_key=API_KEY, max_retries=0))

        @observe_processor(kind="REWARD")
        def score(answer: str) -> float:
            client.chat.completions.create(model="judge", messages=[*JUDGE, {"role": "user", "content": answer}])
            return FINAL

        @observe_processor
        def episode(*, step: int, rollout_id: str, sample_id: str, model: str) -> None:
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"{rollout_id}: what is 6*7?"}]
            first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            call = first.choices[0].message.tool_calls[0]
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "42"}]
            second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
            emit_reward(INTERMEDIATE)  # shaping: the tool was used
            messages += [{"role": "assistant", "content": second.choices[0].message.content},
                         {"role": "user", "content": "are you sure?"}]
            third = client.chat.completions.create(model="policy", messages=messages)
            score(third.choices[0].message.content)

        transport = InMemoryTransport()
        with TrainingTelemetry(project="pol", run_id="run-1", transport=transport) as tel, \
                Tracer(tel, content=True, token_ids=True, request_token_ids=True):
            episode(step=1, rollout_id="r-ok", sample_id="s-0", model="policy")
            episode(step=1, rollout_id="r-bad", sample_id="s-0", model="ids-mismatch")
        requests, replies = fake.requests, fake.replies
    with open_store(url, owner="test") as store:
        migrate(store)
        load_spans(store, transport.values("spans"))
    return {"url": url, "requests": requests, "replies": replies}


def rows(traced: dict[str, Any], what: str = "triplets", **shape: Any) -> list[dict[str, Any]]:
    out = io.BytesIO()
    with open_reader(traced["url"], owner="test") as store:
        export(store, what, out, "jsonl", shape=Shape(**shape))
    return [json.loads(line) for line in out.getvalue().decode().splitlines()]


def calls(traced: dict[str, Any], rollout: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(request, reply) of each call the server saw for ``rollout``, in order: 3 policy calls, then the judge
    (the rollouts ran one after the other: r-ok's four calls, then r-bad's)."""
    first = {"r-ok": 0, "r-bad": 4}[rollout]
    return [(q, a) for q, (_, a) in zip(traced["requests"], traced["replies"])][first:first + 4]


def test_triplets_are_the_policys_calls_with_what_the_server_said(traced: dict[str, Any]) -> None:
    got = [r for r in rows(traced) if r["rollout_id"] == "r-ok"]
    seen = calls(traced, "r-ok")
    assert [q["model"] for q, _ in seen] == ["policy", "policy", "policy", "judge"]
    assert [(r["turn"], r["final"], r["grader_call"]) for r in got] == [(0, False, False), (1, False, False), (2, True, False)]
    for row, (request, reply) in zip(got, seen[:3]):
        assert row["prompt"] == request["messages"]
        assert row["response"] == reply["choices"][0]["message"]  # the assistant message, tool calls and all
        assert (row["input_tokens"], row["output_tokens"]) == (reply["usage"]["prompt_tokens"],
                                                               reply["usage"]["completion_tokens"])
        assert row["token_ids"] == "ok"
        assert (row["response_id"], row["finish_reason"]) == (reply["id"], reply["choices"][0]["finish_reason"])
        assert row["prompt_ids"] == reply["prompt_token_ids"]
        assert row["response_ids"] == reply["choices"][0]["token_ids"]
        assert row["response_logprobs"] == [x["logprob"] for x in reply["choices"][0]["logprobs"]["content"]]
    assert got[0]["response"]["tool_calls"][0]["function"]["arguments"] == '{"expression": "6*7"}'
    assert not any("grade answers" in json.dumps(r["prompt"]) for r in rows(traced))


def test_grader_calls_come_back_marked_and_unrewarded_when_asked_for(traced: dict[str, Any]) -> None:
    got = [r for r in rows(traced, include_grader_calls=True) if r["rollout_id"] == "r-ok"]
    judge_request = calls(traced, "r-ok")[3][0]
    assert [(r["turn"], r["grader_call"], r["reward"]) for r in got] == [
        (0, False, None), (1, False, INTERMEDIATE), (2, False, FINAL), (3, True, None)]
    assert got[3]["prompt"] == judge_request["messages"]
    assert [r["final"] for r in got] == [False, False, True, False]  # final: the policy's last call, not the judge's


@pytest.mark.parametrize("reward_to,want", [
    ("last-call", [None, INTERMEDIATE, FINAL]),  # each reward to the last policy call before it (agent-lightning)
    ("final", [None, None, FINAL]),
    ("every-call", [FINAL, FINAL, FINAL]),
])
def test_reward_to_places_the_rewards(traced: dict[str, Any], reward_to: str, want: list[float | None]) -> None:
    got = [r for r in rows(traced, reward_to=reward_to) if r["rollout_id"] == "r-ok"]
    assert [r["reward"] for r in got] == want
    assert {r["trajectory_reward"] for r in got} == {FINAL}


def test_messages_are_the_policys_conversation(traced: dict[str, Any]) -> None:
    got = {r["rollout_id"]: r for r in rows(traced, "messages")}
    last_request, last_reply = calls(traced, "r-ok")[2]
    assert got["r-ok"]["messages"] == [*last_request["messages"], last_reply["choices"][0]["message"]]
    assert (got["r-ok"]["reward"], got["r-ok"]["calls"]) == (FINAL, 3)
    assert got["r-ok"]["tools"] == TOOLS  # the latest policy call that offered tools (the last one offered none)
    per_call = [r for r in rows(traced, "messages", per_call=True) if r["rollout_id"] == "r-ok"]
    assert [(r["turn"], r["reward"]) for r in per_call] == [(0, None), (1, INTERMEDIATE), (2, FINAL)]
    for row, (request, reply) in zip(per_call, calls(traced, "r-ok")[:3]):
        assert row["messages"] == [*request["messages"], reply["choices"][0]["message"]]
    assert per_call[0]["tools"] == TOOLS and per_call[0]["messages"][-1]["tool_calls"][0]["function"]["name"] == "calculator"


def test_ids_that_disagree_with_the_usage_are_not_exported(traced: dict[str, Any]) -> None:
    got = [r for r in rows(traced) if r["rollout_id"] == "r-bad"]
    assert [r["token_ids"] for r in got] == ["ok", "mismatch", "ok"]
    assert (got[1]["prompt_ids"], got[1]["response_ids"], got[1]["response_logprobs"]) == (None, None, None)
    assert got[1]["input_tokens"] == len(calls(traced, "r-bad")[1][1]["prompt_token_ids"]) + 1


def test_the_parquet_loads_with_hugging_face_datasets(traced: dict[str, Any], agent_python: Path, tmp_path: Path) -> None:
    path = tmp_path / "triplets.parquet"
    with open_reader(traced["url"], owner="test") as store, path.open("wb") as out:
        export(store, "triplets", out, "parquet")
    loader = ("import datasets, json, sys; d = datasets.load_dataset('parquet', data_files=sys.argv[1], split='train'); "
              "print(json.dumps({'features': {k: str(v) for k, v in d.features.items()}, 'rows': d.to_list()}))")
    done = subprocess.run([str(agent_python), "-c", loader, str(path)], capture_output=True, text=True, timeout=300,
                          env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert loaded["features"]["prompt_ids"] == "List(Value('int64'))", loaded["features"]
    assert loaded["features"]["response_logprobs"] == "List(Value('float64'))", loaded["features"]
    want = rows(traced)
    assert [(r["rollout_id"], r["turn"], r["prompt_ids"] or None, r["response_ids"] or None, r["reward"])
            for r in loaded["rows"]] == [(r["rollout_id"], r["turn"], r["prompt_ids"], r["response_ids"], r["reward"])
                                         for r in want]
    assert [json.loads(r["prompt"]) for r in loaded["rows"]] == [r["prompt"] for r in want]


def test_every_reward_and_the_final_one_in_sql_and_in_python(traced: dict[str, Any]) -> None:
    with open_reader(traced["url"], owner="test") as store:
        found = reward_spans(store, "run-1", 1, "r-ok")  # the saved query reward-spans
        chosen = trajectories.select(store, "run-1", 1, step=1, sample="s-0")
    with open_reader(traced["url"], owner="test") as store:  # run_query leaves its client read-only
        params = {"run_id": "run-1", "attempt": "1"}
        columns, table = run_query(store.client, saved_sql("final-rewards", params, store.database), params)
    # start order: the ROLLOUT entry opened first, the intermediate reward after two calls, the REWARD entry last
    assert [(r.source, r.value, r.final) for r in found] == [
        ("rollout", FINAL, False), ("annotation", INTERMEDIATE, False), ("reward_entry", FINAL, False)]
    assert find_final_reward(found) == FINAL
    finals = {row[columns.index("rollout_id")]: row for row in table}
    assert sorted(finals) == ["r-bad", "r-ok"]
    assert [finals["r-ok"][columns.index(c)] for c in ("final_reward", "source", "intermediate_rewards")] == \
        [FINAL, "rollout", 1]
    spans = {t.key: t for t in chosen.trajectories}
    tree = spans["r-ok"].tree
    flat, stack = [], list(tree.roots)
    while stack:
        s = stack.pop()
        flat.append(s)
        stack.extend(s.children)
    assert [(r.source, r.value) for r in find_reward_spans(flat)] == [(r.source, r.value) for r in found]
    assert find_final_reward(flat) == FINAL


def test_the_trajectory_page_shows_the_policys_dialogue_and_its_rewards(traced: dict[str, Any]) -> None:
    from rlpulse.sinks.views.ui_detail import trajectory_page

    with open_reader(traced["url"], owner="test") as store:
        body, step, sample = trajectory_page(store, "pol", "run-1", 1, "r-ok")
    dialogue = body[body.index("<h2>Dialogue</h2>"):body.index("<h2>Tool calls</h2>")]
    assert "are you sure?" in dialogue and "answer: are you sure?" in dialogue  # the policy's last call and reply
    assert "grade answers" not in dialogue  # the judge's prompt is no turn of the policy
    assert "1 call(s) made by the reward function" in dialogue
    assert dialogue.count('class="reward"') == 3 and dialogue.count("data-final") == 1
    assert 'data-source="annotation"' in dialogue and (step, sample) == (1, "s-0")


def test_the_command_line_takes_the_shape(traced: dict[str, Any]) -> None:
    env = {**os.environ, "RLPULSE_CLICKHOUSE_URL": traced["url"]}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rlpulse.cli", "export", *args], env=env, capture_output=True,
                              text=True, timeout=120)

    done = cli("messages", "-o", "-", "--run", "run-1", "--per-call", "--reward-to", "every-call", "--include-grader-calls")
    assert done.returncode == 0, done.stderr
    got = [json.loads(line) for line in done.stdout.splitlines() if json.loads(line)["rollout_id"] == "r-ok"]
    assert [(r["turn"], r["grader_call"], r["reward"]) for r in got] == [
        (0, False, FINAL), (1, False, FINAL), (2, False, FINAL), (3, True, None)]
    done = cli("triplets", "-o", "-", "--per-call")
    assert (done.returncode, done.stderr.strip().splitlines()[-1]) == (
        2, "rlpulse export: --per-call shapes messages (triplets are one row per call already)"), done.stderr
    done = cli("triplets", "-o", "-", "--reward-to", "first-call")
    assert done.returncode == 2 and "invalid choice: 'first-call'" in done.stderr


def test_a_step_card_previews_the_task_and_the_policys_last_reply(traced: dict[str, Any]) -> None:
    from rlpulse.sinks.views.ui_data import step_rollouts

    with open_reader(traced["url"], owner="test") as store:
        cards = {r.key: r for r in step_rollouts(store, "pol", "run-1", 1, 1)}
    assert (cards["r-ok"].prompt, cards["r-ok"].completion) == ("r-ok: what is 6*7?", "answer: are you sure?")
