"""Faults injected on purpose, for the tests: one named seam, switched on by one variable.

The fault tests make the real processes misbehave in ways too rare to wait for. Each fault is
named here, once; a process reads them from ``RLPULSE_FAULTS`` (through ``Settings.faults``) and
hands each part the one it acts on. Unset, there are none, and no code path changes::

    RLPULSE_FAULTS="insert_error=252:3,kill_after_inserts=3,drop_first=1"

* ``insert_error=CODE[:COUNT]``: the sink's inserts raise ClickHouse error CODE (the first COUNT
  of them, or every one), in the real insert path, before ClickHouse is called.
* ``kill_after_inserts=N``: the sink SIGKILLs itself after its N-th insert, before the commit.
* ``slow_insert=S``: a sink insert whose container carries the bytes ``rlpulse-fault:slow-insert``
  hangs S seconds in its insert thread (an engine stuck on it), unless the sink stops it first.
* ``drop_first=N``: the streams worker's consumer takes the first N messages of each input
  partition as read without handing them to the agents (Faust's recovery skip, reproduced).

An unknown name or a malformed value is an error naming it: a typo must not silently run a test
without its fault.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from rlpulse.base.env import FAULTS as FAULTS_ENV  # the variable is named once, in env

_INSERT_ERROR = re.compile(r"^\d+(:\d+)?$")


@dataclasses.dataclass(frozen=True)
class Faults:
    """The faults switched on for one process (all off by default)."""

    insert_error: str = ""  # "CODE" or "CODE:COUNT"
    kill_after_inserts: int = 0
    drop_first: int = 0
    slow_insert: int = 0  # seconds

    @classmethod
    def parse(cls, text: str) -> Faults:
        """``name=value`` pairs separated by commas; '' means no fault."""
        values: dict[str, object] = {}
        names = {f.name: f.type for f in dataclasses.fields(cls)}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, eq, value = part.partition("=")
            name, value = name.strip(), value.strip()
            if name not in names or not eq:
                raise ValueError(f"unknown fault {name!r} (known: {', '.join(names)}; "
                                 f"write name=value)")
            if name == "insert_error":
                if not _INSERT_ERROR.match(value):
                    raise ValueError(f"insert_error={value!r}: expected CODE or CODE:COUNT, e.g. 252:3")
                values[name] = value
            else:
                if not value.isdigit():
                    raise ValueError(f"{name}={value!r}: expected a whole number")
                values[name] = int(value)
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Faults:
        return cls.parse(env.get(FAULTS_ENV, ""))

    def __bool__(self) -> bool:
        return self != Faults()

    def env(self) -> dict[str, str]:
        """The environment that switches these faults on in a child process."""
        parts = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != f.default]
        return {FAULTS_ENV: ",".join(parts)}

    @property
    def insert_error_code(self) -> int | None:
        return int(self.insert_error.split(":")[0]) if self.insert_error else None

    @property
    def insert_error_count(self) -> int | None:
        """How many inserts fail; None: every one."""
        code, _, count = self.insert_error.partition(":")
        return int(count) if count else None
