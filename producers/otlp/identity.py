"""Who an OTLP resource, span or data point belongs to: its attributes read as plain values, and
the run and attempt they name.

Identity comes from attributes, the most specific first: a data point's or span's own attribute,
then its scope's, then its resource's. Seed 001's names (``akka.optimize.training.*``) and
rlpulse's own (``rlpulse.*``) are both read; a job sets them as resource attributes, e.g.
``OTEL_RESOURCE_ATTRIBUTES=akka.optimize.training.run.id=r1,akka.optimize.training.run.attempt=1``.
A resource without a run id cannot be placed: the whole request is refused (:class:`OtlpRejected`),
so nothing of it is half-translated and the message goes to the dead-letter topic with the reason.

Seed 001: "every signal from a job carries the training job resource attributes, which identify the
run, attempt, training project, pipeline stage, and training settings". :func:`training_settings`
reads the settings: each resource attribute ``rlpulse.config.<name>``, and each
``akka.optimize.training.<name>`` other than the identity and label attributes rlpulse reads
(:data:`NOT_SETTINGS`), as ``<name>`` (an ``rlpulse.config.`` one wins over the seed's of the same
name), bounded and redacted by the SDK's ``flatten_config``. They ride the run's RUN_START.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rlpulse.base.errors import Error
from rlpulse.producers.sdk.run_config import flatten_config

SEED = "akka.optimize.training."
# Each identity field and the attribute names that give it, the first present wins.
PROJECT_KEYS = (SEED + "project", "rlpulse.project")
RUN_KEYS = (SEED + "run.id", "rlpulse.run_id")
ATTEMPT_KEYS = (SEED + "run.attempt", "rlpulse.attempt")
STAGE_KEYS = (SEED + "stage", "rlpulse.stage")
STEP_KEYS = (SEED + "rl.step", SEED + "step", "rlpulse.step")
ROLLOUT_KEYS = (SEED + "rl.rollout.id", "rlpulse.rollout_id")
ROLLOUT_ATTEMPT_KEYS = (SEED + "rl.rollout.attempt", "rlpulse.attempt_id")
CONFIG_PREFIX = "rlpulse.config."  # a training setting by rlpulse's name: rlpulse.config.learning_rate
# The seed's attributes that say which run, step, rollout or series a signal is, never a setting.
NOT_SETTINGS = frozenset((*PROJECT_KEYS, *RUN_KEYS, *ATTEMPT_KEYS, *STAGE_KEYS, *STEP_KEYS, *ROLLOUT_KEYS,
                          *ROLLOUT_ATTEMPT_KEYS, *(SEED + k for k in (
                              "rl.term", "rl.grader.outcome", "rl.grader.failure.cause", "rl.grader.score", "rl.reward",
                              "run.status", "job.rank", "job.role", "instance", "pool", "pool.serving",
                              "pool.accelerator", "claim.state"))))
DEFAULT_PROJECT_KEY = "service.name"  # the project when none is named: what every OTel SDK sets
DEFAULT_PROJECT = "default"

MAX_ATTR_DEPTH = 4  # an array or kvlist inside another, at most this deep (deeper: refused)
MAX_ID_CHARS = 256  # project, run id, stage: the SDK's bound on the same fields
MAX_ATTEMPT = 2**31 - 1  # an Avro int


class OtlpRejected(Error, ValueError):
    """A request rlpulse cannot translate: the reason names what was wrong, for the dead letter."""


@dataclass(frozen=True)
class Identity:
    project: str
    run_id: str
    attempt: int
    stage: str

    def fields(self) -> dict[str, Any]:
        return {"project": self.project, "run_id": self.run_id, "attempt": self.attempt, "stage": self.stage}


@dataclass(frozen=True)
class Out:
    """One rlpulse record to publish: its topic's short name, its message key, its record type."""

    topic: str
    key: str
    record_type: str
    record: dict[str, Any]


def any_value(value: Any, depth: int = 0) -> Any:
    """An OTLP ``AnyValue`` as a plain value (str, bool, int, float, bytes, list, dict, or None when unset)."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which in ("array_value", "kvlist_value"):
        if depth >= MAX_ATTR_DEPTH:
            raise OtlpRejected(f"an attribute value nests deeper than {MAX_ATTR_DEPTH} levels")
        if which == "array_value":
            return [any_value(v, depth + 1) for v in value.array_value.values]
        return {kv.key: any_value(kv.value, depth + 1) for kv in value.kvlist_value.values}
    return getattr(value, which)


def attributes(kvs: Iterable[Any]) -> dict[str, Any]:
    """``KeyValue``s as a dict (a repeated key: the last wins, as OTel's SDKs do)."""
    return {kv.key: any_value(kv.value) for kv in kvs}


def first(keys: Iterable[str], *scopes: Mapping[str, Any]) -> Any:
    """The value of the first of ``keys`` found, looking in each scope in turn (most specific first)."""
    for scope in scopes:
        for key in keys:
            value = scope.get(key)
            if value is not None and value != "":
                return value
    return None


def text(value: Any, what: str, limit: int = MAX_ID_CHARS) -> str:
    if not isinstance(value, str):
        raise OtlpRejected(f"{what} must be a string attribute, not {type(value).__name__}")
    if not value or len(value) > limit:
        raise OtlpRejected(f"{what} must be 1 to {limit} characters, not {len(value)}")
    return value


def integer(value: Any, what: str, low: int = 0, high: int = 2**63 - 1) -> int:
    """An int attribute (also an int written as text, or a whole double, as some SDKs send them)."""
    if isinstance(value, bool):
        raise OtlpRejected(f"{what} must be an integer, not a boolean")
    if isinstance(value, str) and len(value) < 24:
        try:
            value = int(value)
        except ValueError:  # "--1", "²": isdigit() said yes, int() says no; refused as a string below
            pass
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise OtlpRejected(f"{what} must be an integer, not {type(value).__name__}")
    if not low <= value <= high:
        raise OtlpRejected(f"{what} must be in [{low}, {high}], not {value}")
    return value


def identity(*scopes: Mapping[str, Any]) -> Identity:
    """The run and attempt named by ``scopes`` (most specific first); refused without a run id."""
    run = first(RUN_KEYS, *scopes)
    if run is None:
        raise OtlpRejected(f"no run id: set the resource attribute {RUN_KEYS[0]} (or {RUN_KEYS[1]})")
    project = first(PROJECT_KEYS, *scopes) or first((DEFAULT_PROJECT_KEY,), *scopes) or DEFAULT_PROJECT
    attempt = first(ATTEMPT_KEYS, *scopes)
    stage = first(STAGE_KEYS, *scopes) or ""
    return Identity(
        project=text(project, "the project"), run_id=text(run, "the run id"),
        attempt=1 if attempt is None else integer(attempt, "the run attempt", 0, MAX_ATTEMPT),
        stage=text(stage, "the stage") if stage else "",
    )


def step_of(*scopes: Mapping[str, Any]) -> int | None:
    """The training step named by ``scopes``, or None."""
    step = first(STEP_KEYS, *scopes)
    return None if step is None else integer(step, "the step")


def training_settings(resource: Mapping[str, Any]) -> dict[str, str]:
    """The training settings among a resource's attributes (the module docstring), flattened as the
    SDK's ``config=``; OtlpRejected naming the problem when they cannot be (a name given twice once
    nested names are dotted, one under ``_rlpulse.``)."""
    seed, own = {}, {}
    for key, value in resource.items():
        if key.startswith(CONFIG_PREFIX):
            own[key[len(CONFIG_PREFIX):]] = value
        elif key.startswith(SEED) and key not in NOT_SETTINGS:
            seed[key[len(SEED):]] = value
    picked = {name: value.hex() if isinstance(value, bytes) else value
              for name, value in {**seed, **own}.items() if value is not None}
    try:
        return flatten_config(picked)
    except ValueError as exc:
        raise OtlpRejected(f"the training settings in the resource attributes: {exc}") from None
