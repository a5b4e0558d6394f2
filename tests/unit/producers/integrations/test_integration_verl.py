"""verl's logger hook (``rlpulse.producers.integrations.verl``) and the shared metrics-dict helper.

What was tested against what:

* **verl's own classes, when verl is installed** (``pip install verl==0.9.1 --no-deps`` plus
  orjson and packaging): ``verl.utils.tracking.Tracking`` and its ``FileLogger`` are loaded from
  the installed package and driven as verl's PPO trainer drives them (``Tracking(...,
  default_backend=[...])``, ``log(data=..., step=...)``, ``finish(exit_code=...)``). The package's
  ``__init__`` is bypassed with stand-in parent packages, because it imports torch (and runs
  ``torch.cuda.is_available()``); the tracking module itself is verl's, unchanged. Those tests
  skip where verl is not installed (this repository's venv does not hold it).
* **Everywhere else, verl's documented formats**: the metric names below are copied from verl
  0.9.1's trainers (PPO: ``training/global_step``, ``actor/pg_clipfrac``,
  ``response_length/clip_ratio``, ``timing_s/step``, ``perf/*``; validation ``val-core/...``);
  the JSONL is what its ``file`` backend writes, one ``{"step": n, "data": {...}}`` a line.

Every test checks the exact records an ``InMemoryTransport`` received.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import math
import sys
import types
from pathlib import Path

import pytest

from tests.framework_sources import framework_sources
from rlpulse.producers.sdk import events
from rlpulse.producers.integrations import metrics_dict, verl
from rlpulse.producers.sdk.memory import InMemoryTransport
from rlpulse.producers.sdk.run_config import flatten_config
from rlpulse.producers.sdk.telemetry import TrainingTelemetry
from rlpulse.base.settings import Settings

SETTINGS = Settings.load({"RLPULSE_TOPIC_PREFIX": "mem", "RLPULSE_HEARTBEAT_INTERVAL": "1h"})

# One PPO step as verl 0.9.1 logs it (names from its trainer and metric utilities; values made up).
STEP_3 = {
    "training/global_step": 3, "training/epoch": 0,
    "actor/pg_loss": -0.0123, "actor/pg_clipfrac": 0.0031, "actor/ppo_kl": 0.0004, "actor/pg_clipfrac_lower": 0.0,
    "actor/entropy": 0.52, "actor/grad_norm": 0.81, "actor/lr": 1e-6,
    "critic/score/mean": 0.42, "critic/score/max": 1.0, "critic/score/min": 0.0,
    "response_length/mean": 311.5, "response_length/max": 1024, "response_length/min": 12,
    "response_length/clip_ratio": 0.0625, "prompt_length/mean": 104.25, "prompt_length/clip_ratio": 0.0,
    "timing_s/gen": 12.5, "timing_s/update_actor": 9.75, "timing_s/step": 30.25,
    "perf/total_num_tokens": 53120, "perf/time_per_step": 30.25, "perf/throughput": 219.5, "perf/mfu/actor": 0.38,
    "val-core/openai/gsm8k/acc/mean@1": 0.61,
}
VALIDATION_0 = {"val-core/openai/gsm8k/acc/mean@1": 0.25, "val-aux/openai/gsm8k/reward/mean@1": 0.25,
                "val-aux/num_turns/mean": 1}


def telemetry(transport: InMemoryTransport, **kwargs) -> TrainingTelemetry:
    return TrainingTelemetry("p", "r", settings=SETTINGS, transport=transport, **kwargs)


def steps(transport: InMemoryTransport) -> list[dict]:
    keep = ("type", "step", "step_count", "tokens", "duration_s", "mfu", "metrics", "status", "trainer", "project", "run_id")
    return [{k: r[k] for k in keep} for r in transport.records("steps") if r["type"] != "HEARTBEAT"]


def as_floats(data: dict) -> dict:
    return {k: float(val) for k, val in data.items()}


def test_a_training_step_is_one_step_with_every_number_under_verl_names():
    transport = InMemoryTransport()
    with telemetry(transport) as tel:
        backend = verl.VerlLogger(tel)
        backend.log(data=VALIDATION_0, step=0)  # val_before_train: figures of step 0, no step
        backend.log(data=STEP_3, step=3)
    start, validation, step, end = steps(transport)
    assert (start["type"], end["type"], end["status"], end["step_count"]) == ("RUN_START", "RUN_END", "finished", 1)
    assert validation == {**validation, "type": "METRICS", "step": 0, "step_count": 0, "metrics": as_floats(VALIDATION_0)}
    assert step == {**step, "type": "STEP", "step": 3, "step_count": 1, "tokens": 53120, "duration_s": 30.25, "mfu": 0.38,
                    "metrics": as_floats(STEP_3)}
    assert step["metrics"]["response_length/clip_ratio"] == 0.0625 and step["metrics"]["actor/pg_clipfrac"] == 0.0031
    assert backend.publisher.skipped == {}


def test_an_mfu_outside_0_to_1_leaves_the_steps_mfu_null_and_warns_naming_it(caplog: pytest.LogCaptureFixture):
    # verl's perf/mfu/actor is a fraction (estimated over promised FLOPs per GPU); a FLOPs estimate
    # that does not fit the model gives more than 1, which the SDK refuses: the job must train on
    transport = InMemoryTransport()
    with caplog.at_level(logging.WARNING, logger="rlpulse.producers.integrations.metrics_dict"):
        with telemetry(transport) as tel:
            backend = verl.VerlLogger(tel)
            for step, mfu in ((1, 1.7), (2, 0.38), (3, 2.5), (4, -0.5)):
                backend.log(data={**STEP_3, "perf/mfu/actor": mfu}, step=step)
    got = [(s["step"], s["mfu"], s["metrics"]["perf/mfu/actor"]) for s in steps(transport) if s["type"] == "STEP"]
    assert got == [(1, None, 1.7), (2, 0.38, 0.38), (3, None, 2.5), (4, None, -0.5)]  # the metric keeps the value
    assert backend.publisher.mfu_out_of_range == 3 and backend.publisher.skipped == {}
    # one warning, naming the first value; the rest within the minute are counted
    assert [r.getMessage() for r in caplog.records] == [
        "rlpulse metrics: step 1 reports MFU 1.7, outside 0 to 1 (a fraction; seed 001): its STEP has no MFU "
        "(the trainer's metric keeps the value); 1 such steps so far, logged at most every 60 s"]


def test_a_step_logged_twice_counts_once():
    # verl's fully async trainer logs a step's timing, then its aggregated metrics, at the same step
    transport = InMemoryTransport()
    with telemetry(transport) as tel:
        backend = verl.VerlLogger(tel)
        backend.log(data={"timing_s/step": 2.0}, step=5)
        backend.log(data={"actor/pg_loss": 0.5}, step=5)
        backend.log(data={"actor/pg_loss": 0.25}, step=6)
    kinds = [(r["type"], r["step"], r["step_count"], r["metrics"]) for r in steps(transport)[1:-1]]
    assert kinds == [("STEP", 5, 1, {"timing_s/step": 2.0}), ("METRICS", 5, 1, {"actor/pg_loss": 0.5}),
                     ("STEP", 6, 2, {"actor/pg_loss": 0.25})]


def test_values_that_are_not_finite_numbers_are_skipped_counted_and_logged(caplog):
    transport = InMemoryTransport()
    data = {"ok": 1.5, "an int": 7, "a bool": True, "nan": math.nan, "inf": -math.inf, "huge": 10**400,
            "text": "gsm8k", "none": None, "list": [1.0, 2.0], "table": {"a": 1}}
    caplog.set_level(logging.WARNING, logger=metrics_dict.__name__)
    with telemetry(transport) as tel:
        backend = verl.VerlLogger(tel)
        backend.log(data=data, step=1)
        backend.log(data=data, step=2)  # counted again, logged once
        assert backend.publisher.skipped == {"non-finite": 6, "non-numeric": 6, "null": 2}
        backend.finish()
    metrics = [r["metrics"] for r in steps(transport) if r["type"] == "STEP"]
    assert metrics == [{"ok": 1.5, "an int": 7.0, "a bool": 1.0}] * 2
    said = [r.getMessage() for r in caplog.records]
    for name in ("nan", "inf", "huge", "text", "none", "list", "table"):
        assert sum(f"'{name}' not sent" in m for m in said) == 1, name
    assert any("not sent as given: non-finite 6, non-numeric 6, null 2" in m for m in said)  # the summary at close


def test_numpy_scalars_are_numbers_and_arrays_are_not():
    # numpy 2 refuses float() of any array with a dimension, even of one element; a 0-d one converts
    np = pytest.importorskip("numpy")
    transport = InMemoryTransport()
    with telemetry(transport) as tel:
        backend = verl.VerlLogger(tel)
        backend.log(data={"f32": np.float32(0.5), "i64": np.int64(3), "b": np.bool_(True), "zero-d": np.array(2.0),
                          "many": np.array([1.0, 2.0]), "nan32": np.float32("nan")}, step=np.int64(4))
        assert backend.publisher.skipped == {"non-numeric": 1, "non-finite": 1}
    (step,) = [r for r in steps(transport) if r["type"] == "STEP"]
    assert (step["step"], step["metrics"]) == (4, {"f32": 0.5, "i64": 3.0, "b": 1.0, "zero-d": 2.0})


def test_names_and_counts_are_brought_within_the_sdk_limits():
    transport = InMemoryTransport()
    long_a, long_b = "x" * 300 + "/a", "x" * 300 + "/b"
    many = {f"m/{i:03d}": float(i) for i in range(300)}
    with telemetry(transport) as tel:
        publisher = metrics_dict.MetricsPublisher(tel, max_names_per_step=600)
        publisher.step(1, {long_a: 1.0, long_b: 2.0, "val-core/数学/acc": 0.5, 7: 3.0, "": 4.0})
        publisher.step(2, many)  # 256 on the STEP, the other 44 on a METRICS event of the same step
        publisher.step(3, {**many, **{f"n/{i:03d}": 1.0 for i in range(400)}})  # 700 names: 100 over the bound
    records = [r for r in steps(transport) if r["type"] in ("STEP", "METRICS")]
    names = list(records[0]["metrics"])
    assert [len(n) for n in names[:2]] == [events.MAX_NAME] * 2 and names[0] != names[1]
    assert names[0].startswith("x" * 200) and names[0][-9] == "~"
    assert names[2:] == ["val-core/\\u6570\\u5b66/acc", "7"]
    assert [(r["type"], r["step"], len(r["metrics"])) for r in records[1:]] == [
        ("STEP", 2, 256), ("METRICS", 2, 44), ("STEP", 3, 256), ("METRICS", 3, 256), ("METRICS", 3, 88)]
    assert {**records[1]["metrics"], **records[2]["metrics"]} == many
    assert publisher.skipped == {"renamed": 4, "bad name": 1, "over limit": 100}
    assert all(r["step_count"] == r["step"] for r in records)  # each step counted once


def test_a_dict_the_sdk_refuses_is_counted_and_training_goes_on(caplog):
    transport = InMemoryTransport()
    with telemetry(transport) as tel:
        publisher = metrics_dict.MetricsPublisher(tel)
        assert publisher.step(-1, {"a": 1.0}) == {} and publisher.scalars("x", {"a": 1.0}) == {}
        assert publisher.step(1, ["not", "a", "dict"]) == {}  # an empty step: completed, no metrics
        assert publisher.skipped == {"refused": 3}
    assert [(r["type"], r["step"], r["metrics"]) for r in steps(transport)[1:-1]] == [("STEP", 1, {})]


def test_run_end_says_how_verl_finished():
    for exit_code, status in ((0, "finished"), (1, "failed")):
        transport = InMemoryTransport()
        tel = telemetry(transport)
        tel.start()
        backend = verl.VerlLogger(tel, owns_telemetry=True)
        backend.log(data=STEP_3, step=3)
        backend.finish(exit_code=exit_code)
        backend.finish(exit_code=0)  # idempotent, as verl's own finish is
        assert [(r["type"], r["status"]) for r in steps(transport)] == [
            ("RUN_START", None), ("STEP", None), ("RUN_END", status)]


def test_a_tracking_collected_without_an_exit_code_sends_no_run_end():
    transport = InMemoryTransport()
    tel = telemetry(transport)
    tel.start()
    backend = verl.VerlLogger(tel, owns_telemetry=True)
    backend.log(data=STEP_3, step=3)
    backend.finish(collected=True)  # the legacy trainer: how the run ended is unknown
    assert [r["type"] for r in steps(transport)] == ["RUN_START", "STEP"]


def test_attach_adds_a_backend_that_verl_tracking_calls():
    class Tracking:  # verl's interface: Tracking.log calls every entry of self.logger
        def __init__(self):
            self.logger = {}

        def log(self, data, step, backend=None):
            for name, instance in self.logger.items():
                if backend is None or name in backend:
                    instance.log(data=data, step=step)

    transport = InMemoryTransport()
    with telemetry(transport) as tel:
        tracking = Tracking()
        assert verl.attach(tracking, tel) is tracking.logger["rlpulse"]
        tracking.log(data=STEP_3, step=3)
    assert [r["type"] for r in steps(transport)] == ["RUN_START", "STEP", "RUN_END"]


def test_attach_with_the_config_given_to_tracking_sends_it_on_a_second_run_start_of_a_started_run():
    transport = InMemoryTransport()
    with telemetry(transport) as tel:
        verl.attach(types.SimpleNamespace(logger={}), tel, config={"data": {"train_batch_size": 1024}, "trainer": {}})
    assert [(r["type"], r["config"]) for r in transport.records("steps")] == [
        ("RUN_START", {}), ("RUN_START", {"data.train_batch_size": "1024", "trainer": "{}"}), ("RUN_END", {})]


# -- the file backend ----------------------------------------------------------------------------
def verl_line(step: int, data: dict) -> bytes:
    return json.dumps({"step": step, "data": data}).encode() + b"\n"  # FileLogger's record (it uses orjson)


def test_the_file_backend_is_followed_line_by_line(tmp_path, caplog):
    path = tmp_path / "proj" / "exp.jsonl"
    assert verl.file_logger_path("proj", "exp", {"VERL_FILE_LOGGER_ROOT": str(tmp_path)}) == str(path)
    assert verl.file_logger_path("proj", "exp", {"VERL_FILE_LOGGER_PATH": "/x.jsonl"}) == "/x.jsonl"
    transport = InMemoryTransport()
    with telemetry(transport) as tel:
        follower = verl.FileFollower(path, tel)
        assert follower.poll() == 0  # not written yet
        path.parent.mkdir()
        line = verl_line(3, STEP_3)
        path.write_bytes(verl_line(0, VALIDATION_0) + line[:40])  # verl is mid-write
        assert follower.poll() == 1
        with path.open("ab") as f:
            f.write(line[40:] + b"not json\n" + b'{"step": -1, "data": {}}\n')
        assert follower.poll() == 1 and follower.bad_lines == 2
        path.write_bytes(verl_line(1, {"actor/pg_loss": 0.5}))  # verl reopened it with "wb": a new run
        assert follower.poll() == 1
        follower.stop()
    kinds = [(r["type"], r["step"], r["metrics"]) for r in steps(transport)[1:-1]]
    assert kinds == [("METRICS", 0, as_floats(VALIDATION_0)), ("STEP", 3, as_floats(STEP_3)),
                     ("STEP", 1, {"actor/pg_loss": 0.5})]


def test_follow_file_runs_beside_the_trainer_and_replay_reads_a_finished_file(tmp_path):
    path = tmp_path / "exp.jsonl"
    transport = InMemoryTransport()
    with telemetry(transport) as tel, verl.follow_file(path, tel, poll_s=0.01):
        path.write_bytes(verl_line(1, {"a": 1.0}) + verl_line(2, {"a": 2.0})[:-1])  # the last newline is missing
    assert [(r["type"], r["step"]) for r in steps(transport)] == [("RUN_START", -1), ("STEP", 1), ("STEP", 2),
                                                                  ("RUN_END", -1)]
    transport = InMemoryTransport()
    with telemetry(transport) as tel:
        assert verl.replay_file(path, tel) == 2


# -- verl's own Tracking, when verl is installed --------------------------------------------------
@pytest.fixture
def verl_tracking_module(monkeypatch):
    """Imports verl's real tracking module under stand-in ``verl`` and ``verl.utils`` packages."""
    framework_sources("verl")
    spec = importlib.util.find_spec("verl")  # finds without importing: verl's __init__ imports torch
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed: pip install verl==0.9.1 --no-deps (and orjson, packaging)")
    pytest.importorskip("orjson")
    root = Path(list(spec.submodule_search_locations)[0])
    for name, folder in (("verl", root), ("verl.utils", root / "utils")):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        monkeypatch.setitem(sys.modules, name, package)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # install()'s import hook leaves with the test
    yield lambda: importlib.import_module(verl.TRACKING_MODULE)
    sys.modules.pop(verl.TRACKING_MODULE, None)


def test_verl_tracking_gets_an_rlpulse_backend_from_install(verl_tracking_module, tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "exp.jsonl"))
    monkeypatch.setenv("RANK", "3")  # verl builds Tracking in the one process that logs: rank 0 whatever the env says
    monkeypatch.setenv("WORLD_SIZE", "8")
    transport = InMemoryTransport()
    verl.install(transport=transport, settings=SETTINGS)  # before verl imports its tracking module, as a Ray hook runs
    tracking_module = verl_tracking_module()
    assert "rlpulse" in tracking_module.Tracking.supported_backend
    config = {"actor_rollout_ref": {}, "trainer": {"logger": ["file", "rlpulse"]}}
    tracking = tracking_module.Tracking(project_name="math", experiment_name="ppo-7",
                                        default_backend=["file", "rlpulse"], config=config)
    tracking.log(data=VALIDATION_0, step=0)
    tracking.log(data=STEP_3, step=3)
    tracking.finish(exit_code=0)  # what verl's TaskRunner does after fit()
    records = steps(transport)
    assert [(r["type"], r["step"], r["status"]) for r in records] == [
        ("RUN_START", -1, None), ("METRICS", 0, None), ("STEP", 3, None), ("RUN_END", -1, "finished")]
    assert {(r["project"], r["run_id"], r["trainer"]) for r in records} == {("math", "ppo-7", "rl")}
    assert records[2]["metrics"] == as_floats(STEP_3) and records[2]["duration_s"] == 30.25

    replayed = InMemoryTransport()  # verl's own FileLogger wrote the same dicts: the file route gives the same records
    with telemetry(replayed) as tel:
        assert verl.replay_file(tmp_path / "exp.jsonl", tel) == 2
    assert [(r["type"], r["step"], r["metrics"]) for r in steps(replayed)[1:-1]] == [
        (r["type"], r["step"], r["metrics"]) for r in records[1:-1]]


def test_verl_tracking_sends_the_whole_config_verl_hands_it_as_the_runs_settings(verl_tracking_module):
    """verl's PPO trainer builds its Tracking with ``config=OmegaConf.to_container(self.config, resolve=True)``:
    here verl's own full PPO config (its ``_generated_ppo_trainer.yaml``, read as YAML, so interpolations stay
    as their text: no omegaconf in this venv)."""
    yaml = pytest.importorskip("yaml")
    transport = InMemoryTransport()
    verl.install(transport=transport, settings=SETTINGS)
    tracking_module = verl_tracking_module()
    source = Path(tracking_module.__file__).parents[1] / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    config = yaml.safe_load(source.read_text())
    config["trainer"]["logger"] = ["rlpulse"]
    tracking = tracking_module.Tracking(project_name="math", experiment_name="ppo-7", default_backend=["rlpulse"],
                                        config=config)
    tracking.finish(exit_code=0)
    starts = [r["config"] for r in transport.records("steps") if r["type"] == "RUN_START"]
    assert len(starts) == 1 and starts[0] == flatten_config(config)
    settings = starts[0]
    assert len(settings) > 800 and not [k for k in settings if k.startswith("_rlpulse.")]  # every one, none cut
    assert {k: settings[k] for k in ("actor_rollout_ref.model.path", "actor_rollout_ref.actor.optim.lr",
                                     "algorithm.adv_estimator", "data.train_batch_size", "trainer.logger")} == {
        "actor_rollout_ref.model.path": "~/models/deepseek-llm-7b-chat", "actor_rollout_ref.actor.optim.lr": "1e-06",
        "algorithm.adv_estimator": "gae", "data.train_batch_size": "1024", "trainer.logger": '["rlpulse"]'}


def test_verl_tracking_failed_run_and_other_backends(verl_tracking_module, tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "exp.jsonl"))
    tracking_module = verl_tracking_module()  # imported first: install() patches it at once
    with pytest.raises(AssertionError, match="rlpulse is not supported"):  # no hook in this process: verl says so
        tracking_module.Tracking(project_name="math", experiment_name="ppo-7", default_backend=["rlpulse"])
    transport = InMemoryTransport()
    verl.install(transport=transport, settings=SETTINGS)
    verl.install(transport=transport, settings=SETTINGS)  # twice: patched once
    plain = tracking_module.Tracking(project_name="math", experiment_name="ppo-7", default_backend=["file"])
    assert "rlpulse" not in plain.logger
    plain.finish()
    sft = tracking_module.Tracking(project_name="math", experiment_name="sft-1", default_backend="rlpulse",
                                   config={"trainer": {}, "model": {}})
    sft.log(data={"train/loss": 1.25, "train/global_tokens": 4096, "train/mfu": 0.2}, step=1)
    sft.finish(exit_code=1)  # verl's TaskRunner when fit() raised
    records = steps(transport)
    assert [(r["type"], r["trainer"], r["tokens"], r["mfu"], r["status"]) for r in records] == [
        ("RUN_START", "sft", 0, None, None), ("STEP", "sft", 4096, 0.2, None), ("RUN_END", "sft", 0, None, "failed")]


def test_patch_on_import_waits_for_the_module_and_patches_it_once(tmp_path, monkeypatch):
    (tmp_path / "rlpulse_probe_pkg").mkdir()
    (tmp_path / "rlpulse_probe_pkg" / "__init__.py").write_text("")
    (tmp_path / "rlpulse_probe_pkg" / "target.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    seen = []
    metrics_dict.patch_on_import("rlpulse_probe_pkg.target", lambda module: seen.append(module.VALUE))
    assert seen == [] and "rlpulse_probe_pkg.target" not in sys.modules  # nothing imported by the hook itself
    try:
        module = importlib.import_module("rlpulse_probe_pkg.target")
        assert seen == [1]
        metrics_dict.patch_on_import("rlpulse_probe_pkg.target", lambda module: seen.append(2))  # already imported
        assert seen == [1, 2] and module.VALUE == 1
    finally:
        for name in ("rlpulse_probe_pkg.target", "rlpulse_probe_pkg"):
            sys.modules.pop(name, None)
