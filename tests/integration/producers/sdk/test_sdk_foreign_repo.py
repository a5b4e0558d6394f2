"""The SDK inside someone else's repository: a training job whose own ``schemas/``, ``streams/``,
``producers/`` and ``sinks/`` packages sit next to its script still imports the SDK and publishes.

Installed, our folders are ``rlpulse.schemas``, ``rlpulse.producers``, ``rlpulse.streams`` and
``rlpulse.sinks`` (pyproject.toml's package-dir), so nothing of ours is a top-level name a job's
folder could shadow. The job here runs as a user runs it: ``python train.py`` from its own
directory (which is then ``sys.path[0]``), with no PYTHONPATH pointing into this repository.
Its ``producers``, ``streams`` and ``sinks`` raise ImportError when imported, and its ``schemas``
defines names of ours with other meanings and holds modules named as ours that raise: any
bare import of ours would fail the job. The records are read back from the real broker.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from rlpulse.base import env as envvars
from rlpulse.schemas.codec import Codec
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import read_topic

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[4]
TIMEOUT_S = 120

REFUSE = 'raise ImportError("the job\'s own {name} package: the SDK must never import it")\n'
JOB_SCHEMAS = '''
"""The training job's own schemas (its dataset's), with names that clash with the SDK's."""
MARK = "the job's own schemas"
Settings = "the job's settings"
Codec = None
TrainingTelemetry = None
SPAN_KINDS = ("not", "ours")
'''

TRAIN = '''
import json
import sys

import schemas  # the job's own package, imported first: it is in sys.modules before the SDK loads
from rlpulse import TrainingTelemetry
from rlpulse.producers import TrainingTelemetry as FromProducers
import rlpulse.producers
import rlpulse.schemas

assert TrainingTelemetry is FromProducers
tel = TrainingTelemetry(project="foreign", run_id=sys.argv[1])
tel.start()
for step in range(3):
    for i in range(4):
        rollout = f"s{step}-r{i}"
        tel.rollout(step=step, rollout_id=rollout, reward=i / 4, term_shares={"judge": i / 8}, completion_tokens=100 * i,
                    max_tokens=300)
        tel.grader(step=step, rollout_id=rollout, term="judge", outcome=("ok", "timeout")[i % 2], duration_s=0.5,
                   score=i / 4)
    tel.step_completed(step=step, tokens=1000 * (step + 1), duration_s=2.0)
undelivered = tel.close(30)
import schemas as again  # still the job's

print(json.dumps({
    "writer": tel.writer_id, "undelivered": undelivered, "dropped": tel.dropped,
    "schemas": again.__file__, "mark": again.MARK,
    "ours": [rlpulse.schemas.__file__, rlpulse.producers.__file__],
    "modules": sorted(m for m in sys.modules
                      if m.split(".")[0] in ("producers", "streams", "sinks", "faust", "clickhouse_connect", "chdb")
                      or m.startswith(("schemas.", "rlpulse.streams", "rlpulse.sinks"))),
    "path0": sys.path[0],
}))
'''


def make_job(job: Path) -> None:
    """A training repository: its own packages named as ours, and train.py."""
    for name in ("producers", "streams", "sinks"):
        (job / name).mkdir(parents=True)
        (job / name / "__init__.py").write_text(REFUSE.format(name=name))
        for module in ("telemetry", "sender", "app", "sink"):  # modules named as ours, in case a path reached them
            (job / name / f"{module}.py").write_text(REFUSE.format(name=f"{name}.{module}"))
    (job / "schemas").mkdir()
    (job / "schemas" / "__init__.py").write_text(JOB_SCHEMAS)
    for module in ("codec", "settings", "catalogue", "enums", "topics", "files", "faults"):
        (job / "schemas" / f"{module}.py").write_text(REFUSE.format(name=f"schemas.{module}"))
    (job / "train.py").write_text(textwrap.dedent(TRAIN))


def job_env(settings: Settings) -> dict[str, str]:
    """The user's environment: nothing of this repository on PYTHONPATH; this test's settings (broker, topics)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and k not in envvars.VARIABLES}
    return {**env, **settings.env()}


def records(settings: Settings, short: str) -> list[dict[str, Any]]:
    messages = asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic(short)))
    codec = Codec()
    return [r for m in sorted(messages, key=lambda m: (m.partition, m.offset)) for r in codec.decode(m.value).records]


def test_a_job_with_its_own_schemas_streams_producers_and_sinks_publishes_through_the_sdk(
        settings: Settings, tmp_path: Path) -> None:
    job = tmp_path / "training-repo"
    make_job(job)
    done = subprocess.run([sys.executable, "train.py", "run-1"], cwd=job, env=job_env(settings),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])

    # The job's own names stay the job's; ours load from this repository, whatever the job holds.
    assert Path(report["path0"]) == job
    assert (Path(report["schemas"]), report["mark"]) == (job / "schemas" / "__init__.py", "the job's own schemas")
    assert [Path(p) for p in report["ours"]] == [ROOT / "schemas" / "__init__.py", ROOT / "producers" / "__init__.py"]
    assert report["modules"] == []  # no job package of those names imported, no faust, no ClickHouse client
    assert (report["undelivered"], report["dropped"]) == (0, 0)

    # Exactly the records the job published, once each, in its order.
    spans, steps = records(settings, "spans"), records(settings, "steps")
    assert {(r["project"], r["run_id"], r["writer_id"]) for r in spans + steps} == {("foreign", "run-1", report["writer"])}
    expected_spans = []
    for step in range(3):
        for i in range(4):
            rollout = f"s{step}-r{i}"
            expected_spans.append(("ROLLOUT", rollout, step, i / 4, {"judge": i / 8}, 100 * i, i == 3, None, None))
            outcome = ("ok", "timeout")[i % 2]
            expected_spans.append(("GRADER", rollout, step, None, {}, None, None, outcome, i / 4 if outcome == "ok" else None))
    assert [(r["kind"], r["rollout_id"], r["step"], r["reward"], r["term_shares"], r["completion_tokens"], r["clipped"],
             r["outcome"], r["score"]) for r in spans] == expected_spans
    assert [r["writer_sequence"] for r in spans] == list(range(1, 25))
    assert [(r["type"], r["step"], r["step_count"], r["tokens"], r["sequence_id"]) for r in steps] == [
        ("RUN_START", -1, 0, 0, 1), ("STEP", 0, 1, 1000, 2), ("STEP", 1, 2, 2000, 3), ("STEP", 2, 3, 3000, 4),
        ("RUN_END", -1, 3, 0, 5)]
    assert steps[-1]["spans_sent"] == 24


def test_the_job_cannot_reach_our_top_level_names(tmp_path: Path) -> None:
    """The other way round: from a neutral directory, our folders are not importable as bare names
    (so they cannot shadow a job's either), and the installed names are."""
    code = ("import importlib.util as u, json; "
            "print(json.dumps([u.find_spec(n) is not None for n in ('base', 'schemas', 'producers', 'streams', 'sinks', "
            "'rlpulse.base', 'rlpulse.schemas', 'rlpulse.producers', 'rlpulse.streams', 'rlpulse.sinks')]))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [False] * 5 + [True] * 5
