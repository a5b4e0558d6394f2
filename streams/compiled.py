"""The streams' compiled loops (``streams/_loops.pyx``), or None where that optional extension
is not built: the methods that call them run their own Python then, with the same results
(``tests/unit/streams`` runs every test both ways)."""

from __future__ import annotations

from typing import Any

try:
    import rlpulse.streams._loops as _compiled  # type: ignore[import-not-found]
except ImportError:
    _compiled = None

LOOPS: Any = _compiled
