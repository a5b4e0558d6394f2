"""verl's training rollouts, from the dump its PPO trainers write (``trainer.rollout_data_dir``), to the backend
of ``rlpulse.producers.integrations.verl`` that has content on."""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
from typing import Any
from collections.abc import Mapping

from rlpulse.producers.integrations.completions import scalars

log = logging.getLogger(__name__)

TRAINER_MODULES = {"verl.trainer.ppo.ray_trainer": "RayPPOTrainer", "verl.trainer.ppo.v1.trainer_base": "PPOTrainer"}
current_backends: list[Any] = []  # the VerlLogger publishing this process's rollouts: the last one attached with content on
_dumping: contextvars.ContextVar[dict[str, list[Any]] | None] = contextvars.ContextVar("rlpulse_verl_dump", default=None)


def register_trainer_of(name: str, module: Any) -> None:
    register_trainer(getattr(module, name))


def register_trainer(trainer_class: Any) -> None:
    """Patch a verl PPO trainer class's ``_log_rollout_data`` (the training rollouts' dump; ``trainer.rollout_data_dir``)
    and ``_dump_generations`` (what it calls with the decoded texts) so that each training dump's rollouts go
    to this process's backend with content on (``attach``); idempotent. Validation dumps pass untouched."""
    if getattr(trainer_class, "_rlpulse_dumps", False):
        return
    trainer_class._rlpulse_dumps = True
    log_data, dump = trainer_class._log_rollout_data, trainer_class._dump_generations
    signature = inspect.signature(dump)

    @functools.wraps(log_data)
    def _log_rollout_data(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        token = _dumping.set(_batch_facts(batch) if current_backends else None)
        try:
            return log_data(self, batch, *args, **kwargs)
        finally:
            _dumping.reset(token)

    @functools.wraps(dump)
    def _dump_generations(self: Any, *args: Any, **kwargs: Any) -> Any:
        facts = _dumping.get()
        if facts is not None and current_backends:
            try:
                given = signature.bind(self, *args, **kwargs).arguments
                _publish_dump(self, current_backends[-1], given, facts)
            except Exception:  # telemetry never stops training
                log.exception("rlpulse could not publish a verl rollout dump")
        return dump(self, *args, **kwargs)

    trainer_class._log_rollout_data, trainer_class._dump_generations = _log_rollout_data, _dump_generations


def _publish_dump(trainer: Any, backend: Any, given: Mapping[str, Any], facts: dict[str, list[Any]]) -> None:
    extra = given.get("reward_extra_infos_dict") or {}
    if "sample_ids" not in facts and "uid" in extra:  # v1: the transfer queue's keys, {uid}_{session}_{index}
        facts["sample_ids"] = [str(key).rsplit("_", 2)[0] for key in scalars(extra["uid"])]
    try:
        max_tokens = int(trainer.config.actor_rollout_ref.rollout.response_length)
    except (AttributeError, KeyError, TypeError, ValueError):
        max_tokens = None
    backend.generations(int(trainer.global_steps), list(given["inputs"]), list(given["outputs"]),
                        scalars(given["scores"]), facts, max_tokens)


def _batch_facts(batch: Any) -> dict[str, list[Any]]:
    """What a legacy trainer's ``DataProto`` batch tells of each rollout: its sample (``uid``), and from the
    attention mask its prompt and response lengths and ids. A v1 batch (transfer-queue keys) tells nothing here."""
    facts: dict[str, list[Any]] = {}
    try:
        non_tensor = getattr(batch, "non_tensor_batch", None) or {}
        if "uid" in non_tensor:
            facts["sample_ids"] = scalars(non_tensor["uid"])
        tensors: Any = getattr(batch, "batch", None)
        keys = set(tensors.keys()) if tensors is not None else set()
        if {"prompts", "responses", "attention_mask"} <= keys:
            prompts, mask = tensors["prompts"], tensors["attention_mask"]
            width = prompts.shape[-1]
            facts["input_tokens"] = scalars(mask[:, :width].sum(-1))
            facts["output_tokens"] = scalars(mask[:, width:].sum(-1))
            if current_backends and current_backends[-1].completions is not None and current_backends[-1].completions.token_ids:
                rows = mask.tolist()
                facts["prompt_ids"] = [[t for t, m in zip(ids, row[:width]) if m] for ids, row in zip(prompts.tolist(), rows)]
                facts["response_ids"] = [[t for t, m in zip(ids, row[width:]) if m]
                                         for ids, row in zip(tensors["responses"].tolist(), rows)]
    except Exception:  # another version's batch: the texts still go out, without these
        log.debug("rlpulse: a verl batch of an unknown shape", exc_info=True)
    return facts
