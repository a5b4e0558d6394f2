"""Where an agent script of this folder publishes: in memory (its spans printed for the test to read),
or, with AGENT_PUBLISH=kafka, the real broker named by the RLPULSE_* settings in the environment
(``tests/integration/producers/tracing/test_agent_stacks.py``). The scripts run as files, so this
folder is first on their path and ``import publish`` finds it."""

from __future__ import annotations

import os

from rlpulse.producers import InMemoryTransport


def transport() -> InMemoryTransport | None:
    return None if os.environ.get("AGENT_PUBLISH") == "kafka" else InMemoryTransport()
