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

The run is ``--logger.wandb.project`` / ``--logger.wandb.run_name``; its settings (RUN_START's ``config``)
are the trainer's ``args`` (nested namespaces, as OpenRLHF's ``hierarchize`` builds them from
``--actor.adam.lr``-style flags: dotted names again; ``logger.wandb.key`` as ``***``). In a script
of your own that holds a trainer object, ``attach(trainer, tel)`` does the same.

Step mapping: the step is OpenRLHF's ``global_step`` as it logs it (``train_step`` returns
``global_step + 1``, so the first update is step 1). ``log_train`` completes its step (STEP) with
``timing/step_total`` as its duration; ``log_eval`` sends the evaluation's figures
(``eval_<source>_pass1``, ...) as METRICS of its step. Every number of the dict is a metric under
its key in ``logs_dict`` (what wandb shows without its ``train/``/``eval/`` prefix);
``generated_samples`` (a text and its reward) is not a number and is skipped and counted. The
trainer logs every ``--logger.logging_steps`` steps (1 by default): the steps between are not sent.
``rollout/truncated_rate`` and ``truncated`` are the share of generations cut at the length limit
(truncation, the seed's clipped ratio); ``ppo_clip_ratio`` is PPO's ratio clipping.

Prompts and completions (content switch on: ``install(content=True)`` or ``RLPULSE_TRACE_CONTENT=1``):
``generated_samples`` is one text a step (``train_step`` decodes ``experiences[0].sequences[0]``, prompt and
completion in one string, with its reward), so the rollouts are read where it is drawn from: the
experiences ``experience_maker.make_experience_batch(rollout_samples)`` returns inside ``train_step``
(``openrlhf.trainer.ppo_trainer``). Each row gets a ROLLOUT span ``s<step>-<i>`` (``i`` its index in the
batch, sample ``s<step>-p<i // n_samples_per_prompt>``, reward ``info["reward"]``, length and truncation as
OpenRLHF counts them; OpenRLHF publishes none of its own) and an LLM span ``openrlhf.generate``: its prompt
(``prompts``) and its completion (the action tokens of ``sequences``, decoded by the trainer's tokenizer),
timed by ``samples_generator.generate_samples`` where the trainer calls it (``rlpulse.producers.integrations.completions``).

RUN_END: finished when ``fit`` closes its trackers; failed (or cancelled, for an interrupt) when
``train_step`` raises: experience making, the PPO update and the weight broadcast. A crash
elsewhere (generation in ``fit`` itself) sends no RUN_END, which the pipeline reads as a job that
died silent rather than one that finished.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any
from collections.abc import Mapping

from rlpulse.producers.integrations.completions import (DEFAULT_CONTENT_LIMIT, Completion, CompletionPublisher,
                                                        Generations, completion_publisher, finite, scalars)
from rlpulse.producers.integrations.metrics_dict import MetricsPublisher, patch_on_import, send_settings, telemetry_for
from rlpulse.producers.sdk.process import run_status
from rlpulse.producers.sdk.telemetry import TrainingTelemetry

log = logging.getLogger(__name__)

TRAINER_MODULE = "openrlhf.trainer.ppo_trainer"
DURATION_KEY = "timing/step_total"
CONTENT_OPTIONS = ("content", "content_limit", "token_ids")


class OpenRLHFLogger:
    """An OpenRLHF tracker (``log_train``, ``log_eval``, ``close``) publishing through ``telemetry``.

    ``inner``: the tracker it stands in for, called first with the same arguments. Truthy even
    without one, since the trainer tests ``if self.tensorboard_logger:`` before each call."""

    def __init__(self, telemetry: TrainingTelemetry, owns_telemetry: bool = False, inner: Any = None,
                 completions: CompletionPublisher | None = None):
        self.publisher = MetricsPublisher(telemetry, owns_telemetry=owns_telemetry)
        self.inner = inner
        self.completions = completions  # None: content off, no rollout text (and no rollouts) sent
        self.generations = Generations()  # samples_generator.generate_samples, timed

    def experiences(self, step: int, experiences: list[Any], tokenizer: Any, n_samples_per_prompt: int = 1,
                    start_ns: int | None = None, end_ns: int | None = None) -> int:
        """Publish the rollouts of ``experiences`` (OpenRLHF ``Experience`` batches after ``make_experience_batch``):
        a ROLLOUT and an LLM span each. A row without a finite reward is left out (logged). Returns LLM spans sent."""
        if self.completions is None or self.publisher.closed:
            return 0
        rollouts, seen = [], 0
        for exp in experiences:
            rows, masks = _rows(exp.sequences), _rows(exp.action_mask)  # (B, T) and (B, T - 1)
            prompts, index = list(exp.prompts or ()), list(exp.index or ())
            info = exp.info or {}
            rewards = scalars(info["reward"] if info.get("reward") is not None else exp.rewards)
            lengths, truncated = scalars(exp.response_length), scalars(exp.truncated)
            for j, ids in enumerate(rows):
                i = int(index[j]) if j < len(index) else seen + j
                acted = [k for k, m in enumerate(masks[j] if j < len(masks) else ()) if m]
                # action_mask[k] marks sequences[k + 1]: the response is sequences[first + 1 : last + 2]
                cut = (acted[0] + 1, acted[-1] + 2) if acted else (len(ids), len(ids))
                response = ids[cut[0]:cut[1]]
                fields: dict[str, Any] = {
                    "reward": finite(rewards[j]) if j < len(rewards) else None,
                    "sample_id": f"s{step}-p{i // n_samples_per_prompt}",
                    "completion_tokens": int(lengths[j]) if j < len(lengths) else len(response),
                    "finish_reason": ("length" if truncated[j] else "stop") if j < len(truncated) else None}
                text = tokenizer.decode(response, skip_special_tokens=True)
                rollouts.append((Completion(f"s{step}-{i}", prompts[j] if j < len(prompts) else "", text, cut[0],
                                            fields["completion_tokens"], ids[:cut[0]], response, fields["finish_reason"]),
                                 fields))
            seen += len(rows)
        return self.completions.publish_with_rollouts(step, rollouts, start_ns, end_ns)

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


def _rows(value: Any) -> list[Any]:
    return [] if value is None else value.tolist() if hasattr(value, "tolist") else [list(row) for row in value]


def attach(trainer: Any, telemetry: TrainingTelemetry, owns_telemetry: bool = False, content: bool | None = None,
           content_limit: int = DEFAULT_CONTENT_LIMIT, token_ids: bool = False) -> OpenRLHFLogger:
    """Put an ``OpenRLHFLogger`` in ``trainer.tensorboard_logger`` (the tracker there stays its
    ``inner``) and end the telemetry's run on an exception out of ``trainer.train_step``.

    ``fit`` calls ``self.train_step``, so an attribute of the instance replaces the method for it:
    the class is left alone. ``owns_telemetry``: RUN_END is this logger's to send (``install``);
    otherwise the telemetry's owner ends it and ``close``/``fail`` end only the publishing.
    ``content`` (None: ``RLPULSE_TRACE_CONTENT``): also each rollout's prompt and completion (the module
    docstring says from where), each content attribute at most ``content_limit`` characters."""
    args = getattr(trainer, "args", None)
    send_settings(telemetry, args, "OpenRLHF")  # install's telemetry has them already (its first RUN_START)
    model = getattr(getattr(args, "actor", None), "model_name_or_path", None)
    completions = completion_publisher(telemetry, "openrlhf.generate", content, content_limit, token_ids,
                                       model if isinstance(model, str) else None)
    logger = OpenRLHFLogger(telemetry, owns_telemetry=owns_telemetry, inner=getattr(trainer, "tensorboard_logger", None),
                            completions=completions)
    trainer.tensorboard_logger = logger
    train_step = trainer.train_step
    made: list[Any] = []  # the experiences make_experience_batch returned in this train_step
    maker: Any = getattr(trainer, "experience_maker", None)
    generator: Any = getattr(trainer, "samples_generator", None)
    if completions is not None and callable(getattr(maker, "make_experience_batch", None)):
        make = maker.make_experience_batch

        @functools.wraps(make)
        def make_experience_batch(*a: Any, **kw: Any) -> Any:
            experiences = make(*a, **kw)
            made.append(experiences)
            return experiences

        maker.make_experience_batch = make_experience_batch
        if callable(getattr(generator, "generate_samples", None)):
            generator.generate_samples = logger.generations.timed(generator.generate_samples, lambda out: (out[0], None))

    @functools.wraps(train_step)
    def train_step_(*args: Any, **kwargs: Any) -> Any:
        called = time.time_ns()
        made.clear()
        try:
            result = train_step(*args, **kwargs)
        except BaseException as exc:
            logger.fail(type(exc))
            raise
        if made:
            _publish_rollouts(trainer, logger, result, made, args[0] if args else kwargs.get("rollout_samples"), called)
        return result

    trainer.train_step = train_step_
    return logger


def _publish_rollouts(trainer: Any, logger: OpenRLHFLogger, result: Any, made: list[Any], samples: Any, called: int) -> None:
    try:
        n = int(getattr(getattr(trainer.args, "rollout", None), "n_samples_per_prompt", 1) or 1)
        _, start, end = logger.generations.of(samples)
        logger.experiences(int(result[1]), [e for batch in made for e in batch], trainer.tokenizer, n,
                           start if start is not None else called, end if end is not None else called)
    except Exception:  # telemetry never stops training
        log.exception("rlpulse could not publish the rollouts of an OpenRLHF step")
    finally:
        made.clear()


def install(project: str | None = None, run_id: str | None = None, attempt: int = 1, content: bool | None = None,
            content_limit: int = DEFAULT_CONTENT_LIMIT, token_ids: bool = False, **telemetry_kwargs: Any) -> None:
    """Attach an ``OpenRLHFLogger`` to every PPO trainer built in this process (a Ray
    ``worker_process_setup_hook``; harmless in processes that build none).

    Its ``TrainingTelemetry``: ``project`` or ``--logger.wandb.project``, ``run_id`` or
    ``--logger.wandb.run_name``, rank 0 (the trainer is OpenRLHF's single controller, one process);
    ``telemetry_kwargs`` go to ``TrainingTelemetry``; ``content``, ``content_limit`` and ``token_ids`` to
    ``attach``. The class is patched once OpenRLHF imports it, never before
    (``rlpulse.producers.integrations.metrics_dict.patch_on_import`` says why)."""
    options = dict(project=project, run_id=run_id, attempt=attempt, content=content, content_limit=content_limit,
                   token_ids=token_ids, **telemetry_kwargs)
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
            send_settings(telemetry, getattr(self, "args", None), "OpenRLHF")  # before start: on the first RUN_START
            telemetry.start()
        except Exception:  # a name the SDK refuses, a bad setting: the training runs on without telemetry
            log.exception("rlpulse: no telemetry for this OpenRLHF run")
            return
        content = {k: trainer_class._rlpulse_options[k] for k in CONTENT_OPTIONS if k in trainer_class._rlpulse_options}
        try:
            attach(self, telemetry, owns_telemetry=True, **content)
        except ValueError:  # a bad content switch or limit: the figures still go out, without text
            log.exception("rlpulse: no rollout text for this OpenRLHF run")
            attach(self, telemetry, owns_telemetry=True, content=False)

    trainer_class.__init__ = __init__


def _telemetry(options: Mapping[str, Any], args: Any) -> TrainingTelemetry:
    wandb = getattr(getattr(args, "logger", None), "wandb", None)
    kwargs = {k: val for k, val in options.items() if k not in ("project", "run_id", *CONTENT_OPTIONS)}
    kwargs.setdefault("rank", 0)
    kwargs.setdefault("world_size", 1)
    project = options.get("project") or getattr(wandb, "project", None)
    run_id = options.get("run_id") or getattr(wandb, "run_name", None)
    if project is None or run_id is None:
        raise ValueError("no run to publish to: set --logger.wandb.project and --logger.wandb.run_name, or install() them")
    return telemetry_for(project, run_id, **kwargs)
