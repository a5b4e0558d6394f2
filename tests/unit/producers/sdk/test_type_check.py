"""The SDK's checks of records against their Avro types (rlpulse.producers.sdk.events.type_check)."""

from __future__ import annotations

import pytest

from rlpulse.producers.sdk.events import type_check

pytestmark = pytest.mark.full

RUN_STATUS = ["null", {"type": "enum", "name": "RunStatus", "symbols": ["finished", "failed", "cancelled"]}]


def test_a_nullable_enum_takes_its_symbols_and_none_and_refuses_the_rest() -> None:
    check = type_check(RUN_STATUS)
    check("status", "finished")  # a symbol of the enum branch (it raised before: a str found no "string" branch)
    check("status", None)
    with pytest.raises(ValueError, match="status") as refused:
        check("status", "exploded")
    assert "exploded" in str(refused.value)
    with pytest.raises(ValueError, match="status must be one of"):
        check("status", 3)
