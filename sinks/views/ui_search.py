"""The search page of ``rlpulse ui``: a run's trajectories found by reward, status, failed term, clipped, steps and text."""

from __future__ import annotations

from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views.ui_params import Page, Query
from rlpulse.sinks.views.ui_pages import NotFound


def search_page(store: Store, query: Query) -> Page:
    raise NotFound("the search page is not built yet")
