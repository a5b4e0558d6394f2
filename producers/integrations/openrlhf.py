"""OpenRLHF (0.11.2): its PPO trainer's logs dict, through the tracker interface it already calls.

OpenRLHF's PPO trainer (``openrlhf.trainer.ppo_trainer.BasePPOTrainer``, run as one Ray actor:
the single controller; with ``--train.async_enable`` its subclass ``TrainingActor``) builds a
``logs_dict`` per step (``status`` in ``fit``) and hands it to ``save_logs_and_checkpoints(
global_step, logs_dict, client_states)``, which passes it to its trackers, ``wandb_logger`` and
``tensorboard_logger``: objects with ``log_train(global_step, logs_dict)``, ``log_eval(global_step,
logs)`` and ``close()``. ``OpenRLHFLogger`` is such a tracker. It takes the ``tensorboard_logger``
slot and forwards every call to the tracker that held it, so TensorBoard still works. In a launch
through ``ray job submit``, one field of the runtime env installs it in the trainer's actor::

    ray job submit --runtime-env-json='{"worker_process_setup_hook": "rlpulse.producers.integrations.openrlhf.install"}' \\
        -- python3 -m openrlhf.cli.train_ppo_ray ...

The run is ``--logger.wandb.project`` / ``--logger.wandb.run_name``. In a script of your own that
holds a trainer object, ``attach(trainer, tel)`` does the same.

Step mapping: the step is OpenRLHF's ``global_step`` as it logs it (``train_step`` returns
``global_step + 1``, so the first update is step 1). ``log_train`` completes its step (STEP) with
``timing/step_total`` as its duration; ``log_eval`` sends the evaluation's figures
(``eval_<source>_pass1``, ...) as METRICS of its step. Every number of the dict is a metric under
its key in ``logs_dict`` (what wandb shows without its ``train/``/``eval/`` prefix);
``generated_samples`` (a text and its reward) is not a number and is skipped and counted. The
trainer logs every ``--logger.logging_steps`` steps (1 by default): the steps between are not sent.
``rollout/truncated_rate`` and ``truncated`` are the share of generations cut at the length limit
(truncation, the seed's clipped ratio); ``ppo_clip_ratio`` is PPO's ratio clipping.

RUN_END: finished when ``fit`` closes its trackers; failed (or cancelled, for an interrupt) when
``train_step`` raises: experience making, the PPO update and the weight broadcast. A crash
elsewhere (generation in ``fit`` itself) sends no RUN_END, which the pipeline reads as a job that
died silent rather than one that finished.
"""

from __future__ import annotations

import functools
import logging
from typing import Any
from collections.abc import Mapping

from rlpulse.producers.integrations.metrics_dict import MetricsPublisher, patch_on_import, telemetry_for
from rlpulse.producers.sdk.process import run_status
from rlpulse.producers.sdk.telemetry import TrainingTelemetry

log = logging.getLogger(__name__)

TRAINER_MODULE = "openrlhf.trainer.ppo_trainer"
DURATION_KEY = "timing/step_total"


class OpenRLHFLogger:
    """An OpenRLHF tracker (``log_train``, ``log_eval``, ``close``) publishing through ``telemetry``.

    ``inner``: the tracker it stands in for, called first with the same arguments. Truthy even
    without one, since the trainer tests ``if self.tensorboard_logger:`` before each call."""

    def __init__(self, telemetry: TrainingTelemetry, owns_telemetry: bool = False, inner: Any = None):
        self.publisher = MetricsPublisher(telemetry, owns_telemetry=owns_telemetry)
        self.inner = inner

    def __bool__(self) -> bool:
        return True

    def log_train(self, global_step: int, logs_dict: Mapping[str, Any]) -> None:
        if self.inner:
            self.inner.log_train(global_step, logs_dict)
        self.publisher.step(global_step, logs_dict, duration_s=logs_dict.get(DURATION_KEY))

    def log_eval(self, global_step: int, logs_dict: Mapping[str, Any]) -> None:
        if self.inner:
            self.inner.log_eval(global_step, logs_dict)
        self.publisher.scalars(global_step, logs_dict)

    def log(self, logs_dict: Mapping[str, Any], global_step: int) -> None:
        """A training step's ``logs_dict`` (``log_train`` with the arguments the other way round)."""
        self.log_train(global_step, logs_dict)

    def close(self) -> None:
        """The trainer's end of ``fit``: closes the tracker it stands in for; RUN_END finished."""
        try:
            if self.inner:
                self.inner.close()
        finally:
            self.publisher.close(status="finished")

    def fail(self, exc_type: type[BaseException]) -> None:
        """The run stopped on ``exc_type``: RUN_END failed, or cancelled for an interrupt."""
        self.publisher.close(status=run_status(exc_type))


def attach(trainer: Any, telemetry: TrainingTelemetry, owns_telemetry: bool = False) -> OpenRLHFLogger:
    """Put an ``OpenRLHFLogger`` in ``trainer.tensorboard_logger`` (the tracker there stays its
    ``inner``) and end the telemetry's run on an exception out of ``trainer.train_step``.

    ``fit`` calls ``self.train_step``, so an attribute of the instance replaces the method for it:
    the class is left alone. ``owns_telemetry``: RUN_END is this logger's to send (``install``);
    otherwise the telemetry's owner ends it and ``close``/``fail`` end only the publishing."""
    logger = OpenRLHFLogger(telemetry, owns_telemetry=owns_telemetry, inner=getattr(trainer, "tensorboard_logger", None))
    trainer.tensorboard_logger = logger
    train_step = trainer.train_step

    @functools.wraps(train_step)
    def train_step_(*args: Any, **kwargs: Any) -> Any:
        try:
            return train_step(*args, **kwargs)
        except BaseException as exc:
            logger.fail(type(exc))
            raise

    trainer.train_step = train_step_
    return logger


def install(project: str | None = None, run_id: str | None = None, attempt: int = 1, **telemetry_kwargs: Any) -> None:
    """Attach an ``OpenRLHFLogger`` to every PPO trainer built in this process (a Ray
    ``worker_process_setup_hook``; harmless in processes that build none).

    Its ``TrainingTelemetry``: ``project`` or ``--logger.wandb.project``, ``run_id`` or
    ``--logger.wandb.run_name``, rank 0 (the trainer is OpenRLHF's single controller, one process);
    ``telemetry_kwargs`` go to ``TrainingTelemetry``. The class is patched once OpenRLHF imports it,
    never before (``rlpulse.producers.integrations.metrics_dict.patch_on_import`` says why)."""
    options = dict(project=project, run_id=run_id, attempt=attempt, **telemetry_kwargs)
    patch_on_import(TRAINER_MODULE, lambda module: register(module.BasePPOTrainer, options))


def register(trainer_class: Any, options: Mapping[str, Any] | None = None) -> None:
    """Patch ``trainer_class.__init__`` (OpenRLHF's ``BasePPOTrainer``) as ``install`` describes; idempotent."""
    already = getattr(trainer_class, "_rlpulse_options", None) is not None
    trainer_class._rlpulse_options = dict(options or {})
    if already:
        return
    init = trainer_class.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        try:
            telemetry = _telemetry(trainer_class._rlpulse_options, getattr(self, "args", None))
            telemetry.start()
        except Exception:  # a name the SDK refuses, a bad setting: the training runs on without telemetry
            log.exception("rlpulse: no telemetry for this OpenRLHF run")
            return
        attach(self, telemetry, owns_telemetry=True)

    trainer_class.__init__ = __init__


def _telemetry(options: Mapping[str, Any], args: Any) -> TrainingTelemetry:
    wandb = getattr(getattr(args, "logger", None), "wandb", None)
    kwargs = {k: val for k, val in options.items() if k not in ("project", "run_id")}
    kwargs.setdefault("rank", 0)
    kwargs.setdefault("world_size", 1)
    project = options.get("project") or getattr(wandb, "project", None)
    run_id = options.get("run_id") or getattr(wandb, "run_name", None)
    if project is None or run_id is None:
        raise ValueError("no run to publish to: set --logger.wandb.project and --logger.wandb.run_name, or install() them")
    return telemetry_for(project, run_id, **kwargs)
