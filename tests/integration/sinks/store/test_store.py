"""The ClickHouse store: migrations, the one-process-per-chDB-store rule, secrets kept out of errors."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlpulse.base.urls import mask_url
from rlpulse.sinks.store.clickhouse import migrate, open_store

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[4]


def test_migrations_apply_once_and_record_themselves(tmp_path: Path) -> None:
    with open_store(f"chdb://{tmp_path / 'ch'}", owner="test") as store:
        assert migrate(store) == ["001_init", "002_step_figures", "003_grader_windows", "004_writer_ids_and_grader_failures",
                                  "005_placements_by_gpu", "006_trainers", "007_engine_capacity", "008_traces",
                                  "009_checkpoints", "010_content_bounds",
                                  "011_content_sdk_cut", "012_merge_settings", "013_start_order", "014_rollouts_attempted",
                                  "015_gpu_health", "016_engine_figures", "017_step_term_figures",
                                  "018_run_config", "019_compact_spans"]
        assert migrate(store) == []
        tables = {r[0] for r in store.client.query("SHOW TABLES FROM rlpulse").result_rows}
        engines = dict(store.client.query("SELECT name, engine_full FROM system.tables WHERE database = 'rlpulse' "
                                          "AND engine LIKE '%MergeTree'").result_rows)
    assert {"spans", "steps", "gpu_samples", "placements", "grader_failures", "alerts", "step_stats",
            "reward_histograms", "completion_length_histograms", "schema_migrations", "engine_samples", "capacity",
            "step_metrics"} <= tables
    # 012: every table of rows merges about 20 parts of a size at once (fewer merges while a backlog drains)
    assert sorted(name for name, full in engines.items() if "merge_selector_base = 20" in full) == sorted(
        set(engines) - {"schema_migrations"})
    # 019: the spans' parts are compact up to 128 MiB
    assert "min_bytes_for_wide_part = 134217728" in engines["spans"]


def test_004_adds_writer_ids_and_folds_grader_failures_per_source_partition_into_one_row(tmp_path: Path) -> None:
    """Rows the streams wrote per source partition before 004 become one row per window, summed."""
    with open_store(f"chdb://{tmp_path / 'ch'}", owner="test") as store:
        migrate(store, until="003_grader_windows")
        db, now = store.database, time.time_ns()
        cols = ["project", "run_id", "attempt", "term", "cause", "window_start_ns", "window_end_ns", "failures", "graded",
                "source_partition", "emitted_at_ns"]
        store.client.insert(f"{db}.grader_failures", [
            ["p", "r", 1, "judge", "timeout", now, now + 60, 2, 10, 0, now],
            ["p", "r", 1, "judge", "timeout", now, now + 60, 1, 5, 1, now + 5],
            ["p", "r", 1, "judge", "timeout", now, now + 60, 9, 9, 1, now - 5],  # superseded by the row above
            ["p", "r", 1, "judge", "unreadable", now, now + 60, 0, 15, 0, now],
        ], column_names=cols)
        assert migrate(store, until="004_writer_ids_and_grader_failures") == ["004_writer_ids_and_grader_failures"]
        got = store.client.query(f"SELECT cause, failures, graded, failure_rate, emitted_at_ns FROM {db}.grader_failures "
                                 "ORDER BY cause").result_rows
        assert got == [("timeout", 3, 15, 0.2, now + 5), ("unreadable", 0, 15, 0.0, now)]
        columns = {t: {r[0] for r in store.client.query(f"SELECT name FROM system.columns WHERE database = '{db}' "
                                                          f"AND table = '{t}'").result_rows} for t in ("spans", "steps")}
        assert "writer_id" in columns["spans"] and {"writer_id", "sequence_id"} <= columns["steps"]
        key = store.client.command(f"SELECT sorting_key FROM system.tables WHERE database = '{db}' AND name = 'steps'")
        assert key.endswith("writer_id, sequence_id")


def test_a_second_process_is_told_who_holds_the_chdb_store(tmp_path: Path) -> None:
    url = f"chdb://{tmp_path / 'ch'}"
    with open_store(url, owner="rlpulse sink"):
        env = dict(os.environ, RLPULSE_CLICKHOUSE_URL=url, PYTHONPATH=str(REPO))
        run = subprocess.run(
            [sys.executable, "-m", "rlpulse.cli", "migrate"], env=env, capture_output=True, text=True, timeout=120
        )
    assert run.returncode == 1
    assert f"is open in pid {os.getpid()} (rlpulse sink)" in run.stderr
    assert "chDB allows one process per store" in run.stderr
    # once released, the other process gets it
    run = subprocess.run([sys.executable, "-m", "rlpulse.cli", "migrate"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert (
        "database rlpulse: applied 001_init, 002_step_figures, 003_grader_windows, 004_writer_ids_and_grader_failures"
        in run.stdout
    )


def test_clickhouse_password_never_appears_in_errors() -> None:
    url = "http://rlpulse:s3cret-pw@127.0.0.1:1/rlpulse"  # nothing listens on port 1
    assert mask_url(url) == "http://rlpulse:***@127.0.0.1:1/rlpulse"
    with pytest.raises(ConnectionError) as err:
        open_store(url)
    assert "s3cret-pw" not in str(err.value) and "***" in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_ttls_come_from_settings(tmp_path: Path) -> None:
    with open_store(f"chdb://{tmp_path / 'ch'}", owner="test") as store:
        migrate(store, ttl_raw_days=7, ttl_aggregate_days=30)
        spans = store.client.command("SHOW CREATE TABLE rlpulse.spans")
        windows = store.client.command("SHOW CREATE TABLE rlpulse.grader_windows")
    assert "toIntervalDay(7)" in spans or "INTERVAL 7 DAY" in spans
    assert "toIntervalDay(30)" in windows or "INTERVAL 30 DAY" in windows


def test_005_puts_the_gpu_in_the_placements_key_and_keeps_every_row(tmp_path: Path) -> None:
    """Placements written under the old key survive the rebuild, and four GPUs of one process
    published at one time_ns stay four rows (the old key kept one)."""
    with open_store(f"chdb://{tmp_path / 'ch'}", owner="test") as store:
        migrate(store, until="004_writer_ids_and_grader_failures")
        db, q, now = store.database, store.client.query, time.time_ns() // 1_000_000_000 * 1_000_000_000
        cols = ["project", "run_id", "attempt", "stage", "time_ns", "role", "rank", "pod", "node", "host", "index", "hw_id"]

        def rows(run_id: str, t: int, gpus: list[tuple[int | None, str | None]], rank: int = 0) -> list[list]:
            return [["p", run_id, 1, "train", t, "trainer", rank, "pod", "n1", "h1", i, hw] for i, hw in gpus]

        old = (
            rows("r1", now, [(0, "GPU-a")])
            + rows("r1", now + 15, [(0, "GPU-a")])
            + rows("r1", now, [(1, "GPU-b")], rank=1)
            + rows("r2", now, [(None, None)])
            + rows("r3", now, [(0, None)], rank=2)
        )
        for row in old:  # one insert each: separate parts, as the sink's batches leave them
            store.client.insert(f"{db}.placements", [row], column_names=cols)
        # two GPUs of one process at one time, not merged yet (a merge under the old key keeps one:
        # what it already dropped no migration brings back, so merges wait here)
        store.client.command(f"SYSTEM STOP MERGES {db}.placements")
        store.client.insert(
            f"{db}.placements",
            rows("r4", now, [(0, "GPU-c"), (1, "GPU-d")]),
            column_names=cols,
            settings={"optimize_on_insert": 0},
        )
        select = f"SELECT run_id, time_ns, rank, `index`, hw_id FROM {db}.placements ORDER BY run_id, time_ns, rank, hw_id"
        before = q(select).result_rows
        assert len(before) == 7
        assert migrate(store, until="005_placements_by_gpu") == ["005_placements_by_gpu"]
        after = q(select).result_rows
        assert after == before
        assert q(select.replace("placements", "placements FINAL")).result_rows == before
        key = store.client.command(f"SELECT sorting_key FROM system.tables WHERE database = '{db}' AND name = 'placements'")
        assert key.replace("\\'", "'") == "project, run_id, attempt, role, rank, ifNull(hw_id, ''), ifNull(index, -1), time_ns"
        # now a process's four GPUs at one time_ns are four rows, after dedup too
        store.client.insert(f"{db}.placements", rows("r5", now, [(i, f"GPU-{i}") for i in range(4)]), column_names=cols)
        store.client.insert(f"{db}.placements", rows("r5", now, [(i, f"GPU-{i}") for i in range(4)]), column_names=cols)
        store.client.command(f"OPTIMIZE TABLE {db}.placements FINAL")
        assert q(f"SELECT hw_id FROM {db}.placements FINAL WHERE run_id = 'r5' ORDER BY hw_id").result_rows == [
            (f"GPU-{i}",) for i in range(4)
        ]
        assert "placements_v5" not in {r[0] for r in q(f"SHOW TABLES FROM {db}").result_rows}
