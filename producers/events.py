"""Validation of SDK arguments: a bad value raises ValueError naming the field."""

from __future__ import annotations

import math
from typing import Any, Mapping

GRADER_OUTCOMES = ("ok", "timeout", "unavailable", "unreadable", "ungradable")
FAILURE_CAUSES = GRADER_OUTCOMES[1:]
TRAINERS = ("rl", "sft")


def require_str(field: str, value: Any, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not allow_empty and not value):
        raise ValueError(f"{field} must be a non-empty string, got {value!r}")
    return value


def require_step(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field} must be a non-negative integer, got {value!r}")
    return value


def require_count(field: str, value: Any) -> int | None:
    if value is None:
        return None
    return require_step(field, value)


def require_finite(field: str, value: Any, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{field} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{field} must be >= {minimum}, got {value!r}")
    return float(value)


def optional_finite(field: str, value: Any, minimum: float | None = None) -> float | None:
    return None if value is None else require_finite(field, value, minimum)


def require_choice(field: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{field} must be one of {', '.join(choices)}; got {value!r}")
    return value


def float_map(field: str, values: Mapping[str, Any] | None, max_keys: int) -> dict[str, float]:
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise ValueError(f"{field} must be a mapping of names to floats, got {type(values).__name__}")
    if len(values) > max_keys:
        raise ValueError(f"{field} has {len(values)} keys; at most {max_keys} are allowed")
    return {require_str(f"{field} key", k): require_finite(f"{field}[{k!r}]", v) for k, v in values.items()}


MAX_ATTRIBUTES = 64


def attribute_map(field: str, values: Mapping[str, Any] | None, max_keys: int = MAX_ATTRIBUTES) -> dict[str, Any]:
    """Span attributes: at most ``max_keys`` string keys with str, bool, int or finite float values."""
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise ValueError(f"{field} must be a mapping, got {type(values).__name__}")
    if len(values) > max_keys:
        raise ValueError(f"{field} has {len(values)} keys; at most {max_keys} are allowed")
    out: dict[str, Any] = {}
    for key, value in values.items():
        require_str(f"{field} key", key)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{field}[{key!r}] must be finite, got {value!r}")
        if not isinstance(value, (str, bool, int, float)):
            raise ValueError(f"{field}[{key!r}] must be a string, bool, int or float, got {type(value).__name__}")
        out[key] = value
    return out
