"""Plain-text figures read from ClickHouse with SQL (the end of ``rlpulse demo``)."""

from __future__ import annotations


from rlpulse.base.terminal import print_table, terminal_safe
from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views.step_figures import gpu_time, out_of_range_note, summarize, summary_figures, throughput
from rlpulse.sinks.views import term_figures

EVENT_TABLES = ("spans", "steps", "gpu_samples", "placements", "grader_failures", "step_stats", "reward_histograms",
                "step_term_stats", "completion_length_histograms", "alerts")


def rows_per_table(store: Store, project: str | None) -> list[tuple[str, int]]:
    db = store.database
    where, params = ("WHERE project = {project:String}", {"project": project}) if project else ("", {})
    return [
        (table, store.client.query(f"SELECT count() FROM {db}.{table} FINAL {where}", parameters=params).result_rows[0][0])
        for table in EVENT_TABLES
    ]


def failures_by_cause(store: Store, project: str | None) -> tuple[list[str], list[tuple]]:
    """Per run, term and cause: failures and the failure rate over that term's graded scores.

    Per term: over all the run's scores, a term that never fails would halve the rate of one that does."""
    db = store.database
    where, params = ("WHERE project = {project:String}", {"project": project}) if project else ("", {})
    sql = f"""
        SELECT run_id, attempt, term, cause, sum(failures) AS failures,
               sum(graded) AS graded, round(if(graded = 0, 0, failures / graded), 4) AS failure_rate
        FROM {db}.grader_failures FINAL {where}
        GROUP BY run_id, attempt, term, cause
        ORDER BY run_id, attempt, term, cause
    """
    result = store.client.query(sql, parameters=params)
    return list(result.column_names), result.result_rows


def _query(store: Store, sql: str, project: str | None) -> tuple[list[str], list[tuple]]:
    where, params = ("WHERE project = {project:String}", {"project": project}) if project else ("", {})
    result = store.client.query(sql.format(db=store.database, where=where, project="{project:String}"), parameters=params)
    return list(result.column_names), result.result_rows


def step_figures(store: Store, project: str | None) -> tuple[list[str], list[tuple]]:
    return _query(store, """
        SELECT run_id, attempt, step, rollouts, clipped, round(clipped_ratio, 3) AS clipped_ratio,
               round(reward_mean, 3) AS reward_mean, round(reward_zero_fraction, 3) AS zero_fraction,
               round(completion_mean) AS completion_mean, round(zero_std_fraction, 3) AS zero_std_fraction, staleness_max
        FROM {db}.step_stats FINAL {where} ORDER BY run_id, attempt, step""", project)


def per_term_figures(store: Store, project: str | None) -> tuple[list[str], list[tuple], str]:
    """Per attempt and reward term: the term's figures over the run (rlpulse.sinks.views.term_figures, as the
    run page sums them), read with the saved query term-figures; and the note on failures without a cost."""
    _, runs = _query(store, "SELECT DISTINCT project, run_id FROM {db}.step_term_stats {where} ORDER BY project, run_id",
                     project)
    columns = (["project"] if project is None else []) + ["run_id", "attempt"] + [h for h, _ in term_figures.COLUMNS]
    rows, notes = [], []
    for proj, run in runs:
        found = term_figures.term_rows(store, proj, run)
        for attempt in sorted({int(r["attempt"]) for r in found}):
            summaries = term_figures.summarize([r for r in found if r["attempt"] == attempt])
            rows += [((proj,) if project is None else ()) + (run, attempt) + term_figures.summary_row(t) for t in summaries]
            note = term_figures.cost_note(summaries)
            if note:
                notes.append(f"{run} attempt {attempt}: {note}")
    return columns, rows, "\n".join(notes)


def run_status(store: Store, project: str | None) -> tuple[list[str], list[tuple]]:
    """How each attempt ended (its RUN_END status), or running while none arrived."""
    return _query(store, """
        SELECT run_id, attempt,
               if(countIf(type = 'RUN_END') > 0, ifNull(argMaxIf(status, time_ns, type = 'RUN_END'), 'unknown'),
                  'running') AS status,
               max(step_count) AS steps
        FROM {db}.steps FINAL {where} GROUP BY run_id, attempt ORDER BY run_id, attempt""", project)


def per_run_figures(store: Store, project: str | None) -> tuple[list[str], list[tuple]]:
    """Per attempt with a STEP event: the per-step figures summed up (rlpulse.sinks.views.step_figures: tokens,
    median tokens/s and mean MFU over its last steps, steps with an MFU outside [0, 1]), each attempt's rows
    read with the saved query step-throughput, so the report says what ``rlpulse query --saved`` and the run
    page say. More per-step figure families add their summary columns here."""
    _, attempts = _query(store, """
        SELECT project, run_id, attempt FROM {db}.steps {where}
        GROUP BY project, run_id, attempt HAVING countIf(type = 'STEP') > 0 ORDER BY project, run_id, attempt""", project)
    labels = [label for _, label, _ in summary_figures(summarize([]))]
    columns = (["project"] if project is None else []) + ["run_id", "attempt", "steps"] + labels
    rows = []
    for proj, run, attempt in attempts:
        summary = summarize(throughput(store, proj, run, attempt))
        rows.append(((proj,) if project is None else ()) + (run, attempt, summary.steps)
                    + tuple(value for _, _, value in summary_figures(summary)))
    return columns, rows


def reward_histograms(store: Store, project: str | None) -> list[tuple[str, list[float], list[int]]]:
    """Per run: bucket bounds and the bucket counts of the total reward over all steps."""
    _, rows = _query(store, """
        SELECT run_id, any(bounds), sumForEach(bucket_counts)
        FROM {db}.reward_histograms FINAL {where} GROUP BY run_id, term HAVING term = 'total' ORDER BY run_id""", project)
    return [(r[0], list(r[1]), list(r[2])) for r in rows]


def alerts(store: Store, project: str | None) -> tuple[list[str], list[tuple]]:
    return _query(store, """
        SELECT formatDateTime(time, '%H:%i:%S') AS time, rule, state, key, summary
        FROM {db}.alerts FINAL {where} ORDER BY time_ns, rule, state""", project)


def _bucket_labels(bounds: list[float]) -> list[str]:
    labels = [f"<= {bounds[0]:g}"]
    labels += [f"({lo:g}, {hi:g}]" for lo, hi in zip(bounds, bounds[1:])]
    return labels + [f"> {bounds[-1]:g}"]


def print_histogram(bounds: list[float], counts: list[int], width: int = 40) -> None:
    top = max(counts) or 1
    for label, n in zip(_bucket_labels(bounds), counts):
        print(f"  {label:>12}  {'#' * round(width * n / top):<{width}} {n}")


def print_report(store: Store, project: str | None = None) -> None:
    # The tables are made safe by print_table; the headings name a project and run ids as well.
    scope = f"project {terminal_safe(project)}" if project else "all projects"
    print(f"\n== rows per table ({scope}) ==")
    print_table(["table", "rows"], rows_per_table(store, project))
    print(f"\n== how runs ended ({scope}) ==")
    print_table(*run_status(store, project))
    print(f"\n== grader failures by term and cause, per run ({scope}) ==")
    print_table(*failures_by_cause(store, project))
    print(f"\n== clipped ratio and reward per step ({scope}) ==")
    print_table(*step_figures(store, project))
    print(f"\n== reward terms per run: share, grader calls, failures and their cost, judge tokens ({scope}) ==")
    columns, rows, note = per_term_figures(store, project)
    print_table(columns, rows)
    if note:
        print(terminal_safe(note))
    print(f"\n== throughput and efficiency per run ({scope}) ==")
    columns, rows = per_run_figures(store, project)
    print_table(columns, rows)
    note = out_of_range_note(sum(int(r[-1]) for r in rows))  # summary_figures' last: steps with an MFU outside [0, 1]
    if note:
        print(note)
    print(f"\n== GPU time per run: GPUs held, GPU hours, energy ({scope}) ==")
    print_table((["project"] if project is None else []) + ["run_id", "attempt", "gpus", "gpu_hours", "energy_kwh"],
                [((g.project,) if project is None else ()) + (g.run_id, g.attempt, g.gpus, round(g.gpu_hours, 4),
                  None if g.energy_kwh is None else round(g.energy_kwh, 4)) for g in gpu_time(store, project)])
    for run_id, bounds, counts in reward_histograms(store, project):
        print(f"\n== reward histogram, run {terminal_safe(str(run_id))} (all steps, term total) ==")
        print_histogram(bounds, counts)
    print(f"\n== alerts ({scope}) ==")
    print_table(*alerts(store, project))


def stored_rows(store: Store) -> int:
    """Rows in the database's tables, from the parts' metadata (no scan): 0 for a store nothing reached yet."""
    rows = store.client.query("SELECT sum(total_rows) FROM system.tables WHERE database = {db:String} "
                              "AND name != 'schema_migrations'", parameters={"db": store.database}).result_rows
    return int(rows[0][0] or 0) if rows else 0


def _names(store: Store, column: str) -> str:
    if column not in ("project", "run_id"):
        raise ValueError(f"column must be project or run_id, not {column!r}")
    return (f"(SELECT project, run_id, time_ns AS t FROM {store.database}.steps "
            f"UNION ALL SELECT project, run_id, start_time_ns AS t FROM {store.database}.spans)")


def has_rows(store: Store, column: str, value: str) -> bool:
    """True if steps or spans have a row whose ``column`` (project or run_id) is ``value``."""
    rows = store.client.query(f"SELECT count() FROM {_names(store, column)} WHERE {column} = {{v:String}}",
                              parameters={"v": value}).result_rows
    return bool(rows[0][0])


def latest_names(store: Store, column: str, limit: int = 5) -> list[str]:
    """The ``limit`` projects (``column="project"``) or runs (``"run_id"``) with the latest steps or spans,
    latest first: what an error about an unknown name can offer instead."""
    rows = store.client.query(f"SELECT {column} FROM {_names(store, column)} GROUP BY {column} "
                              f"ORDER BY max(t) DESC LIMIT {int(limit)}").result_rows
    return [r[0] for r in rows]
