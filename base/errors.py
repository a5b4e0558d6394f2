"""``rlpulse.Error``: the one base class of every error rlpulse raises on purpose.

``except rlpulse.Error`` catches them all. Each subclass also keeps the built-in class it always
had (``ValueError``, ``RuntimeError``, ...), so code that caught those goes on working.
"""

from __future__ import annotations


class Error(Exception):
    """An error of rlpulse's own: a bad argument, a refused input, a service that cannot be reached."""
