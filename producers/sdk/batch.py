"""``RolloutBatch``: a step's rollouts given a reward term at a time.

Trainers such as TRL call each reward function separately, over the whole batch of completions;
``TrainingTelemetry.rollout`` wants a rollout's total reward and every term at once. A batch
collects the terms (and each rollout's own fields) as they come and publishes one ROLLOUT span
per rollout when it closes, so the framework's glue needs no buffering of its own::

    with tel.rollouts(step=3, policy_version=3) as batch:
        for rid, r in zip(ids, format_rewards):
            batch.term(rid, "format", r)            # one reward function's weighted value
        for rid, r in zip(ids, accuracy_rewards):
            batch.term(rid, "accuracy", r)          # r None: its grader failed
        for rid, n, why in zip(ids, lengths, finish_reasons):
            batch.rollout(rid, completion_tokens=n, finish_reason=why)

A rollout's reward is the one given to ``rollout(..., reward=)``, else the sum of its terms.
A term whose grader failed (``term(rid, term, None)``, or ``failed(rid, term)``) counts as zero:
seed 001 has "a failed score counts as zero for its term, so a judge that times out or returns no
verdict lowers the reward". It is in ``term_shares`` with share 0.0, so the term's histogram and
share figures count that rollout, and adds nothing to the reward (TRL's ``nansum`` skips it
too). The failure's cause is the grader call's: ``TrainingTelemetry.grader(..., outcome=cause)``,
whose stored score stays null. Every call is checked when the batch publishes; a block left on an
exception publishes nothing and logs how many rollouts it held.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

FAILED_SHARE = 0.0  # a failed score counts as zero for its term (seed 001)


class RolloutBatch:
    """The rollouts of one step, published together by ``publish()`` or at the end of a ``with`` block."""

    def __init__(self, rollout: Callable[..., None], step: int, policy_version: int | None = None):
        # rollout: TrainingTelemetry.rollout, which checks every field as the batch publishes
        self._rollout, self.step, self.policy_version = rollout, step, policy_version
        self._terms: dict[str, dict[str, float]] = {}
        self._fields: dict[str, dict[str, Any]] = {}

    def term(self, rollout_id: str, term: str, share: float | None) -> None:
        """One term's weighted share of ``rollout_id``'s reward; None: its grader failed, the share is 0.0."""
        self._terms.setdefault(rollout_id, {})[term] = FAILED_SHARE if share is None else share
        self._fields.setdefault(rollout_id, {})

    def failed(self, rollout_id: str, term: str) -> None:
        """``term``'s grader failed on ``rollout_id``: the term counts as zero (``term(rollout_id, term, None)``)."""
        self.term(rollout_id, term, None)

    def rollout(self, rollout_id: str, **fields: Any) -> None:
        """``rollout_id``'s own fields: any keyword ``TrainingTelemetry.rollout`` takes but ``step``
        and ``term_shares`` (``reward``, ``completion_tokens``, ``finish_reason``, ``sample_id``, ...)."""
        for name in ("step", "rollout_id", "term_shares"):
            if name in fields:
                raise ValueError(f"{name} is the batch's to give, not rollout()'s")
        self._fields.setdefault(rollout_id, {}).update(fields)

    def __len__(self) -> int:
        return len(self._fields)

    def publish(self) -> int:
        """Publish one ROLLOUT span per rollout given; returns how many. The batch is empty after."""
        fields, terms = self._fields, self._terms
        self._fields, self._terms = {}, {}
        for rollout_id, own in fields.items():
            shares = terms.get(rollout_id, {})
            reward = own.pop("reward", None)
            if reward is None:
                reward = float(sum(shares.values()))
            own.setdefault("policy_version", self.policy_version)
            self._rollout(step=self.step, rollout_id=rollout_id, reward=reward, term_shares=shares, **own)
        return len(fields)

    def __enter__(self) -> RolloutBatch:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.publish()
        elif self._fields:
            log.warning("step %d: %d rollouts not published: the block that gathered them raised %s", self.step,
                        len(self._fields), exc_type.__name__)
