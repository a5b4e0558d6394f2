"""The symbols of the records' enums, read once from the ``.avsc`` files (the source of truth).

Every module that lists span kinds, trainers or grader outcomes imports them from here (any other
enum: ``enum_symbols``), so a symbol added to an ``.avsc`` reaches the SDK's checks, the
exporter and the streams at once.

Grader outcomes are the one list not read from an enum: the Span schema carries ``outcome`` as
a string (Avro cannot resolve a string into an enum, so making it one would break every reader
of the data already written), so its symbols are listed here, once, beside the others.
"""

from __future__ import annotations

from typing import Any

from rlpulse.schemas.codec import full_name, load_schemas


def enum_symbols(record: str, field: str) -> tuple[str, ...]:
    """The symbols of the enum type of ``record``'s ``field``, in the schema's order."""
    return _enum(record, field)["symbols"]


def enum_default(record: str, field: str) -> str:
    """The symbol a reader gives a writer's symbol it does not know."""
    return _enum(record, field)["default"]


def _enum(record: str, field: str) -> dict[str, Any]:
    schema = _SCHEMAS[full_name(record)]
    for f in schema["fields"]:
        if f["name"] == field:
            kind = f["type"]
            if isinstance(kind, list):  # a nullable enum: ["null", {"type": "enum", ...}]
                kind = next((b for b in kind if isinstance(b, dict)), None)
            if isinstance(kind, dict) and kind.get("type") == "enum":
                return {"symbols": tuple(kind["symbols"]), "default": kind.get("default")}
            raise ValueError(f"{record}.{field} is not an enum")
    raise ValueError(f"{record} has no field {field!r}")


_SCHEMAS = load_schemas()

SPAN_KINDS: tuple[str, ...] = enum_symbols("Span", "kind")  # ROLLOUT, REWARD, LLM, TOOL, GRADER, ANNOTATION, CUSTOM
SPAN_KIND_DEFAULT: str = enum_default("Span", "kind")  # CUSTOM
# The trainers a job may name: the Trainer enum less its default ("other"), which only stands
# for a newer writer's symbol this reader does not know.
TRAINERS: tuple[str, ...] = tuple(s for s in enum_symbols("Step", "trainer") if s != enum_default("Step", "trainer"))

# A GRADER span's outcome (the Span schema's string field ``outcome``): ok, or the failure cause (seed 001).
# ``error``: the grader raised (added after the seed's four; an older streams counts it as ``unknown``).
GRADER_OUTCOMES: tuple[str, ...] = ("ok", "timeout", "unavailable", "unreadable", "ungradable", "error")
FAILURE_CAUSES: tuple[str, ...] = GRADER_OUTCOMES[1:]

# How a run ended (RUN_END's ``status``), less the default ("unknown": a newer writer's symbol).
RUN_STATUSES: tuple[str, ...] = tuple(s for s in enum_symbols("Step", "status") if s != enum_default("Step", "status"))
# A CHECKPOINT span's operation (``checkpoint_op``) and its outcome (the Span's ``outcome``).
CHECKPOINT_OPS: tuple[str, ...] = ("save", "restore")
CHECKPOINT_OUTCOMES: tuple[str, ...] = ("ok", "failed")
# A rollout's ``finish_reason`` that means it was truncated at the length limit (TRL, vLLM, OpenAI).
FINISH_TRUNCATED = "length"
