"""Cluster mode's DDL (sinks/store/cluster_ddl.py): golden statements for one table of each kind, every
migration statement in a cluster form, sharding keys that keep each ReplacingMergeTree key on one
shard, and every generated statement parsed by ClickHouse's own parser (chDB's formatQuery).

No cluster runs here (no Docker, no Keeper): what ClickHouse does with these statements on a
cluster is not tested; that they are what we mean and valid ClickHouse SQL is.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlpulse.schemas.catalogue import NATURAL_KEYS
from rlpulse.sinks.read import queries
from rlpulse.sinks.store.clickhouse import MIGRATIONS, migration_statements
from rlpulse.sinks.store.cluster_ddl import UnclusteredStatement, bootstrap_statements, cluster_statements, sharding_key

REPO = Path(__file__).resolve().parents[4]
DB, CLUSTER = "rlpulse", "rlpulse"


def cluster_migrations() -> list[str]:
    out = bootstrap_statements(DB, CLUSTER)
    for path in sorted(MIGRATIONS.glob("*.sql")):
        out += migration_statements(path, DB, cluster=CLUSTER)
    return out


def test_a_run_table_is_a_replicated_local_part_and_a_distributed_table_sharded_by_run() -> None:
    spans = migration_statements(MIGRATIONS / "001_init.sql", DB)[0]
    local, dist = cluster_statements(spans, CLUSTER)
    assert local.startswith(
        "CREATE TABLE IF NOT EXISTS rlpulse.spans_local ON CLUSTER rlpulse (\n    project LowCardinality(String),"
    )
    assert local.endswith(
        "    sample_id Nullable(String)\n"
        ") ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/spans_local', '{replica}')\n"
        "PARTITION BY toDate(end_time)\n"
        "ORDER BY (project, run_id, attempt, sequence_id, span_id)\n"
        "TTL toDateTime(end_time) + INTERVAL 90 DAY\n"
        "SETTINGS replicated_deduplication_window = 10000"
    )
    # the columns are the migration's own, unchanged
    assert local.split("(", 1)[1].rsplit(") ENGINE", 1)[0] == spans.split("(", 1)[1].rsplit(") ENGINE", 1)[0]
    assert dist == (
        "CREATE TABLE IF NOT EXISTS rlpulse.spans ON CLUSTER rlpulse AS rlpulse.spans_local "
        "ENGINE = Distributed(rlpulse, rlpulse, spans_local, cityHash64(project, run_id))"
    )


def test_a_gpu_table_shards_by_hw_id_and_a_versioned_table_keeps_its_version() -> None:
    statements = migration_statements(MIGRATIONS / "001_init.sql", DB)
    gpu = next(s for s in statements if ".gpu_samples (" in s)
    local, dist = cluster_statements(gpu, CLUSTER)
    assert (
        ") ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/gpu_samples_local', '{replica}')\n"
        "PARTITION BY toDate(time)\nORDER BY (hw_id, time_ns)\n" in local
    )
    assert dist == (
        "CREATE TABLE IF NOT EXISTS rlpulse.gpu_samples ON CLUSTER rlpulse AS rlpulse.gpu_samples_local "
        "ENGINE = Distributed(rlpulse, rlpulse, gpu_samples_local, cityHash64(hw_id))"
    )
    windows = next(s for s in migration_statements(MIGRATIONS / "003_grader_windows.sql", DB))
    assert (
        "ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/grader_windows_local', "
        "'{replica}', emitted_at_ns)\n"
    ) in cluster_statements(windows, CLUSTER)[0]


def test_schema_migrations_is_one_table_replicated_to_every_node() -> None:
    assert bootstrap_statements(DB, CLUSTER) == [
        "CREATE DATABASE IF NOT EXISTS rlpulse ON CLUSTER rlpulse",
        "CREATE TABLE IF NOT EXISTS rlpulse.schema_migrations ON CLUSTER rlpulse (version String, applied_at DateTime "
        "DEFAULT now()) ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{database}/schema_migrations', "
        "'{replica}') ORDER BY version",
    ]


def test_alters_inserts_drops_renames_and_exchanges() -> None:
    m4 = migration_statements(MIGRATIONS / "004_writer_ids_and_grader_failures.sql", DB)
    assert cluster_statements(m4[1], CLUSTER) == [
        "ALTER TABLE rlpulse.steps_local ON CLUSTER rlpulse ADD COLUMN IF NOT EXISTS writer_id String,\n"
        "    ADD COLUMN IF NOT EXISTS sequence_id UInt64,\n"
        "    MODIFY ORDER BY (project, run_id, attempt, time_ns, type, writer_id, sequence_id)",
        # a Distributed table has no sorting key: it only gets the columns
        "ALTER TABLE rlpulse.steps ON CLUSTER rlpulse ADD COLUMN IF NOT EXISTS writer_id String, "
        "ADD COLUMN IF NOT EXISTS sequence_id UInt64",
    ]
    insert, drop, rename = m4[3:6]
    assert cluster_statements(insert, CLUSTER)[0].startswith(
        "INSERT INTO rlpulse.grader_failures_v4 (project, run_id, attempt, term, cause, window_start_ns, window_end_ns, "
        "failures, graded, emitted_at_ns) SETTINGS distributed_foreground_insert = 1 SELECT project, run_id,"
    )
    assert cluster_statements(drop, CLUSTER) == [
        "DROP TABLE rlpulse.grader_failures ON CLUSTER rlpulse SYNC",
        "DROP TABLE rlpulse.grader_failures_local ON CLUSTER rlpulse SYNC",
    ]
    assert cluster_statements(rename, CLUSTER) == [
        "RENAME TABLE rlpulse.grader_failures_v4_local TO rlpulse.grader_failures_local ON CLUSTER rlpulse",
        "DROP TABLE rlpulse.grader_failures_v4 ON CLUSTER rlpulse SYNC",
        "CREATE TABLE IF NOT EXISTS rlpulse.grader_failures ON CLUSTER rlpulse AS rlpulse.grader_failures_local "
        "ENGINE = Distributed(rlpulse, rlpulse, grader_failures_local, cityHash64(project, run_id))",
    ]
    m5 = migration_statements(MIGRATIONS / "005_placements_by_gpu.sql", DB)
    assert cluster_statements(m5[3], CLUSTER) == [
        "EXCHANGE TABLES rlpulse.placements_v5_local AND rlpulse.placements_local ON CLUSTER rlpulse"
    ]


def test_every_migration_statement_has_a_cluster_form_and_nothing_stays_single_node() -> None:
    statements = cluster_migrations()
    assert len(statements) > 40
    for s in statements:
        if s.startswith("INSERT"):  # an INSERT has no ON CLUSTER: it goes through the Distributed table
            assert "SETTINGS distributed_foreground_insert = 1 SELECT" in s
            assert re.match(r"INSERT INTO rlpulse\.\w+ ", s) and "_local" not in s
            continue
        assert " ON CLUSTER rlpulse" in s, s[:120]
        assert not re.search(r"ENGINE = ReplacingMergeTree|non_replicated", s), s[:200]
    creates = [
        re.match(r"CREATE TABLE (?:IF NOT EXISTS )?rlpulse\.(\w+) ON CLUSTER rlpulse (AS|\()", s)
        for s in statements
        if s.startswith("CREATE TABLE")
    ]
    locals_ = {m[1] for m in creates if m[2] == "("}
    distributed = {m[1] for m in creates if m[2] == "AS"}
    assert locals_ - {"schema_migrations"} == {f"{t}_local" for t in distributed}
    with pytest.raises(UnclusteredStatement, match="no cluster form for migration statement 'TRUNCATE"):
        cluster_statements("TRUNCATE TABLE rlpulse.spans", CLUSTER)
    with pytest.raises(ValueError, match="invalid cluster name"):
        cluster_statements("DROP TABLE rlpulse.x", "a; DROP")


def test_each_sharding_key_is_a_function_of_the_tables_sorting_key() -> None:
    """Rows equal in ORDER BY (one ReplacingMergeTree key) hash alike, so they meet on one shard.

    Checked on each table's last sorting key: 005 rebuilds placements with hw_id in its key (001's
    key lacked it, and wrongly merged the GPUs of one process into one row)."""
    last = {}
    for s in cluster_migrations():
        m = re.match(r"CREATE TABLE (?:IF NOT EXISTS )?rlpulse\.(\w+)_local ON CLUSTER .*\nORDER BY \((.*?)\)\n", s, re.S)
        if m:
            last[re.sub(r"_v\d+$", "", m[1])] = m[2]
    assert set(last) == set(NATURAL_KEYS)  # every table of the catalogue, each once
    for table, order_by in last.items():
        key_columns = set(re.findall(r"\b(project|run_id|hw_id|key|pool)\b", sharding_key(table)))
        assert key_columns and key_columns <= set(re.findall(r"\w+", order_by)), (table, sharding_key(table), order_by)


def test_saved_queries_read_the_distributed_tables_by_their_own_names() -> None:
    sql = queries.saved_sql("failures-by-cause", {"since": "2026-01-01 00:00:00", "until": "2026-01-02 00:00:00"}, DB)
    assert "    FROM rlpulse.grader_failures\n    WHERE window_start >= {since:DateTime64(3, 'UTC')}" in sql
    distributed = {
        re.match(r"CREATE TABLE IF NOT EXISTS rlpulse\.(\w+) ON CLUSTER rlpulse AS", s)[1]
        for s in cluster_migrations()
        if " AS rlpulse." in s and s.startswith("CREATE TABLE")
    }
    # a view on every node, over the Distributed tables its SELECT names
    views = {re.match(r"CREATE VIEW IF NOT EXISTS rlpulse\.(\w+) ON CLUSTER rlpulse AS", s)[1]
             for s in cluster_migrations() if s.startswith("CREATE VIEW")}
    assert views == {"step_metrics"}
    distributed |= views
    for name in queries.list_saved():
        for table in re.findall(r"\{db\}\.(\w+)", queries.load_saved(name)):
            assert table in distributed, (name, table)


PARSE = """
import json, sys
import chdb
q = lambda s: "'" + s.replace("\\\\", "\\\\\\\\").replace("'", "\\\\'") + "'"
out = []
for s in json.loads(sys.stdin.read()):
    try:
        out.append(["ok", chdb.query("SELECT formatQuerySingleLine(" + q(s) + ")", "TSVRaw").bytes().decode().strip()])
    except Exception as exc:
        out.append(["error", str(exc)[:300]])
print(json.dumps(out))
"""


def parse_with_clickhouse(statements: list[str]) -> list[list[str]]:
    """Each statement through ClickHouse's parser (formatQuery) in a chDB subprocess: [status, formatted]."""
    pytest.importorskip("chdb")
    run = subprocess.run(
        [sys.executable, "-c", PARSE], input=json.dumps(statements), capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_every_cluster_statement_is_valid_clickhouse_sql() -> None:
    statements = cluster_migrations()
    parsed = parse_with_clickhouse(statements + ["CREATE TABLE rlpulse.x ON CLUSTER rlpulse (a"])
    for statement, (status, formatted) in zip(statements, parsed):
        assert status == "ok", (statement[:200], formatted)
        assert "ON CLUSTER rlpulse" in formatted or formatted.startswith("INSERT")
    assert parsed[-1][0] == "error" and "Syntax error" in parsed[-1][1]  # the parser does refuse bad SQL
