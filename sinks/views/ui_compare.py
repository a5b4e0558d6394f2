"""The compare page of ``rlpulse ui``: N runs overlaid on one axis, and the configuration keys that differ."""

from __future__ import annotations

from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views.ui_params import Page, Query
from rlpulse.sinks.views.ui_pages import NotFound


def compare_page(store: Store, query: Query, now_ns: int) -> Page:
    raise NotFound("the compare page is not built yet")
