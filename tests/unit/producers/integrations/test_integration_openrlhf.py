"""OpenRLHF's logs dict (``rlpulse.producers.integrations.openrlhf``).

What was tested against what:

* **OpenRLHF's own code, when OpenRLHF is installed** (``pip install openrlhf==0.11.2 --no-deps``):
  ``BasePPOTrainer.save_logs_and_checkpoints``, the method that hands each step's ``logs_dict`` to
  the trackers, is read from the installed module ``openrlhf.trainer.ppo_trainer`` and run as it
  is, on a stand-in trainer. Only that method: the module imports torch, ray and deepspeed at its
  top, and the trainer is a Ray actor on GPUs. Those tests skip where OpenRLHF is not installed.
* **Everywhere else, its documented shapes**: the ``logs_dict`` below has the keys OpenRLHF 0.11.2's
  PPO trainer builds (the actor's and critic's ``fit`` status, ``timing/*``, ``rollout/*`` and
  ``generated_samples``); a stand-in trainer has the attributes its trainer has (``args.logger``,
  ``wandb_logger``, ``tensorboard_logger``, ``train_step``) and calls its trackers as it does.

Every test checks the exact records an ``InMemoryTransport`` received.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.framework_sources import framework_sources
from rlpulse.producers.integrations import metrics_dict, openrlhf
from rlpulse.producers.sdk.memory import InMemoryTransport
from rlpulse.producers.sdk.telemetry import TrainingTelemetry
from rlpulse.base.settings import Settings

SETTINGS = Settings.load({"RLPULSE_TOPIC_PREFIX": "mem", "RLPULSE_HEARTBEAT_INTERVAL": "1h"})

# A PPO step's logs_dict as OpenRLHF 0.11.2 builds it (keys from its trainer, actor and critic; values made up).
LOGS_DICT = {
    "policy_loss": -0.021, "actor_lr": 5e-7, "actor_grad_norm": 0.64, "entropy_loss": 0.71,
    "ppo_clip_ratio": 0.0125, "ppo_kl": 0.0003, "kl": 0.0021, "logprobs_diff": 0.004,
    "reward": 0.375, "return": 0.371, "response_length": 412.5, "total_length": 610.0, "truncated": 0.0625,
    "critic_loss": 0.083, "values": 0.29, "critic_lr": 9e-6, "critic_grad_norm": 1.12,
    "timing/make_experience": 20.5, "timing/ppo_train": 31.25, "timing/broadcast": 2.0,
    "rollout/reward_mean": 0.375, "rollout/reward_std": 0.48, "rollout/response_length_mean": 412.5,
    "rollout/truncated_rate": 0.0625, "rollout/num_samples": 64.0,
    "timing/generation": 40.0, "timing/step_total": 93.75,
    "generated_samples": ["Question: 2+2? Answer: 4", 1.0],  # a text and its reward, for wandb's table
}
NUMBERS = {k: float(val) for k, val in LOGS_DICT.items() if k != "generated_samples"}
EVAL_LOGS = {"eval_gsm8k_pass1": 0.5, "eval_gsm8k_response_length_mean": 388.0, "eval_gsm8k_truncated_rate": 0.0,
             "eval_response_length_mean": 388.0, "eval_truncated_rate": 0.0, "eval_num_samples": 128.0}


def telemetry(transport: InMemoryTransport, **kwargs) -> TrainingTelemetry:
    return TrainingTelemetry("p", "r", settings=SETTINGS, transport=transport, **kwargs)


def steps(transport: InMemoryTransport) -> list[dict]:
    keep = ("type", "step", "step_count", "duration_s", "metrics", "status", "project", "run_id", "trainer")
    return [{k: r[k] for k in keep} for r in transport.records("steps") if r["type"] != "HEARTBEAT"]


class Recorder:
    """A tracker as OpenRLHF's TensorboardLogger is to the trainer: log_train, log_eval, close."""

    def __init__(self):
        self.calls: list[tuple] = []

    def log_train(self, global_step, logs_dict):
        self.calls.append(("train", global_step, dict(logs_dict)))

    def log_eval(self, global_step, logs_dict):
        self.calls.append(("eval", global_step, dict(logs_dict)))

    def close(self):
        self.calls.append(("close",))


def save_logs_and_checkpoints_of_openrlhf():
    """OpenRLHF's own method, read from its installed source without importing the module."""
    framework_sources("openrlhf")
    spec = importlib.util.find_spec("openrlhf")  # finds without importing anything of it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("OpenRLHF is not installed: pip install openrlhf==0.11.2 --no-deps")
    source = Path(list(spec.submodule_search_locations)[0], "trainer", "ppo_trainer" + ".py")
    tree = ast.parse(source.read_text(), str(source))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BasePPOTrainer")
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "save_logs_and_checkpoints")
    namespace: dict = {}
    exec(compile(ast.Module(body=[method], type_ignores=[]), str(source), "exec"), namespace)
    return namespace["save_logs_and_checkpoints"]


class Trainer:
    """The attributes of OpenRLHF's BasePPOTrainer that the integration touches, and its logging calls."""

    def __init__(self, tensorboard_logger=None, logging_steps=1, fail_at=None, project="openrlhf_train_ppo",
                 run_name="ppo_0101T12:00"):
        self.args = SimpleNamespace(logger=SimpleNamespace(logging_steps=logging_steps,
                                                           wandb=SimpleNamespace(project=project, run_name=run_name)),
                                    ckpt=SimpleNamespace(save_steps=float("inf")))  # what the trainer sets for -1
        self.wandb_logger = None
        self.tensorboard_logger = tensorboard_logger
        self.fail_at = fail_at

    def train_step(self, rollout_samples, global_step):
        if global_step == self.fail_at:
            raise rollout_samples
        return dict(LOGS_DICT), global_step + 1

    def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
        logs_dict = logs_dict or {}  # as OpenRLHF's, without the checkpoint half
        if global_step % self.args.logger.logging_steps == 0:
            if self.wandb_logger:
                self.wandb_logger.log_train(global_step, logs_dict)
            if self.tensorboard_logger:
                self.tensorboard_logger.log_train(global_step, logs_dict)

    def fit(self, steps, samples=None, evaluate_at=()):
        """The shape of PPOTrainer.fit: train_step, save_logs_and_checkpoints, evaluation, close."""
        global_step = 0
        for _ in range(steps):
            status, global_step = self.train_step(samples, global_step)
            self.save_logs_and_checkpoints(global_step, status, {"global_step": global_step})
            if global_step in evaluate_at and self.tensorboard_logger:
                self.tensorboard_logger.log_eval(global_step, EVAL_LOGS)
        if self.tensorboard_logger:
            self.tensorboard_logger.close()


def test_each_logged_step_is_a_step_with_every_number_of_logs_dict():
    transport = InMemoryTransport()
    inner = Recorder()
    with telemetry(transport) as tel:
        trainer = Trainer(tensorboard_logger=inner)
        logger = openrlhf.attach(trainer, tel)
        assert trainer.tensorboard_logger is logger and logger.inner is inner
        trainer.fit(steps=2, evaluate_at=(2,))
        assert logger.publisher.skipped == {"non-numeric": 2}  # generated_samples, each step
    records = steps(transport)
    # the second RUN_START: the trainer's args, given once the run had started (attach to a started telemetry)
    assert [(r["type"], r["step"], r["step_count"], r["status"]) for r in records] == [
        ("RUN_START", -1, 0, None), ("RUN_START", -1, 0, None), ("STEP", 1, 1, None), ("STEP", 2, 2, None),
        ("METRICS", 2, 2, None), ("RUN_END", -1, 2, "finished")]
    assert records[2]["metrics"] == NUMBERS and records[2]["duration_s"] == 93.75
    assert records[4]["metrics"] == EVAL_LOGS
    assert records[2]["metrics"]["ppo_clip_ratio"] == 0.0125 and records[2]["metrics"]["rollout/truncated_rate"] == 0.0625
    # TensorBoard still gets every call, the samples included
    assert [c[:2] for c in inner.calls] == [("train", 1), ("train", 2), ("eval", 2), ("close",)]
    assert inner.calls[0][2]["generated_samples"] == LOGS_DICT["generated_samples"]


def test_the_trackers_are_called_only_every_logging_steps():
    transport = InMemoryTransport()
    with telemetry(transport) as tel:
        trainer = Trainer(logging_steps=2)
        openrlhf.attach(trainer, tel)
        trainer.fit(steps=5)
    assert [(r["type"], r["step"]) for r in steps(transport)][2:-1] == [("STEP", 2), ("STEP", 4)]  # after both RUN_STARTs


def test_log_takes_logs_dict_then_global_step():
    transport = InMemoryTransport()
    with telemetry(transport) as tel:
        logger = openrlhf.OpenRLHFLogger(tel)
        logger.log({"policy_loss": 0.5, "bad": float("nan")}, 7)
        assert logger.publisher.skipped == {"non-finite": 1}
    assert [(r["type"], r["step"], r["metrics"]) for r in steps(transport)][1:-1] == [("STEP", 7, {"policy_loss": 0.5})]


@pytest.mark.parametrize("error, status", [(RuntimeError("CUDA out of memory"), "failed"),
                                           (KeyboardInterrupt(), "cancelled")])
def test_a_train_step_that_raises_ends_the_run_with_its_status(error, status):
    transport = InMemoryTransport()
    tel = telemetry(transport)
    tel.start()
    trainer = Trainer(fail_at=1)
    openrlhf.attach(trainer, tel, owns_telemetry=True)
    with pytest.raises(type(error)):
        trainer.fit(steps=3, samples=error)  # step 1 is logged, the second train_step raises
    assert [(r["type"], r["step"], r["status"]) for r in steps(transport)] == [
        ("RUN_START", -1, None), ("RUN_START", -1, None), ("STEP", 1, None), ("RUN_END", -1, status)]


def test_install_attaches_to_every_trainer_built_with_the_run_of_its_wandb_names(monkeypatch):
    monkeypatch.setenv("RANK", "5")  # the PPO trainer is OpenRLHF's single controller: rank 0 whatever the env says
    monkeypatch.setenv("WORLD_SIZE", "8")
    transport = InMemoryTransport()

    class BasePPOTrainer(Trainer):  # a fresh class per test: register patches the class it is given
        pass

    openrlhf.register(BasePPOTrainer, dict(transport=transport, settings=SETTINGS))
    openrlhf.register(BasePPOTrainer, dict(transport=transport, settings=SETTINGS))  # twice: patched once
    trainer = BasePPOTrainer(run_name="grpo-math-3", project="math")
    assert isinstance(trainer.tensorboard_logger, openrlhf.OpenRLHFLogger)
    trainer.fit(steps=1)  # fit closes its trackers: RUN_END finished
    records = steps(transport)
    assert [(r["type"], r["project"], r["run_id"], r["status"]) for r in records] == [
        ("RUN_START", "math", "grpo-math-3", None), ("STEP", "math", "grpo-math-3", None),
        ("RUN_END", "math", "grpo-math-3", "finished")]


def hierarchize_of_openrlhf():
    """OpenRLHF's own ``openrlhf.utils.config.hierarchize``, which its PPO launcher (``openrlhf.cli.train_ppo_ray``)
    makes its args with, loaded from its installed source file alone (the package's ``__init__`` imports torch)."""
    framework_sources("openrlhf")
    spec = importlib.util.find_spec("openrlhf")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("OpenRLHF is not installed: pip install openrlhf==0.11.2 --no-deps")
    path = Path(list(spec.submodule_search_locations)[0], "utils", "config.py")
    module_spec = importlib.util.spec_from_file_location("openrlhf_utils_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.hierarchize


# Flags of the parser of OpenRLHF 0.11.2's openrlhf.cli.train_ppo_ray (their argparse dests; values made up).
FLAGS = {"actor.model_name_or_path": "Qwen/Qwen2.5-0.5B", "rollout.batch_size": 1024, "rollout.n_samples_per_prompt": 8,
         "algo.kl.init_coef": 0.01, "ckpt.save_steps": -1, "logger.logging_steps": 1, "logger.wandb.key": "wandb-secret",
         "logger.wandb.project": "math", "logger.wandb.run_name": "grpo-1", "use_ms": False}


def run_starts(transport: InMemoryTransport) -> list[dict]:
    return [r["config"] for r in transport.records("steps") if r["type"] == "RUN_START"]


def test_the_trainers_args_as_openrlhf_builds_them_are_the_runs_settings():
    args = hierarchize_of_openrlhf()(argparse.Namespace(**FLAGS))
    transport = InMemoryTransport()

    class BasePPOTrainer(Trainer):
        def __init__(self):
            super().__init__()
            self.args = args  # as OpenRLHF's trainer keeps the args it was built with

    openrlhf.register(BasePPOTrainer, dict(transport=transport, settings=SETTINGS))
    BasePPOTrainer().fit(steps=1)
    assert run_starts(transport) == [{
        "actor.model_name_or_path": "Qwen/Qwen2.5-0.5B", "rollout.batch_size": "1024", "rollout.n_samples_per_prompt": "8",
        "algo.kl.init_coef": "0.01", "ckpt.save_steps": "-1", "logger.logging_steps": "1", "logger.wandb.key": "***",
        "logger.wandb.project": "math", "logger.wandb.run_name": "grpo-1", "use_ms": "false"}]


def test_attach_to_a_started_run_sends_the_trainers_args_on_a_second_run_start():
    transport = InMemoryTransport()
    with telemetry(transport) as tel:
        openrlhf.attach(Trainer(project="math", run_name="grpo-1"), tel)
    assert run_starts(transport) == [{}, {"logger.logging_steps": "1", "logger.wandb.project": "math",
                                          "logger.wandb.run_name": "grpo-1", "ckpt.save_steps": "inf"}]


def test_a_run_name_the_sdk_refuses_leaves_training_untouched(caplog):
    class BasePPOTrainer(Trainer):
        pass

    openrlhf.register(BasePPOTrainer, dict(transport=InMemoryTransport(), settings=SETTINGS))
    trainer = BasePPOTrainer(run_name="x" * 300)
    assert trainer.tensorboard_logger is None and "no telemetry for this OpenRLHF run" in caplog.text
    trainer.fit(steps=1)


def test_rank_comes_from_torchrun_variables():
    assert metrics_dict.rank_from_env({}) == (0, 1)
    assert metrics_dict.rank_from_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}) == (2, 4)
    assert metrics_dict.rank_from_env({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == (1, 2)
    assert metrics_dict.rank_from_env({"RANK": "3"}) == (3, 4)  # a launcher that sets RANK alone


def test_a_rank_other_than_0_publishes_no_steps(monkeypatch):
    # the recipe's telemetry_for, for a framework whose logger runs on every rank
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    transport = InMemoryTransport()
    with metrics_dict.telemetry_for("p", "r", settings=SETTINGS, transport=transport) as tel:
        assert (tel.rank, tel.world_size) == (1, 2)
        openrlhf.OpenRLHFLogger(tel).log_train(1, LOGS_DICT)
    assert steps(transport) == []


# -- OpenRLHF's own code, when OpenRLHF is installed ---------------------------------------------
def test_openrlhf_save_logs_and_checkpoints_hands_logs_dict_to_the_logger():
    save_logs_and_checkpoints = save_logs_and_checkpoints_of_openrlhf()
    transport = InMemoryTransport()
    inner = Recorder()
    with telemetry(transport) as tel:
        trainer = Trainer(tensorboard_logger=inner, logging_steps=2)
        openrlhf.attach(trainer, tel)
        for global_step in (1, 2, 3, 4):
            save_logs_and_checkpoints(trainer, global_step, dict(LOGS_DICT), {"global_step": global_step})
        save_logs_and_checkpoints(trainer, 6)  # no logs_dict: OpenRLHF passes {}
    records = steps(transport)
    assert [(r["type"], r["step"]) for r in records][2:-1] == [("STEP", 2), ("STEP", 4), ("STEP", 6)]  # after both RUN_STARTs
    assert records[2]["metrics"] == NUMBERS and records[4]["metrics"] == {}
    assert [c[:2] for c in inner.calls] == [("train", 2), ("train", 4), ("train", 6)]
