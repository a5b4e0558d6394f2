"""What an entry's return value says (seed 000): a score, metrics, and whether the work failed.

Seed 000's processors return ``RewardOutput(reward=Reward(reward_score=..., reward_metrics={...}),
status=TaskStatus.SUCCESS, error=None)`` and ``RolloutOutput(..., status=..., error=...)``. Read by
shape (attributes or mapping keys), never by type, so any class of those names and fields works:

* the score: a bare number (a REWARD entry's), ``reward_score``, ``reward`` when it is a number, or
  ``reward.reward_score``;
* metrics: ``reward_metrics`` or ``reward.reward_metrics`` (a REWARD entry's), ``metrics`` (a
  ROLLOUT entry's): flat names to finite numbers, at most 10 per call as ``reward_metrics`` allows;
  an entry that is not one (a string, NaN, a long name) is skipped and counted in the span's
  ``rlpulse.metrics_skipped``, never raised into the traced code;
* failure: ``status`` naming a failure (FAILED, FAILURE, ERROR, TIMEOUT, CANCELLED, CANCELED,
  ABORTED; an enum's name or value, any case) or a non-empty ``error``. The entry's span is then
  ERROR with ``status_message`` ``status <name>`` (or ``error``: the error's text is content, kept
  in ``rlpulse.error.message`` only when content is on), its reward is not taken, and the streams
  count the rollout in ``rollouts_failed`` and keep it out of every reward figure.
"""

from __future__ import annotations

import math
from typing import Any

import rlpulse.producers.tracing.content as tc
from rlpulse.producers.tracing.spans import MAX_METRIC_NAME, MAX_METRIC_NAMES, OpenSpan

# seed 000's TaskStatus names of a failed task (not grader outcomes, though two words are shared)
FAILED = frozenset("failed failure error timeout cancelled canceled aborted".split())
MAX_ERROR_TEXT = 1024


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)  # an int beyond a float's range raises: no number, skipped and counted
        except OverflowError:
            return None
        return number if math.isfinite(number) else None
    return None


def _status_name(status: Any) -> str | None:
    for candidate in (getattr(status, "name", None), getattr(status, "value", None), status):
        if isinstance(candidate, str) and candidate:
            return candidate[:64]
    return None


def read_result(span: OpenSpan, result: Any) -> None:
    """Apply what ``result`` says to the entry ``span`` (its reward, metrics, failure)."""
    if result is None or isinstance(result, (str, bytes, bool)):
        return
    status = _status_name(tc.field(result, "status")) if not _number(result) else None
    error = tc.field(result, "error") if not _number(result) else None
    if status is not None and status.lower() in FAILED:
        span.failure = f"status {status}"
    elif error not in (None, "", False):
        span.failure = "error"
    if span.failure is not None:
        if error not in (None, "", False) and span.tracer.content:
            span.attributes["rlpulse.error.message"] = tc.redact(str(error))[:MAX_ERROR_TEXT]
        return  # a failed entry's score is no score
    score = _number(result)
    nested = tc.field(result, "reward") if score is None else None
    if score is None:
        score = _number(tc.field(result, "reward_score"))
        if score is None:
            score = _number(nested)
        if score is None and nested is not None:
            score = _number(tc.field(nested, "reward_score"))
    if score is not None and "reward" not in span.fields and (span.kind == "REWARD" or nested is not None
                                                               or tc.field(result, "reward_score") is not None):
        span.fields["reward"] = score
    if _number(result) is not None:
        return
    metrics = tc.field(result, "reward_metrics") if span.kind == "REWARD" else tc.field(result, "metrics")
    if metrics is None and nested is not None and span.kind == "REWARD":
        metrics = tc.field(nested, "reward_metrics")
    if hasattr(metrics, "items"):
        _metrics(span, metrics)


def _metrics(span: OpenSpan, metrics: Any) -> None:
    skipped = 0
    for key, value in list(metrics.items())[:4 * MAX_METRIC_NAMES]:
        number = _number(value)
        if (not isinstance(key, str) or not key or len(key) > MAX_METRIC_NAME or number is None
                or key in ("reward", "reward_score") or (key not in span.metrics and len(span.metrics) >= MAX_METRIC_NAMES)):
            skipped += 1
            continue
        try:
            span.tracer.register_metrics("reward_metrics" if span.kind == "REWARD" else "rollout_metrics", [key])
        except ValueError:  # over the run's distinct names: the tracer says so once per call site, here counted
            skipped += 1
            continue
        span.metrics[key] = number
    skipped += max(len(metrics) - 4 * MAX_METRIC_NAMES, 0)
    if skipped:
        span.attributes["rlpulse.metrics_skipped"] = skipped
