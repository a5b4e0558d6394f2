"""Plain-text figures read from ClickHouse with SQL (the end of ``rlpulse demo``)."""

from __future__ import annotations

from typing import Any, Sequence

from sinks.clickhouse import Store

EVENT_TABLES = ("spans", "steps", "gpu_samples", "placements", "grader_failures")


def print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(c) for c in columns]] + [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for n, row in enumerate(cells):
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def rows_per_table(store: Store, project: str | None) -> list[tuple[str, int]]:
    db = store.database
    where, params = ("WHERE project = {project:String}", {"project": project}) if project else ("", {})
    return [
        (table, store.client.query(f"SELECT count() FROM {db}.{table} FINAL {where}", parameters=params).result_rows[0][0])
        for table in EVENT_TABLES
    ]


def failures_by_cause(store: Store, project: str | None) -> tuple[list[str], list[tuple]]:
    """Per run and cause: failures and the failure rate over all graded scores of the run."""
    db = store.database
    where, params = ("WHERE project = {project:String}", {"project": project}) if project else ("", {})
    sql = f"""
        SELECT run_id, attempt, cause, sum(failures) AS failures,
               sum(graded) AS graded, round(failures / graded, 4) AS failure_rate
        FROM {db}.grader_failures FINAL {where}
        GROUP BY run_id, attempt, cause
        ORDER BY run_id, attempt, cause
    """
    result = store.client.query(sql, parameters=params)
    return list(result.column_names), result.result_rows


def print_report(store: Store, project: str | None = None) -> None:
    scope = f"project {project}" if project else "all projects"
    print(f"\n== rows per table ({scope}) ==")
    print_table(["table", "rows"], rows_per_table(store, project))
    print(f"\n== grader failures by cause, per run ({scope}) ==")
    columns, rows = failures_by_cause(store, project)
    print_table(columns, rows)
