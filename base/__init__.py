"""The ground every room stands on: settings and the ``RLPULSE_*`` names, the home and its files,
terminal-safe text, the Kafka pre-flight check, the fault seam and :class:`Error`. Imports nothing
else of rlpulse."""

from rlpulse.base.errors import Error

__all__ = ["Error"]
