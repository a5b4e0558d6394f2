"""Validation of SDK arguments: a bad value raises ValueError naming the field.

The SDK's calls test the common case inline (exact types, which is cheapest) and come here
for anything else: these functions convert what they can (an int reward becomes a float) and
raise ValueError naming the field otherwise. Sizes are estimated from string lengths, never by
encoding, so the call stays cheap; only a record near the message limit is measured exactly.
"""

from __future__ import annotations

import math
import sys
from typing import Any
from collections.abc import Callable, Mapping

LONG_MAX = (1 << 63) - 1  # Avro long; an int beyond it cannot be encoded
INT_MAX = (1 << 31) - 1  # Avro int
MAX_DURATION_S = 1e9  # about 31 years: a span's start (end minus duration, in ns) stays an Avro long


def require_text(field: str, value: str) -> str:
    """``value`` if it encodes as UTF-8; a lone surrogate (``"\\ud800"``) raises ValueError naming the field.

    Callers test ``value.isascii()`` first (cheap): only a non-ASCII string needs this encode.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{field} is not valid text: {exc.reason} at position {exc.start} of {value!r}") from None
    return value


def require_str(field: str, value: Any, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not allow_empty and not value):
        raise ValueError(f"{field} must be a non-empty string, got {value!r}")
    return value if value.isascii() else require_text(field, value)


# Input limits (docs/sdk-and-tracing.md, "Input limits"): names and ids are keys of the streams' state and of
# ClickHouse's sort orders, so they stay short; attribute values carry text (a prompt, an error).
MAX_NAME = 256  # characters of project, run_id, stage, rollout_id, sample_id, a term, a span's name and ids
MAX_KEY = 256  # characters of an attribute key
MAX_VALUE = 64 * 1024  # characters of an attribute's string value or a span's status_message


def too_long(field: str, value: str, limit: int) -> ValueError:
    return ValueError(f"{field} is {len(value)} characters; at most {limit} are allowed")


def require_name(field: str, value: Any, allow_empty: bool = False, limit: int = MAX_NAME) -> str:
    """A non-empty string (or empty, if allowed) of at most ``limit`` characters that encodes as UTF-8."""
    require_str(field, value, allow_empty)
    if len(value) > limit:
        raise too_long(field, value, limit)
    return value


def optional_str(field: str, value: Any) -> str | None:
    return None if value is None else require_str(field, value)


def require_long(field: str, value: Any, minimum: int = -LONG_MAX - 1, maximum: int = LONG_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field} must be an integer, got {value!r}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{field} must be an integer from {minimum} to {maximum}, got {value!r}")
    return value


def require_step(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field} must be a non-negative integer, got {value!r}")
    if value > LONG_MAX:
        raise ValueError(f"{field} must be a non-negative integer of at most {LONG_MAX} (Avro long), got {value!r}")
    return value


def require_count(field: str, value: Any) -> int | None:
    if value is None:
        return None
    return require_step(field, value)


def require_finite(field: str, value: Any, minimum: float | None = None, maximum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field} must be a finite number, got {value!r}")
    try:
        number = float(value)  # an int too large for a double raises OverflowError
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{field} must be a finite number, got {value!r}")
    if minimum is not None and number < minimum:
        raise ValueError(f"{field} must be >= {minimum}, got {value!r}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{field} must be <= {maximum:g}, got {value!r}")
    return number


def optional_finite(field: str, value: Any, minimum: float | None = None) -> float | None:
    return None if value is None else require_finite(field, value, minimum)


def require_duration(field: str, value: Any) -> float:
    return require_finite(field, value, minimum=0.0, maximum=MAX_DURATION_S)


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
    return {require_name(f"{field} key", k): require_finite(f"{field}[{k!r:.40}]", v) for k, v in values.items()}


MAX_METRICS = 256  # a trainer's scalars in one step event (TRL logs ~40, verl ~100)
MAX_FINISH_REASON = 64  # characters of a rollout's finish_reason (stop, length, tool_calls, ...)
MAX_ATTRIBUTES = 128  # OpenTelemetry's default span attribute count limit: an OTel span never exceeds it
FIELD_BYTES = 10  # what a number, a length prefix or a union branch costs in Avro, at most
DICT_BYTES, ENTRY_BYTES = 240, 60  # a copied dict in memory, and each entry (see rlpulse.producers.sdk.queue's *_QUEUED_BYTES)


def attribute_map(field: str, values: Mapping[str, Any] | None, max_keys: int = MAX_ATTRIBUTES) -> dict[str, Any]:
    """Span attributes: at most ``max_keys`` string keys with str, bool, int or finite float values."""
    return sized_attributes(field, values, max_keys)[0] if values is not None else {}


def sized_attributes(field: str, values: Any, max_keys: int = MAX_ATTRIBUTES) -> tuple[dict[str, Any], int]:
    """A checked copy of span attributes and their estimated encoded size.

    At most ``max_keys`` keys of at most MAX_KEY characters; string values of at most MAX_VALUE.
    """
    if not isinstance(values, Mapping):
        raise ValueError(f"{field} must be a mapping, got {type(values).__name__}")
    if len(values) > max_keys:
        raise ValueError(f"{field} has {len(values)} keys; at most {max_keys} are allowed")
    out: dict[str, Any] = {}
    size = 0
    for key, value in values.items():
        if type(key) is not str or not key or not key.isascii() or len(key) > MAX_KEY:
            require_name(f"{field} key", key, limit=MAX_KEY)
        kind = type(value)
        if kind is str:
            if not value.isascii():
                require_text(f"{field}[{key!r}]", value)
            if len(value) > MAX_VALUE:
                raise too_long(f"{field}[{key!r}]", value, MAX_VALUE)
            size += len(value)
        elif kind is float:
            if not math.isfinite(value):
                raise ValueError(f"{field}[{key!r}] must be finite, got {value!r}")
        elif kind is int:
            if not -LONG_MAX - 1 <= value <= LONG_MAX:
                raise ValueError(f"{field}[{key!r}] is beyond Avro long (-2**63 to 2**63-1), got {value!r}")
        elif kind is not bool:
            if isinstance(value, (str, bool, int, float)):  # a subclass (an IntEnum, a str enum): its plain value
                return sized_attributes(field, {k: _plain(x) for k, x in values.items()}, max_keys)
            raise ValueError(f"{field}[{key!r}] must be a string, bool, int or float, got {type(value).__name__}")
        size += len(key) + ENTRY_BYTES
        out[key] = value
    return out, size + DICT_BYTES


_SPAN_NAMES = ("name", "rollout_id", "attempt_id", "term", "sample_id", "trace_id", "span_id", "parent_span_id")


def check_span_limits(fields: Mapping[str, Any]) -> None:
    """The input limits of a whole Span record (``publish_span``), after its schema check: ValueError naming the field."""
    for name in _SPAN_NAMES:
        value = fields.get(name)
        if type(value) is str and len(value) > MAX_NAME:
            raise too_long(name, value, MAX_NAME)
    message = fields.get("status_message")
    if type(message) is str and len(message) > MAX_VALUE:
        raise too_long("status_message", message, MAX_VALUE)
    if fields.get("attributes") is not None:
        sized_attributes("attributes", fields["attributes"])
    shares = fields.get("term_shares")
    if shares:
        float_map("term_shares", shares, MAX_TERMS)


MAX_TERMS = 64  # distinct reward terms per run (the SDK's register), and term_shares keys per rollout


def _plain(value: Any) -> Any:
    """The plain str, int or float of a subclass (numpy.float64, an IntEnum); anything else as it is."""
    for kind in (bool, str, int, float):
        if isinstance(value, kind):
            return kind(value)
    return value


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


# -- whole records, checked against their Avro schema (publish_span, publish_hardware, Sender.offer) --
# The Avro encoder takes NaN and infinity as doubles (and the streams then choke on them), fails on a
# lone surrogate or an int beyond its range only on the sender's thread, and names no field when it
# does: these checks run at the call and name the field.
Check = Callable[[str, Any], None]


def _check_string(field: str, value: Any) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{field} must be a string, got {value!r}")
    if not value.isascii():
        require_text(field, value)


def _check_bytes(field: str, value: Any) -> None:
    if not isinstance(value, (bytes, bytearray)):
        raise ValueError(f"{field} must be bytes, got {type(value).__name__}")


def _check_boolean(field: str, value: Any) -> None:
    if type(value) is not bool:
        raise ValueError(f"{field} must be True or False, got {value!r}")


def _check_int(field: str, value: Any) -> None:
    require_long(field, value, -INT_MAX - 1, INT_MAX)


def _check_long(field: str, value: Any) -> None:
    require_long(field, value)


def _check_double(field: str, value: Any) -> None:
    require_finite(field, value)


_PRIMITIVES: dict[str, Check] = {"string": _check_string, "bytes": _check_bytes, "boolean": _check_boolean,
                                 "int": _check_int, "long": _check_long, "double": _check_double, "float": _check_double}
_BRANCHES = {str: "string", bytes: "bytes", bytearray: "bytes", bool: "boolean", int: "long", float: "double"}


def type_check(avro_type: Any) -> Check:
    """A check for values of one (parsed) Avro type; types it does not know are left to the encoder."""
    if isinstance(avro_type, str):
        if avro_type == "null":
            return _check_null
        return _PRIMITIVES.get(avro_type, _unchecked)
    if isinstance(avro_type, list):  # a union: the branch of the value's Python type
        branches = {b if isinstance(b, str) else b.get("type"): type_check(b) for b in avro_type}
        if "int" in branches and "long" not in branches:
            branches["long"] = branches["int"]
        if "float" in branches and "double" not in branches:
            branches["double"] = branches["float"]

        def union(field: str, value: Any) -> None:
            if value is None and "null" in branches:
                return
            kind = next((name for t, name in _BRANCHES.items() if isinstance(value, t)), None)
            if kind == "long" and "long" not in branches and "double" in branches:
                kind = "double"
            if kind == "string" and "string" not in branches and "enum" in branches:  # an enum's symbol is a str
                kind = "enum"
            if isinstance(value, Mapping):
                kind = "map"
            check = branches.get(kind) if kind else None
            if check is None:
                raise ValueError(f"{field} must be one of {', '.join(map(str, branches))}, got {value!r}")
            check(field, value)
        return union
    kind = avro_type.get("type")
    if kind == "enum":
        symbols = tuple(avro_type["symbols"])

        def enum(field: str, value: Any) -> None:
            if value not in symbols:
                require_choice(field, value, symbols)
        return enum
    if kind == "map":
        values = type_check(avro_type["values"])

        def mapping(field: str, value: Any) -> None:
            if not isinstance(value, Mapping):
                raise ValueError(f"{field} must be a mapping, got {type(value).__name__}")
            for k, x in value.items():
                _check_string(f"{field} key", k)
                values(f"{field}[{k!r}]", x)
        return mapping
    if kind in _PRIMITIVES or kind == "null":
        return type_check(kind)
    return _unchecked


def _check_null(field: str, value: Any) -> None:
    if value is not None:
        raise ValueError(f"{field} must be null, got {value!r}")


def _unchecked(field: str, value: Any) -> None:
    pass


def record_checks(parsed_schema: Mapping[str, Any]) -> dict[str, tuple[Check, bool]]:
    """field name -> (its check, whether it has a default) for one parsed Avro record schema."""
    return {f["name"]: (type_check(f["type"]), "default" in f) for f in parsed_schema["fields"]}


def check_fields(checks: Mapping[str, tuple[Check, bool]], record: Mapping[str, Any], complete: bool = True) -> None:
    """Raise ValueError naming the first field of ``record`` its schema refuses (or, if ``complete``, lacks)."""
    for name, value in record.items():
        entry = checks.get(name)
        if entry is not None:
            entry[0](name, value)
    if complete:
        for name, (_, has_default) in checks.items():
            if not has_default and name not in record:
                raise ValueError(f"{name} is required")
