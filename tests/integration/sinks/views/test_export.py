"""``rlpulse export``'s selection and paging on a store written by the sink's own INSERT from a traced run
(the real ``openai`` client, content on, through an InMemoryTransport): each filter selects exactly the
trajectories it names, pages of any size give the same file, an empty selection is a valid file, and
the CLI's mistakes are one line."""

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
from rlpulse.producers.tracing import Tracer, observe_processor, set_reward, trace_client
from rlpulse.sinks.store.clickhouse import migrate, open_reader, open_store
from rlpulse.sinks.views.export import Filters, Shape, export
from tests.openai_server import FakeOpenAI
from tests.traced_agent import API_KEY, load_spans

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai")
pq = pytest.importorskip("pyarrow.parquet")

REPO = Path(__file__).resolve().parents[4]


def dataset() -> list[dict[str, Any]]:
    """The trajectories: project, run, step, sample, reward (None: none), status, LLM calls."""
    rows = []
    for step in range(4):
        for i in range(4):
            rows.append(dict(project="pa", run="run-a", rollout_id=f"a-{step}-{i}", step=step, sample=f"s-{i % 2}",
                             reward=(step * 4 + i) / 16, status="OK", calls=1 + i % 2))
    rows.append(dict(project="pa", run="run-a", rollout_id="a-fail", step=2, sample="s-0", reward=None, status="ERROR", calls=1))
    rows.append(dict(project="pa", run="run-a", rollout_id="a-nocall", step=1, sample="s-1", reward=0.9, status="OK", calls=0))
    rows += [dict(project="pb", run="run-b", rollout_id=f"b-{i}", step=0, sample="s-0", reward=1.0, status="OK", calls=1)
             for i in range(3)]
    return rows


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"chdb://{tmp_path_factory.mktemp('export') / 'ch'}"
    containers = []
    with FakeOpenAI() as fake:
        client = trace_client(openai.OpenAI(base_url=fake.base_url, api_key=API_KEY, max_retries=0))

        @observe_processor
        def episode(*, step: int, rollout_id: str, sample_id: str, row: dict[str, Any]) -> None:
            for turn in range(row["calls"]):
                client.chat.completions.create(model="bad-400" if row["status"] == "ERROR" else "policy",
                                               messages=[{"role": "user", "content": f"{rollout_id} turn {turn}"}])
            set_reward(row["reward"])

        for project, run in (("pa", "run-a"), ("pb", "run-b")):
            transport = InMemoryTransport()
            with TrainingTelemetry(project=project, run_id=run, transport=transport) as tel, Tracer(tel, content=True):
                for row in (r for r in dataset() if r["run"] == run):
                    if row["calls"] == 0:  # a rollout published as before, no traced calls
                        tel.rollout(step=row["step"], rollout_id=row["rollout_id"], reward=row["reward"], sample_id=row["sample"])
                        continue
                    try:
                        episode(step=row["step"], rollout_id=row["rollout_id"], sample_id=row["sample"], row=row)
                    except openai.BadRequestError:
                        pass
            containers += transport.values("spans")
    with open_store(url, owner="test") as store:
        migrate(store)
        load_spans(store, containers)
    return url


def exported(store_url: str, what: str = "triplets", fmt: str = "jsonl", **kwargs: Any) -> tuple[bytes, Any]:
    out = io.BytesIO()
    with open_reader(store_url, owner="test") as store:
        counts = export(store, what, out, fmt, **kwargs)
    return out.getvalue(), counts


def selected(store_url: str, filters: Filters) -> list[str]:
    data, _ = exported(store_url, "messages", filters=filters)
    return [json.loads(line)["rollout_id"] for line in data.decode().splitlines()]


CASES = [
    (Filters(), lambda r: True),
    (Filters(project="pb"), lambda r: r["project"] == "pb"),
    (Filters(run_id="run-a"), lambda r: r["run"] == "run-a"),
    (Filters(min_step=1, max_step=2), lambda r: 1 <= r["step"] <= 2),
    (Filters(min_step=3), lambda r: r["step"] >= 3),
    (Filters(sample_id="s-1"), lambda r: r["sample"] == "s-1"),
    (Filters(min_reward=0.5), lambda r: r["reward"] is not None and r["reward"] >= 0.5),
    (Filters(status="error"), lambda r: r["status"] == "ERROR"),
    (Filters(project="pa", min_step=2, sample_id="s-0", min_reward=0.5, status="ok"),
     lambda r: r["project"] == "pa" and r["step"] >= 2 and r["sample"] == "s-0" and (r["reward"] or 0) >= 0.5
     and r["status"] == "OK"),
    (Filters(run_id="nobody"), lambda r: False),
]


@pytest.mark.parametrize("filters,keep", CASES, ids=[repr(f) for f, _ in CASES])
def test_each_filter_selects_exactly_its_trajectories(store_url: str, filters: Filters, keep: Any) -> None:
    want = [r["rollout_id"] for r in dataset() if keep(r) and r["calls"] > 0]
    assert selected(store_url, filters) == want  # in (project, run, first sequence id) order: the job's


def test_triplets_are_one_row_per_call_with_the_trajectorys_reward(store_url: str) -> None:
    data, counts = exported(store_url, filters=Filters(run_id="run-a", max_step=0))
    rows = [json.loads(line) for line in data.decode().splitlines()]
    # --reward-to last-call (the default): set_reward's final reward goes to the last call, the others none
    assert [(r["rollout_id"], r["turn"], r["final"], r["reward"], r["trajectory_reward"]) for r in rows] == [
        (f"a-0-{i}", t, t == i % 2, i / 16 if t == i % 2 else None, i / 16) for i in range(4) for t in range(1 + i % 2)]
    every, _ = exported(store_url, filters=Filters(run_id="run-a", max_step=0), shape=Shape(reward_to="every-call"))
    assert [(r["rollout_id"], r["turn"], r["reward"]) for r in map(json.loads, every.decode().splitlines())] == [
        (f"a-0-{i}", t, i / 16) for i in range(4) for t in range(1 + i % 2)]
    assert [r["prompt"] for r in rows[:2]] == [[{"role": "user", "content": "a-0-0 turn 0"}],
                                                [{"role": "user", "content": "a-0-1 turn 0"}]]
    assert (counts.trajectories, counts.without_calls, counts.rows) == (4, 0, 6)
    _, counts = exported(store_url, filters=Filters(run_id="run-a", min_step=1, max_step=1))
    assert (counts.trajectories, counts.without_calls) == (5, 1)  # a-nocall is selected, and has no call to export


@pytest.mark.full  # 5 s: make test-all (make test keeps its 6 minutes; its filters and rows tests stay)
@pytest.mark.parametrize("what", ["triplets", "messages"])
def test_pages_of_any_size_give_the_same_file(store_url: str, what: str) -> None:
    whole, counts = exported(store_url, what)
    paged, small = exported(store_url, what, page_size=2, key_page=3)
    assert paged == whole and small.rows == counts.rows and small.pages > counts.pages >= 2
    one, _ = exported(store_url, what, "parquet")
    many, _ = exported(store_url, what, "parquet", page_size=3, key_page=5)
    assert pq.read_table(io.BytesIO(one)).to_pylist() == pq.read_table(io.BytesIO(many)).to_pylist()
    assert pq.ParquetFile(io.BytesIO(many)).num_row_groups > 1  # a row group per page


def test_an_empty_selection_is_a_valid_file_with_the_columns(store_url: str) -> None:
    data, counts = exported(store_url, "triplets", "parquet", filters=Filters(project="nobody"))
    table = pq.read_table(io.BytesIO(data))
    assert (table.num_rows, counts.rows) == (0, 0)
    assert table.column_names[:6] == ["project", "run_id", "attempt", "step", "sample_id", "rollout_id"]
    assert exported(store_url, "messages", filters=Filters(project="nobody"))[0] == b""


def cli(store_url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RLPULSE_CLICKHOUSE_URL": store_url, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "rlpulse.cli", "export", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_the_command_line(store_url: str, tmp_path: Path) -> None:
    done = cli(store_url, "messages", "-o", "-", "--project", "pb")
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["rollout_id"] for line in done.stdout.splitlines()] == ["b-0", "b-1", "b-2"]
    assert done.stderr.strip() == ("rlpulse export: 3 messages rows of 3 trajectories to - "
                                   "(0 selected trajectories had no LLM call; 1 pages)")
    out = tmp_path / "t.parquet"
    done = cli(store_url, "triplets", "-o", str(out), "--run", "run-b")
    assert done.returncode == 0 and pq.read_table(out).num_rows == 3, done.stderr
    assert oct(out.stat().st_mode & 0o777) == "0o600" and not list(tmp_path.glob(".*part"))
    for args, message in [
        (("triplets", "-o", "x.jsonl", "--min-step", "3", "--max-step", "1"), "--min-step 3 is above --max-step 1"),
        (("triplets", "-o", "-", "--format", "parquet"), "Parquet goes to a file: give --output PATH"),
    ]:
        done = cli(store_url, *args)
        assert (done.returncode, done.stderr.strip().splitlines()[-1]) == (2, f"rlpulse export: {message}"), done.stderr
    done = cli(store_url, "triplets", "-o", "x.jsonl", "--status", "maybe")
    assert done.returncode == 2 and "invalid choice: 'maybe'" in done.stderr
    done = cli(f"chdb://{tmp_path / 'empty'}", "triplets", "-o", str(tmp_path / "e.jsonl"))
    assert done.returncode == 1 and "has no data yet" in done.stderr and not (tmp_path / "e.jsonl").exists()


@pytest.mark.full
def test_an_unknown_run_or_project_exits_1_naming_it_and_writes_no_file(store_url: str, tmp_path: Path) -> None:
    """As `rlpulse report RUN --html`: a run the store has no rows of is an error, not an empty export."""
    out = tmp_path / "t.jsonl"
    done = cli(store_url, "triplets", "-o", str(out), "--run", "nobody")
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == (f"rlpulse export: no rows name run 'nobody' in {store_url}. "
                                   "Latest runs: run-b, run-a")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    done = cli(store_url, "messages", "-o", "-", "--project", "nobody")
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert done.stderr.strip() == (f"rlpulse export: no rows of project 'nobody' in {store_url}. "
                                   "Latest projects: pb, pa")
    # a run that exists with a selection that holds nothing is still a valid, empty export (exit 0)
    done = cli(store_url, "messages", "-o", str(out), "--run", "run-b", "--min-step", "5")
    assert done.returncode == 0 and out.read_bytes() == b"", done.stderr
    # what `report` says of the same run
    report = subprocess.run([sys.executable, "-m", "rlpulse.cli", "report", "nobody", "--html", str(tmp_path / "r.html")],
                            env={**os.environ, "RLPULSE_CLICKHOUSE_URL": store_url, "PYTHONPATH": str(REPO)}, cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 1 and "no rows name run 'nobody'" in report.stderr, report.stderr
