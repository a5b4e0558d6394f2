"""``rlpulse capacity``: the latest capacity figures of each pool and project, in the seed's columns.

Seed 001, "Capacity over time": the trainer service's gauges map to the columns of its capacity
command, DECLARED and OBSERVED first. The figures are the saved queries ``capacity`` and
``capacity-projects`` (``sinks/read/queries/``): each service instance's latest report, then the max
across instances, never the sum; a pool or project whose last claim ended reads 0 and stays listed.
OBSERVED is ``-`` until an instance has read the cluster (the gauge has no value until then).
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from datetime import datetime, timezone
from typing import Any

from rlpulse.sinks.store.clickhouse import NoDataError, Store, require_database
from rlpulse.sinks.read.queries import run_query, saved_sql
from rlpulse.base.terminal import print_table

# heading -> the saved query's column
POOL_COLUMNS = (("POOL", "pool"), ("ACCELERATOR", "accelerator"), ("SERVING", "serving"), ("DECLARED", "declared"),
                ("OBSERVED", "observed"), ("GRANTED", "granted"), ("QUEUED", "queued"),
                ("CLAIMS GRANTED", "claims_granted"), ("CLAIMS QUEUED", "claims_queued"), ("INSTANCES", "instances"),
                ("REPORTED", "reported"))
PROJECT_COLUMNS = (("PROJECT", "project"), ("POOL", "pool"), ("GRANTED", "granted"), ("QUEUED", "queued"),
                   ("QUOTA", "quota"), ("INSTANCES", "instances"), ("REPORTED", "reported"))


def _cell(value: Any) -> Any:
    if value is None:
        return "-"  # no value: OBSERVED before the service read the cluster, a project without a quota
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, datetime):
        aware = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
        return aware.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return value


def _rows(store: Store, name: str, columns: tuple[tuple[str, str], ...]) -> list[list[Any]]:
    names, rows = run_query(store.client, saved_sql(name, {}, store.database))
    at = [names.index(column) for _, column in columns]
    return [[_cell(row[i]) for i in at] for row in rows]


def capacity_tables(store: Store) -> tuple[list[list[Any]], list[list[Any]]]:
    """The pools' rows and the projects' rows, as printed (headings in POOL_COLUMNS, PROJECT_COLUMNS)."""
    require_database(store)
    exists = store.client.query("SELECT count() FROM system.tables WHERE database = {db:String} AND name = 'capacity'",
                                parameters={"db": store.database}).result_rows[0][0]
    if not exists:
        raise NoDataError(f"{store.url} has no capacity table: its migrations predate it. Run `rlpulse migrate` (or the sink)")
    return _rows(store, "capacity", POOL_COLUMNS), _rows(store, "capacity-projects", PROJECT_COLUMNS)


def render_capacity(pools: list[list[Any]], projects: list[list[Any]]) -> str:
    """The command's text: the pools, then (when any project reported claims) the projects."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        if not pools and not projects:
            print("no capacity reported yet: the trainer service publishes it "
                  "(rlpulse.producers.pollers.capacity.CapacityReporter)")
            return buf.getvalue()
        print_table([h for h, _ in POOL_COLUMNS], pools)
        if projects:
            print()
            print_table([h for h, _ in PROJECT_COLUMNS], projects)
    return buf.getvalue()
