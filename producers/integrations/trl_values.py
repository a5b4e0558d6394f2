"""What TRL hands the integration (``rlpulse.producers.integrations.trl``), read as rlpulse reads it:
a reward function's values as grader outcomes and scores, and the scalars TRL logs as metrics.
"""

from __future__ import annotations

import logging
import math
from typing import Any
from collections.abc import Mapping

from rlpulse.producers.sdk import events as v
from rlpulse.schemas.enums import FAILURE_CAUSES
from rlpulse.base.errors import Error

log = logging.getLogger("rlpulse.producers.integrations.trl")  # the integration's logger: one place to turn it up


class GraderFailure(Error):
    """A reward function's way to say why it could not score: ``timeout``, ``unavailable``,
    ``unreadable``, ``ungradable`` or ``error``. Raised, every completion of the call failed so;
    returned in the list in place of a score, that completion did. Through ``instrument()`` (with
    ``enabled=False`` too) TRL sees None (NaN) for it either way; a judge TRL calls without
    ``instrument()`` hands TRL the GraderFailure itself, which TRL refuses (``TypeError``)."""

    def __init__(self, cause: str, message: str = ""):
        if cause not in FAILURE_CAUSES:
            raise ValueError(f"GraderFailure cause must be one of {', '.join(FAILURE_CAUSES)}, got {cause!r}")
        super().__init__(message or cause)
        self.cause = cause


def outcome_of(value: Any) -> tuple[str, float | None]:
    """(outcome, score) of one value a reward function returned."""
    if isinstance(value, GraderFailure):
        return value.cause, None
    if value is None:
        return "ungradable", None
    try:
        score = float(value)
    except (TypeError, ValueError):
        return "unreadable", None
    if math.isnan(score):
        return "ungradable", None
    return ("ok", score) if math.isfinite(score) else ("unreadable", None)


def for_trl(value: Any) -> Any:
    """What TRL is given for ``value``: None (NaN for TRL) for a GraderFailure, else the value itself."""
    return None if isinstance(value, GraderFailure) else value


def scalars(logs: Mapping[str, Any], skipped: dict[str, int]) -> dict[str, float]:
    """The finite numbers of a TRL log under names the SDK accepts; the rest counted in ``skipped`` (name -> values skipped)."""
    metrics: dict[str, float] = {}
    for name, value in logs.items():
        number: float | None = None
        if not isinstance(value, (bool, str, bytes)):
            try:
                number = float(value.item() if hasattr(value, "item") else value)  # a tensor or NumPy scalar too
            except (TypeError, ValueError, OverflowError):
                number = None
        valid_name = isinstance(name, str) and 0 < len(name) <= v.MAX_NAME and name.isascii()
        if number is not None and math.isfinite(number) and valid_name:
            metrics[name] = number
            continue
        key = str(name)[:v.MAX_NAME]
        if key not in skipped:
            log.warning("TRL logged %s=%r: not a finite number under a usable name, so not published "
                        "(later skips of this name are counted, not logged)", key, value)
        skipped[key] = skipped.get(key, 0) + 1
    return metrics
