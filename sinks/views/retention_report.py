"""``rlpulse retention``: each table's retention, what the sink kept out, and the changes.

Showing reads through the sink's read endpoint while a sink holds a chDB store (``open_reader``).
Setting writes the tables' TTL (``ALTER TABLE … MODIFY TTL``), which the read endpoint refuses by
design: with a chDB store held by a running sink, :func:`change_retention` says so and names the
fix (stop the sink, set, start it again; what was set stays, it is the tables' own TTL). A
ClickHouse server takes the change while sinks run.
"""

from __future__ import annotations

from collections.abc import Callable

from rlpulse.base import env as envvars
from rlpulse.base.settings import Settings
from rlpulse.base.terminal import terminal_safe
from rlpulse.sinks.store import retention
from rlpulse.sinks.store.clickhouse import Store, StoreBusyError, open_reader, open_store, require_database
from rlpulse.base.terminal import print_table

Say = Callable[[str], None]


def _days(days: int | None) -> str:
    return "kept for ever" if days is None else f"{days} day{'s' if days != 1 else ''}"


def retention_rows(found: list[retention.Retention], project: str | None = None) -> list[tuple[str, str, str]]:
    """(table, default, per-project overrides) per table; a TTL not written by rlpulse shows as it is."""
    rows = []
    for r in found:
        if r.default_days is None and not r.projects and r.ttl:
            rows.append((r.table, "set by hand", r.ttl))
            continue
        projects = {p: d for p, d in r.projects.items() if project is None or p == project}
        rows.append((r.table, _days(r.default_days), ", ".join(f"{p}: {_days(d)}" for p, d in sorted(projects.items()))))
    return rows


DROPPED_SQL = """
SELECT project, uniqExact(run_id) AS runs,
       uniqExactIf((run_id, attempt, step, rollout_id), content_capped = 1) AS trajectories_capped,
       countIf(content_capped = 1) AS spans_capped, sum(content_cut_chars) AS sink_cut_chars,
       sum(content_sdk_cut_chars) AS sdk_cut_chars
FROM {db}.spans FINAL
WHERE content_capped = 1 OR content_cut_chars > 0 OR content_sdk_cut_chars > 0
GROUP BY project ORDER BY project
"""


def dropped(store: Store, project: str | None = None) -> list[tuple]:
    """Per project: runs with something dropped, trajectories and spans capped, characters cut by the sink and the SDK.

    Only the small columns the sink fills are read (never the attributes, which hold the content)."""
    rows = store.client.query(DROPPED_SQL.replace("{db}", store.database)).result_rows
    return [tuple(r) for r in rows if project is None or r[0] == project]


def show_retention(settings: Settings, project: str | None = None, say: Say = print) -> None:
    if project is not None:
        retention.check_project(project)
    with open_reader(settings.clickhouse_dsn, owner="rlpulse retention") as store:
        require_database(store)
        found = retention.read(store, settings.clickhouse_cluster)
        lost = dropped(store, project)
    say(f"Retention in {store.url} (rows are deleted once their event time is older; per project first, "
        "then the table's default):")
    print_table(["table", "default", "projects with their own"], retention_rows(found, project))
    say("")
    say(f"Content kept out by the sink (caps here: {envvars.SPAN_CAP}={settings.span_cap} full trajectories per "
        f"step, 0 = all; {envvars.SINK_CONTENT_MAX_CHARS}={settings.sink_content_max_chars}; the sink applies its own "
        "environment's). Figures count every event; per step: rlpulse query --saved content-dropped --param run_id=RUN")
    if lost:
        print_table(["project", "runs", "trajectories capped", "spans capped", "chars cut by sink", "chars cut by SDK"], lost)
    else:
        say("nothing dropped" + (f" in project {project}" if project else ""))


def change_retention(settings: Settings, table: str, days: int | None, project: str | None = None,
                     say: Say = print) -> retention.Retention:
    """Set (``days``) or clear (None) the retention of ``table``, of ``project`` or its default."""
    retention.check_table(table)  # every input checked before the store is opened
    if project is not None:
        retention.check_project(project)
    if days is not None:
        retention.check_days(days)
    configured = settings.ttl_raw_days if table in retention.RAW_TABLES else settings.ttl_aggregate_days
    try:
        store = open_store(settings.clickhouse_dsn, owner="rlpulse retention")
    except StoreBusyError as exc:
        raise StoreBusyError(
            f"{exc} Changing retention alters the tables' TTL, a write, and the sink's read endpoint only reads. Stop "
            "the sink, run this again, then start the sink: the retention stays set (it is the tables' own TTL)."
        ) from None
    with store:
        require_database(store)
        done = retention.change(store, table, days, project, settings.clickhouse_cluster, default_days=configured)
    # A project name is anyone's text: a newline in one would forge a line of this output.
    who = f"project {terminal_safe(project)}" if project is not None else "every other project"
    if days is None and project is not None:
        say(f"{table}: {who} now follows the table's default ({_days(done.default_days)})")
    else:
        say(f"{table}: {who} kept {_days(done.projects.get(project) if project is not None else done.default_days)}; "
            "rows past it are deleted (those already stored too)")
    return done
