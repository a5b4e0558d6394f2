"""One message's spans gathered per accumulator, and the parsed keys of a run's state.

:class:`Batch`: the run processor (``rlpulse.streams.runs``) hands each ROLLOUT span to its step's
figures and each grader call to its window and to its step's calls of that term, not one at a
time but gathered in a list per accumulator, in the order they came; when the message is through,
each accumulator takes its list with one ``add_many``. Each accumulator sees its items in the same
order as one add per item would, and nothing the processor decides while reading a message reads
an accumulator's figures, so every figure is the same, bit for bit. The batch also keeps the
message's lookups (a step's or a window's list by its key): neither is removed before the closing
pass that follows the message.

The key helpers parse ``attempt|step`` and ``attempt|term|start``: every message's closing pass
reads every open and retained key of its run, and the keys repeat message after message.
"""

from __future__ import annotations

from typing import Any

from rlpulse.streams.figures import GraderWindow, StepFigures


class Batch:
    """The lists of one message, per accumulator, and the lookups of its fast path."""

    __slots__ = ("pending", "steps", "rollouts", "graders")

    def __init__(self) -> None:
        self.pending: dict[Any, list[Any]] = {}  # accumulator (hashed by identity) -> its spans or calls
        self.steps: dict[tuple[int, int, bool], StepFigures] = {}  # (attempt, step, moves_steps) -> figures
        self.rollouts: dict[tuple[int, int], list[Any]] = {}  # (attempt, step) -> its figures' list
        # (attempt, step, term, window start) -> the lists a grader call goes to: the step's calls of
        # the term (when the span names a step) and the window's
        self.graders: dict[tuple[int, Any, str, int], tuple[list[Any], ...]] = {}

    def items(self, accumulator: StepFigures | GraderWindow) -> list[Any]:
        """The list of ``accumulator``'s items (ROLLOUT spans for a step's figures, grader calls,
        ``GraderWindow.call_of``, for a window): appended to, in order, until :meth:`apply`."""
        items = self.pending.get(accumulator)
        if items is None:
            items = self.pending[accumulator] = []
        return items

    def apply(self) -> None:
        pending, self.pending = self.pending, {}
        self.rollouts.clear()
        self.graders.clear()
        for accumulator, items in pending.items():
            if items:
                accumulator.add_many(items)


_PARSED: dict[str, Any] = {}
_PARSED_MAX = 1 << 16  # bounded: cleared whole when full


def window_parts(key: str) -> tuple[str, str, str]:
    """(attempt, term, start) of a window key ``attempt|term|start``: a term may itself hold "|"."""
    parts = _PARSED.get(key)
    if parts is None:
        attempt, rest = key.split("|", 1)
        term, start = rest.rsplit("|", 1)
        parts = _parsed(key, (attempt, term, start, (int(start), int(attempt), term)))
    return parts[:3]


def window_order(key: str) -> tuple[int, int, str]:
    """A window key's (start, attempt, term): the order windows close and are emitted in."""
    parts = _PARSED.get(key)
    if parts is None:
        window_parts(key)
        parts = _PARSED[key]
    return parts[3]


def step_order(key: str) -> tuple[int, int]:
    """(attempt, step) of a step key ``attempt|step``, as numbers."""
    parts = _PARSED.get(key)
    if parts is None:
        attempt, step = key.split("|")
        parts = _parsed(key, (int(attempt), int(step)))
    return parts


def _parsed(key: str, parts: Any) -> Any:
    if len(_PARSED) >= _PARSED_MAX:
        _PARSED.clear()
    _PARSED[key] = parts
    return parts
