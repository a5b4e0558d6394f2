"""What a pipeline test waits for, read from ClickHouse: conditions for
``Pipeline.wait_caught_up(until=...)``.

They replace fixed quiet periods: the test waits exactly until the rows it will check are in,
however fast or slow the machine. A chDB store is read through ``open_reader``: through the read
endpoint of the sink that holds it, or, when no process holds it (a sink that was killed), opened
for the moment of the query. ``wait_caught_up`` asks only once the sink's group is at lag 0, so
a running sink has its store by then: the query never takes a store from a sink still starting.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

from rlpulse.base.settings import Settings
from rlpulse.sinks.store.clickhouse import StoreBusyError, open_reader


def query(settings: Settings, sql: str) -> list[tuple] | None:
    """The rows of ``sql`` (``$db`` stands for the database), or None while the store cannot be
    read yet (held by a process that serves no reads)."""
    try:
        store = open_reader(settings.clickhouse_dsn, owner="test waiting for rows")
    except StoreBusyError:
        return None
    try:
        return [tuple(r) for r in store.client.query(sql.replace("$db", store.database)).result_rows]
    except Exception as exc:  # tables not migrated yet: the sink creates them at its start
        if "UNKNOWN_TABLE" in str(exc) or "UNKNOWN_DATABASE" in str(exc):
            return None
        raise
    finally:
        store.close()


def counts(settings: Settings, expected: dict[str, int]) -> Callable[[], bool]:
    """A condition: each table (or ``SELECT count() ...`` with ``$db``) holds at least its number
    of rows, counted FINAL (one row per key, as the tests read them). At least: a row too many
    is for the test's exact assertions to show, not for the wait to time out on."""
    def sql(what: str) -> str:
        return what if " " in what else f"SELECT count() FROM $db.{what} FINAL"

    def reached(what: str, n: int) -> bool:
        got = query(settings, sql(what))
        return got is not None and len(got) == 1 and (got[0][0] or 0) >= n

    return lambda: all(reached(what, n) for what, n in expected.items())


def rows(settings: Settings, sql: str, expected: list[tuple[Any, ...]]) -> Callable[[], bool]:
    """A condition: ``sql`` answers exactly ``expected``."""
    return lambda: query(settings, sql) == expected
