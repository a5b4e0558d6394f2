"""The query-string parameters of ``rlpulse ui``'s pages: one value, a whole number, a decimal, a choice, parsed and checked.

A value that does not parse is answered 400 (:class:`BadParameter`) with what was expected.
"""

from __future__ import annotations

import math
from urllib.parse import quote, unquote

from rlpulse.base.errors import Error

MAX_VALUE = 1024  # characters of one parameter (ids are far shorter)
REFRESH_MIN = 5  # seconds: ``refresh=N`` on any page reloads it every N seconds (5 to 3600)
INT_MAX = 2**63 - 1

Query = dict[str, list[str]]


class BadParameter(Error, ValueError):
    """A URL parameter that does not parse (answered 400)."""


def one(query: Query, name: str, required: bool = False) -> str | None:
    values = query.get(name) or []
    value = values[-1] if values else None
    if value is not None and len(value) > MAX_VALUE:
        raise BadParameter(f"{name}: at most {MAX_VALUE} characters")
    if required and not value:
        raise BadParameter(f"the URL needs {name}=")
    return value


def integer(query: Query, name: str, required: bool = False, low: int = 0) -> int | None:
    value = one(query, name, required)
    if value in (None, ""):
        return None
    try:
        n = int(value)  # type: ignore[arg-type]
    except ValueError:
        raise BadParameter(f"{name}: expected a whole number, got {value!r}") from None
    if not low <= n <= INT_MAX:
        raise BadParameter(f"{name}: expected a number from {low}, got {value!r}")
    return n


def decimal(query: Query, name: str) -> float | None:
    value = one(query, name)
    if value in (None, ""):
        return None
    try:
        x = float(value)  # type: ignore[arg-type]
    except ValueError:
        raise BadParameter(f"{name}: expected a number, got {value!r}") from None
    if not math.isfinite(x):
        raise BadParameter(f"{name}: expected a finite number, got {value!r}")
    return x


def choice(query: Query, name: str, allowed: tuple[str, ...]) -> str:
    value = one(query, name) or allowed[0]
    if value not in allowed:
        raise BadParameter(f"{name}: one of {', '.join(a or '(none)' for a in allowed)}, got {value!r}")
    return value


def run_param(key: tuple[str, str, int | None]) -> str:
    """A run as the URL's ``run=`` value: each part percent-encoded, so a '/' inside an id stays inside it."""
    project, run, attempt = key
    return f"{quote(project, safe='')}/{quote(run, safe='')}" + ("" if attempt is None else f"/{attempt}")


def parse_run(value: str) -> tuple[str, str, int | None]:
    """``PROJECT/RUN[/ATTEMPT]`` (parts percent-encoded) as (project, run, attempt or None: the latest)."""
    parts = value.split("/")
    expected = f"run: expected PROJECT/RUN or PROJECT/RUN/ATTEMPT, each part percent-encoded, got {value!r}"
    if len(parts) not in (2, 3) or not all(parts[:2]):
        raise BadParameter(expected)
    attempt = None
    if len(parts) == 3:
        if not (parts[2].isascii() and parts[2].isdigit()) or not 1 <= int(parts[2]) <= 2**32 - 1:
            raise BadParameter(f"run: the attempt is a whole number from 1, got {parts[2]!r} in {value!r}")
        attempt = int(parts[2])
    return unquote(parts[0]), unquote(parts[1]), attempt


Page = tuple[str, list[tuple[str, str | None]], str]  # title, crumbs (label, escaped link), body
