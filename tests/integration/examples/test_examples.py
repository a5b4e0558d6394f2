"""Each script in ``examples/`` runs as a newcomer would run it, pointed at this test's topics by the
``RLPULSE_*`` variables, and what it published is counted exactly: in ClickHouse, through
``rlpulse streams`` and ``rlpulse sink`` (one pipeline for the module, a project per example), or,
for the webhook receiver, in what it printed of the alerts ``rlpulse alerts --webhook`` posted.

``trl_grpo.py`` runs in the trainer venv (``tests/trainers/trainer_venv.py``, as the TRL job test:
TRL cannot share the pipeline's venv); under ``CI=true`` a venv that cannot be built fails the
test, elsewhere it skips saying why.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from rlpulse.base.settings import Settings
from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.schemas.codec import Codec
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.alerts.webhook import alert_id
from tests.conftest import unavailable
from tests.integration import until
from tests.trainers import trainer_venv

pytestmark = [pytest.mark.integration, pytest.mark.full]

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.fixture(scope="module")
def pipeline(module_settings: Settings) -> Iterator[Pipeline]:
    ensure_topics(module_settings)
    with Pipeline(module_settings) as running:
        running.start()
        wait_groups_ready(module_settings, (module_settings.app_id, module_settings.sink_group), running)
        yield running


def run_example(settings: Settings, name: str, *args: str, python: str = sys.executable, cwd: Path | None = None,
                env: dict[str, str] | None = None, timeout: float = 300) -> str:
    """Run ``examples/<name>`` from a folder of its own with the test's settings; its output."""
    environ = {k: v for k, v in settings_env(settings).items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([python, str(EXAMPLES / name), *args], env={**environ, **(env or {})}, cwd=cwd,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout[-6000:]}"
    return done.stdout


def rows(settings: Settings, sql: str) -> list[tuple]:
    got = until.query(settings, sql)
    assert got is not None, f"the store could not be read for {sql}"
    return got


def wait_for(pipeline: Pipeline, settings: Settings, project: str, spans: int, steps: int) -> None:
    """Until the project's spans, its STEP events and their step figures are in (at least; the test checks exactly)."""
    ours = f"project = '{project}'"
    pipeline.wait_caught_up(timeout=300, until=until.counts(settings, {
        f"SELECT count() FROM $db.spans FINAL WHERE {ours}": spans,
        f"SELECT count() FROM $db.steps FINAL WHERE {ours} AND type IN ('STEP', 'RUN_END')": steps + 1,
        f"SELECT count() FROM $db.step_stats FINAL WHERE {ours}": steps}))


def kinds(settings: Settings, project: str) -> dict[str, int]:
    return dict(rows(settings, f"SELECT kind, count() FROM $db.spans FINAL WHERE project = '{project}' GROUP BY kind"))


def step_types(settings: Settings, project: str) -> dict[str, int]:
    return dict(rows(settings, f"SELECT type, count() FROM $db.steps FINAL WHERE project = '{project}' "
                               "AND type != 'HEARTBEAT' GROUP BY type"))


def test_custom_loop(module_settings: Settings, pipeline: Pipeline, tmp_path: Path) -> None:
    settings, project = module_settings, "ex-custom"
    out = run_example(settings, "custom_loop.py", "--project", project, "--run-id", "loop", cwd=tmp_path)
    assert "published 3 steps of 4 rollouts each" in out
    wait_for(pipeline, settings, project, spans=2 * 3 * 4, steps=3)
    assert kinds(settings, project) == {"ROLLOUT": 12, "GRADER": 12}  # 3 steps x 4 rollouts, one judge call each
    assert step_types(settings, project) == {"RUN_START": 1, "STEP": 3, "RUN_END": 1}
    assert rows(settings, f"SELECT step, rollouts FROM $db.step_stats FINAL WHERE project = '{project}' ORDER BY step") \
        == [(0, 4), (1, 4), (2, 4)]
    metrics = rows(settings, f"SELECT step, name, value FROM $db.step_metrics WHERE project = '{project}' ORDER BY step, name")
    assert metrics == [(s, n, v) for s in range(3) for n, v in sorted({"loss": 1.0 / (s + 1), "kl": 0.01 * s,
                                                                        "lr": 1e-5}.items())]


def test_traced_agent(module_settings: Settings, pipeline: Pipeline, tmp_path: Path) -> None:
    pytest.importorskip("openai")
    from tests.openai_server import FakeOpenAI

    settings, project = module_settings, "ex-agent"
    with FakeOpenAI() as fake:
        out = run_example(settings, "traced_agent.py", "--project", project, "--run-id", "agent", cwd=tmp_path,
                          env={"OPENAI_BASE_URL": fake.base_url, "OPENAI_API_KEY": "sk-example"})
    assert "traced 2 rollouts" in out
    assert len(fake.requests) == 2 * 3  # per question: ask, ask again with the tool's result, the judge
    wait_for(pipeline, settings, project, spans=2 * 5, steps=1)
    # per rollout: its ROLLOUT span, 3 LLM spans (two through the wrapped client, the judge's) and 1 TOOL span
    assert kinds(settings, project) == {"ROLLOUT": 2, "LLM": 6, "TOOL": 2}
    tree = rows(settings, f"""SELECT r.rollout_id, c.kind, c.name FROM $db.spans AS c FINAL
        INNER JOIN (SELECT span_id, rollout_id FROM $db.spans FINAL WHERE project = '{project}' AND kind = 'ROLLOUT') AS r
        ON c.parent_span_id = r.span_id WHERE c.project = '{project}' ORDER BY r.rollout_id, c.start_time_ns""")
    assert [(r, k) for r, k, _ in tree] == [(r, k) for r in ("q0", "q1") for k in ("LLM", "TOOL", "LLM", "LLM")]
    assert [n for _, k, n in tree if k != "LLM"] == ["calculator"] * 2 and tree[3][2] == "judge"
    assert rows(settings, f"SELECT rollout_id, reward FROM $db.spans FINAL WHERE project = '{project}' AND kind = 'ROLLOUT' "
                          "ORDER BY rollout_id") == [("q0", 1.0), ("q1", 1.0)]


@pytest.fixture(scope="module")
def trainer_python() -> Path:
    try:
        return trainer_venv.ensure(log=lambda line: print(f"trainer venv: {line}"))
    except (trainer_venv.VenvError, OSError) as exc:
        unavailable(f"the trainer venv {trainer_venv.VENV} could not be built "
                    f"(`python tests/trainers/trainer_venv.py` builds it): {exc}")


@pytest.mark.timeout(1800)  # the first build of the trainer venv downloads about 3 GB
def test_trl_grpo(module_settings: Settings, pipeline: Pipeline, trainer_python: Path, tmp_path: Path) -> None:
    settings, project = module_settings, "ex-trl"
    out = run_example(settings, "trl_grpo.py", "--project", project, "--run-id", "grpo", python=str(trainer_python),
                      cwd=tmp_path, timeout=600)
    assert "trained 2 steps of 8 completions" in out
    wait_for(pipeline, settings, project, spans=2 * 16, steps=2)
    assert kinds(settings, project) == {"ROLLOUT": 16, "GRADER": 16}  # 2 steps x 8 completions, one reward function
    # METRICS: TRL's train summary (train_loss, train_runtime, ...), logged after the last step
    assert step_types(settings, project) == {"RUN_START": 1, "STEP": 2, "METRICS": 1, "RUN_END": 1}
    assert rows(settings, f"SELECT status FROM $db.steps FINAL WHERE project = '{project}' AND type = 'RUN_END'") \
        == [("finished",)]
    assert rows(settings, f"SELECT step, rollouts FROM $db.step_stats FINAL WHERE project = '{project}' ORDER BY step") \
        == [(1, 8), (2, 8)]
    assert rows(settings, f"SELECT DISTINCT step FROM $db.step_metrics WHERE project = '{project}' AND name = 'loss' "
                          "ORDER BY step") == [(1,), (2,)]


def alert(state: str) -> dict:
    return dict(rule="stalled_run", state=state, key="ex/r1/1", severity="critical", summary=f"run r1 {state.lower()}",
                value=900.0, threshold=900.0, project="ex", run_id="r1", attempt=1, time_ns=1_800_000_000_000_000_000,
                first_seen_ns=1_799_999_000_000_000_000, last_seen_ns=1_800_000_000_000_000_000)


async def publish(settings: Settings, records: list[dict]) -> None:
    codec, producer = Codec(), AIOKafkaProducer(**settings.kafka_client_kwargs())
    await producer.start()
    try:
        for record in records:
            await producer.send_and_wait(settings.topic("alerts"), key=b"ex/r1", value=codec.encode("Alert", [record]))
    finally:
        await producer.stop()


def test_alert_webhook(settings: Settings) -> None:
    ensure_topics(settings)
    sent = [alert("FIRING"), alert("RESOLVED")]
    asyncio.run(publish(settings, sent))
    receiver = subprocess.Popen([sys.executable, str(EXAMPLES / "alert_webhook.py"), "--port", "0", "--password",
                                 "hook-pw", "--exit-after", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = receiver.stdout.readline()  # type: ignore[union-attr]
        found = re.match(r"listening on http://127\.0\.0\.1:(\d+)/alerts", first)
        assert found, first
        url = f"http://rlpulse:hook-pw@127.0.0.1:{found.group(1)}/alerts"
        feed = subprocess.run([sys.executable, "-m", "rlpulse.cli", "alerts", "--from-beginning", "--once", "--webhook", url],
                              env=settings_env(settings), capture_output=True, text=True, timeout=120)
        assert feed.returncode == 0, feed.stderr
        assert "2 delivered, 0 failed, 0 not delivered" in feed.stdout, feed.stdout
        printed = receiver.communicate(timeout=30)[0].splitlines()
    finally:
        receiver.kill() if receiver.poll() is None else None
    assert receiver.returncode == 0
    assert printed == [f"{a['state']} stalled_run ex/r1/1 [critical] run r1 {a['state'].lower()} (id {alert_id(a)})"
                       for a in sent]


def test_alert_webhook_refuses_what_is_not_an_authenticated_bounded_alert() -> None:
    """The receiver is a listening port: without the password nothing is read, a body over its
    bound or not an alert is refused, and a hostile summary prints as escapes, not as control bytes."""
    import http.client

    receiver = subprocess.Popen([sys.executable, str(EXAMPLES / "alert_webhook.py"), "--port", "0", "--password",
                                 "hook-pw", "--exit-after", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = int(re.match(r"listening on http://127\.0\.0\.1:(\d+)/", receiver.stdout.readline()).group(1))  # type: ignore[union-attr]

        def post(body: bytes, auth: str | None = "rlpulse:hook-pw", length: int | None = None) -> int:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            headers = {"Content-Length": str(len(body) if length is None else length)}
            if auth is not None:
                headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
            conn.request("POST", "/alerts", body=body if length is None else b"", headers=headers)
            status = conn.getresponse().status
            conn.close()
            return status

        hostile = {"alert_id": "a1", "state": "FIRING", "rule": "xid", "key": "GPU-1", "severity": "critical",
                   "summary": "boom\x1b]0;pwned\x07\nFAKE line"}
        assert post(json.dumps(hostile).encode(), auth=None) == 401
        assert post(json.dumps(hostile).encode(), auth="rlpulse:wrong") == 401
        assert post(json.dumps(hostile).encode(), auth="rlpulse:pässwort") == 401
        assert post(b"", length=10 * 1024 * 1024) == 413  # refused on its header: the 10 MiB is never sent
        assert post(b"{not json") == 400
        assert post(json.dumps({"alert_id": "a2"}).encode()) == 400
        assert post(json.dumps(hostile).encode()) == 204
        printed = receiver.communicate(timeout=30)[0].splitlines()
    finally:
        receiver.kill() if receiver.poll() is None else None
    assert printed == ["FIRING xid GPU-1 [critical] boom\\x1b]0;pwned\\x07\\nFAKE line (id a1)"]
