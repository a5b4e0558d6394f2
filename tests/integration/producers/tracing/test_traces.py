"""Traced LLM and tool calls end to end: an agent on the real ``openai`` client against an
OpenAI-compatible server on loopback, traced with content on, through the real broker, ``rlpulse
streams`` and ``rlpulse sink`` into ClickHouse. Then the span tree rebuilt from ClickHouse (the saved
query ``span-tree`` through ``rlpulse query``, and ``rlpulse.sinks.views.trajectories``), the streams counting the
traced rollouts, and ``rlpulse export`` (through the sink's read endpoint while it runs, from the
store once it stopped), read back with ``json`` and ``pyarrow``: every triplet is what the job sent.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.producers import TrainingTelemetry
from rlpulse.producers.tracing import Tracer
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.views import trajectories
from rlpulse.sinks.store.clickhouse import open_reader
from tests.integration import until
from tests.openai_server import FakeOpenAI
from tests.traced_agent import API_KEY, TOOLS, Agent, Task

pytestmark = [pytest.mark.integration, pytest.mark.full]  # ~30 s: make test keeps within its 6 minutes
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[4]
RUN = "agent"
TASKS = [Task(step=s, rollout_id=f"r-{s}-{i}", sample_id=f"s-{i % 2}", question=f"step {s}: what is 6*7? ({i})")
         for s in (0, 1) for i in range(2)]
FAILING = Task(step=1, rollout_id="r-fail", sample_id="s-0", question="this one fails", model="fail-500")


def cli(settings: Settings, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlpulse.cli", *args], env={**settings_env(settings), "PYTHONPATH": str(REPO)},
                          cwd=REPO, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def ran(module_settings: Settings) -> dict[str, Any]:
    settings = module_settings
    ensure_topics(settings)
    out = settings.home / "exports"
    out.mkdir()
    with FakeOpenAI() as fake, Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        with TrainingTelemetry(project="traces", run_id=RUN, settings=settings) as tel, Tracer(tel, content=True) as tracer:
            agent = Agent(fake.base_url)
            for step in (0, 1):
                for task in (t for t in TASKS + [FAILING] if t.step == step):
                    try:
                        agent.rollout(task)
                    except Exception as exc:  # the failing task: its error reached the job
                        assert task is FAILING and type(exc).__name__ == "InternalServerError"
                tel.step_completed(step)
        assert (tracer.published, tracer.refused) == (4 * 5 + 2, 0)
        pipeline.wait_caught_up(until=until.counts(settings, {
            f"SELECT count() FROM $db.spans FINAL WHERE run_id = '{RUN}'": 22,
            f"SELECT count() FROM $db.step_stats FINAL WHERE run_id = '{RUN}'": 2}))
        live = {  # while the sink holds the store: through its read endpoint
            "tree": cli(settings, "query", "--saved", "span-tree", "--param", f"run_id={RUN}", "--param", "attempt=1",
                        "--param", "rollout_id=r-0-0", "--format", "json"),
            "fail_tree": cli(settings, "query", "--saved", "span-tree", "--param", f"run_id={RUN}", "--param", "attempt=1",
                             "--param", "rollout_id=r-fail", "--format", "json"),
            "calls": cli(settings, "query", "--saved", "trace-calls", "--param", f"run_id={RUN}", "--format", "json"),
            "triplets.jsonl": cli(settings, "export", "triplets", "-o", str(out / "triplets.jsonl"), "--run", RUN),
            "messages.parquet": cli(settings, "export", "messages", "-o", str(out / "messages.parquet"), "--project", "traces"),
        }
        pipeline.stop()
    stopped = {  # the store free again: opened directly, read-only
        "triplets.parquet": cli(settings, "export", "triplets", "-o", str(out / "triplets.parquet")),
        "messages.jsonl": cli(settings, "export", "messages", "-o", str(out / "messages.jsonl"), "--run", RUN),
    }
    for name, done in {**live, **stopped}.items():
        assert done.returncode == 0, (name, done.stderr)
    return {"settings": settings, "out": out, "live": live, "stopped": stopped,
            "requests": fake.requests, "replies": [body for _, body in fake.replies]}


def expected_calls(ran: dict[str, Any]) -> list[dict[str, Any]]:
    """What the job sent and got back, call by call, in the export's order (run, first sequence id, turn)."""
    calls, i = [], 0
    for task in TASKS[:2] + [TASKS[2], TASKS[3], FAILING]:  # the order the job ran them
        turns = 1 if task is FAILING else 2
        for turn in range(turns):
            reply = ran["replies"][i]
            calls.append({"rollout_id": task.rollout_id, "step": task.step, "sample_id": task.sample_id, "turn": turn,
                          "final": turn == turns - 1, "prompt": ran["requests"][i]["messages"],
                          "response": None if task is FAILING else reply["choices"][0]["message"],
                          # --reward-to last-call (the default): the REWARD entry's score on the call before it
                          "reward": None if task is FAILING or turn != turns - 1 else 1.0,
                          "status": "ERROR" if task is FAILING else "OK",
                          "call_status": "ERROR" if task is FAILING else "OK"})
            i += 1
    return calls


def test_the_span_tree_rebuilt_from_clickhouse(ran: dict[str, Any]) -> None:
    tree = [(r["depth"], r["kind"], r["name"], r["status"]) for r in json.loads(ran["live"]["tree"].stdout)]
    assert tree == [(0, "ROLLOUT", "Agent.rollout", "OK"), (1, "LLM", "chat policy-7b", "OK"), (1, "TOOL", "calculator", "OK"),
                    (1, "LLM", "chat policy-7b", "OK"), (1, "REWARD", "Agent.reward", "OK")]  # sequence_id: start order
    failed = [(r["depth"], r["kind"], r["name"], r["status"]) for r in json.loads(ran["live"]["fail_tree"].stdout)]
    assert failed == [(0, "ROLLOUT", "Agent.rollout", "ERROR"), (1, "LLM", "chat fail-500", "ERROR")]
    with open_reader(ran["settings"].clickhouse_dsn, owner="test") as store:
        chosen = trajectories.select(store, RUN, 1, step=0, sample="s-0")
        metrics = dict(store.client.query(f"SELECT kind, metrics FROM {store.database}.spans FINAL "
                                          f"WHERE rollout_id = 'r-0-0' AND kind IN ('ROLLOUT', 'REWARD')").result_rows)
        llm = store.client.query(f"SELECT attributes FROM {store.database}.spans FINAL WHERE rollout_id = 'r-0-0' "
                                 "AND kind = 'LLM' ORDER BY sequence_id").result_rows
    [trajectory] = chosen.trajectories
    [root] = trajectory.tree.roots
    assert (trajectory.key, trajectory.reward, root.kind, trajectory.tree.orphans) == ("r-0-0", 1.0, "ROLLOUT", 0)
    assert [(c.kind, c.name) for c in root.children] == [("LLM", "chat policy-7b"), ("TOOL", "calculator"),
                                                         ("LLM", "chat policy-7b"), ("REWARD", "Agent.reward")]
    assert metrics == {"ROLLOUT": {"turns": 2.0, "tool_calls": 1.0}, "REWARD": {"exact": 1.0, "length": 10.0}}
    first = llm[0][0]
    assert (first["gen_ai.request.model"], first["gen_ai.usage.input_tokens"], first["gen_ai.usage.output_tokens"]) == (
        "policy-7b", str(ran["replies"][0]["usage"]["prompt_tokens"]), str(ran["replies"][0]["usage"]["completion_tokens"]))


def test_the_streams_count_the_traced_rollouts(ran: dict[str, Any]) -> None:
    got = until.query(ran["settings"], f"SELECT step, rollouts, reward_mean FROM $db.step_stats FINAL WHERE run_id = '{RUN}' "
                                       "ORDER BY step")
    assert got == [(0, 2, 1.0), (1, 2, 1.0)]  # the failed rollout has no reward: not a counted rollout


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_parquet(path: Path, json_columns: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = pq.read_table(path).to_pylist()
    return [{k: (json.loads(v) if k in json_columns and v is not None else v) for k, v in row.items()} for row in rows]


def test_every_exported_triplet_is_what_the_job_sent(ran: dict[str, Any]) -> None:
    expected = expected_calls(ran)
    parquet = read_parquet(ran["out"] / "triplets.parquet", ("prompt", "response"))
    for rows in (read_jsonl(ran["out"] / "triplets.jsonl"), parquet):
        keys = ("rollout_id", "step", "sample_id", "turn", "final", "prompt", "response", "reward", "status", "call_status")
        assert [{k: r[k] for k in keys} for r in rows] == expected
        assert {(r["project"], r["run_id"], r["attempt"], r["content_cut"]) for r in rows} == {("traces", RUN, 1, 0)}
        assert [r["output_tokens"] for r in rows] == [x["usage"]["completion_tokens"] if "usage" in x else None
                                                      for x in ran["replies"]]
    assert "rlpulse export: 9 triplets rows of 5 trajectories" in ran["live"]["triplets.jsonl"].stderr
    assert all(API_KEY not in (ran["out"] / f).read_bytes().decode(errors="replace") for f in
               ("triplets.jsonl", "messages.jsonl"))


def test_every_exported_conversation_is_the_chat_the_job_had(ran: dict[str, Any]) -> None:
    calls = expected_calls(ran)
    last = {c["rollout_id"]: c for c in calls}  # each trajectory's last call
    expected = [{"rollout_id": r, "messages": c["prompt"] + [c["response"]] if c["response"] else None,
                 "tools": TOOLS, "reward": c["reward"], "status": c["status"], "calls": c["turn"] + 1}
                for r, c in last.items()]
    for rows in (read_jsonl(ran["out"] / "messages.jsonl"), read_parquet(ran["out"] / "messages.parquet", ("messages", "tools"))):
        assert [{k: r[k] for k in ("rollout_id", "messages", "tools", "reward", "status", "calls")} for r in rows] == expected
    roles = [m["role"] for m in expected[0]["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]


def test_the_saved_query_of_a_runs_calls(ran: dict[str, Any]) -> None:
    got = [(r["step"], r["kind"], r["model_or_tool"], r["calls"], r["errors"], r["input_tokens"], r["output_tokens"],
            r["tool_calls_asked"]) for r in json.loads(ran["live"]["calls"].stdout)]
    usage = [(x["usage"]["prompt_tokens"], x["usage"]["completion_tokens"]) if "usage" in x else (0, 0) for x in ran["replies"]]
    per_step = [usage[:4], usage[4:]]  # two rollouts of two calls at step 0; two and the failed call at step 1
    assert got == [
        (0, "LLM", "policy-7b-served", 4, 0, sum(u[0] for u in per_step[0]), sum(u[1] for u in per_step[0]), 2),
        (0, "TOOL", "calculator", 2, 0, 0, 0, 0),
        (1, "LLM", "fail-500", 1, 1, 0, 0, 0),
        (1, "LLM", "policy-7b-served", 4, 0, sum(u[0] for u in per_step[1]), sum(u[1] for u in per_step[1]), 2),
        (1, "TOOL", "calculator", 2, 0, 0, 0, 0)]
    assert all(r["p90_ms"] >= r["p50_ms"] >= 0 for r in json.loads(ran["live"]["calls"].stdout))
