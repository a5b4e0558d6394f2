"""Validation of SDK arguments: a bad value raises ValueError naming the field.

The SDK's calls test the common case inline (exact types, which is cheapest) and come here
for anything else: these functions convert what they can (an int reward becomes a float) and
raise ValueError naming the field otherwise. Sizes are estimated from string lengths, never by
encoding, so the call stays cheap; only a record near the message limit is measured exactly.
"""

from __future__ import annotations

import math
import sys
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
FIELD_BYTES = 10  # what a number, a length prefix or a union branch costs in Avro, at most
DICT_BYTES, ENTRY_BYTES = 240, 60  # a copied dict in memory, and each entry (see telemetry's *_QUEUED_BYTES)


def attribute_map(field: str, values: Mapping[str, Any] | None, max_keys: int = MAX_ATTRIBUTES) -> dict[str, Any]:
    """Span attributes: at most ``max_keys`` string keys with str, bool, int or finite float values."""
    return sized_attributes(field, values, max_keys)[0] if values is not None else {}


def sized_attributes(field: str, values: Any, max_keys: int = MAX_ATTRIBUTES) -> tuple[dict[str, Any], int]:
    """A checked copy of span attributes and their estimated encoded size."""
    if not isinstance(values, Mapping):
        raise ValueError(f"{field} must be a mapping, got {type(values).__name__}")
    if len(values) > max_keys:
        raise ValueError(f"{field} has {len(values)} keys; at most {max_keys} are allowed")
    out: dict[str, Any] = {}
    size = 0
    for key, value in values.items():
        if type(key) is not str or not key:
            require_str(f"{field} key", key)
        kind = type(value)
        if kind is str:
            size += len(value)
        elif kind is float:
            if not math.isfinite(value):
                raise ValueError(f"{field}[{key!r}] must be finite, got {value!r}")
        elif not isinstance(value, (str, bool, int, float)):
            raise ValueError(f"{field}[{key!r}] must be a string, bool, int or float, got {type(value).__name__}")
        size += len(key) + ENTRY_BYTES
        out[key] = value
    return out, size + DICT_BYTES


def utf8_bytes(value: Any) -> int:
    """Exact encoded bytes of a string, or of a map's keys and string values; a number counts FIELD_BYTES."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass")) + FIELD_BYTES
    if isinstance(value, Mapping):
        return sum(utf8_bytes(k) + utf8_bytes(v) for k, v in value.items()) + FIELD_BYTES
    return FIELD_BYTES


def queued_bytes(record: Mapping[str, Any]) -> int:
    """What a queued record dict holds in memory: the dict, its values and one level of nested dicts."""
    size = sys.getsizeof(record)
    for value in record.values():
        size += sys.getsizeof(value)
        if isinstance(value, Mapping):
            size += sum(sys.getsizeof(k) + sys.getsizeof(x) for k, x in value.items())
    return size


def refuse_oversized(record_type: str, limit: int, base: int, fields: Mapping[str, Any]) -> None:
    """Raise ValueError naming the largest field when a record of ``fields`` can never fit in a message.

    Called only when the cheap estimate (characters) comes near ``limit``: this one measures
    the UTF-8 bytes, so a large record that still fits is accepted.
    """
    sizes = {name: utf8_bytes(value) for name, value in fields.items() if value is not None}
    total = base + sum(sizes.values())
    if total <= limit:
        return
    name, largest = max(sizes.items(), key=lambda kv: kv[1])
    if isinstance(fields[name], Mapping) and fields[name]:
        key, size = max(((k, utf8_bytes(k) + utf8_bytes(v)) for k, v in fields[name].items()), key=lambda kv: kv[1])
        name, largest = f"{name}[{key!r}]", size
    raise ValueError(f"{name} is {largest} bytes: a {record_type} record must fit in one Kafka message, at most "
                     f"{limit} bytes a record (max_message_bytes); this one would be about {total} bytes")
