"""The migrations rewritten for a ClickHouse cluster (``RLPULSE_CLICKHOUSE_CLUSTER=name``).

Every table ``db.t`` of a migration becomes two, both created ``ON CLUSTER``:

* ``db.t_local`` on every node: the migration's own columns and clauses with its engine made
  replicated (``ReplacingMergeTree(v)`` -> ``ReplicatedReplacingMergeTree('/clickhouse/tables/
  {shard}/{database}/t_local', '{replica}', v)``); it holds that shard's rows;
* ``db.t`` on every node: ``Distributed(cluster, db, t_local, <sharding key>)``, the table the
  sink inserts into and the saved queries read, under the same name as on a single server.

The sharding key is a function of the table's sorting key (run tables ``cityHash64(project,
run_id)``, GPU tables ``cityHash64(hw_id)``, alerts ``cityHash64(key)``, capacity ``cityHash64(pool)``), so every row of one
ReplacingMergeTree key lands on one shard: each shard's merges and ``FINAL`` replace exactly as
one server's do, and ``SELECT … FROM db.t FINAL`` is each shard's ``FINAL`` put together. GPU
samples and placements share a key (``hw_id``), so their join on ``hw_id`` is local to a shard.

``schema_migrations`` is one replicated table on every node (its Keeper path has no shard), so
any node says which migrations ran. Rewriting is text in, text out and refuses any statement it
does not know, so a new migration cannot silently stay single-node.
"""

from __future__ import annotations

import re
from rlpulse.base.errors import Error

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CREATE = re.compile(r"^CREATE TABLE (IF NOT EXISTS )?(\w+)\.(\w+) (\(.*\))\s*ENGINE = ReplacingMergeTree(\([^)]*\))?\s(.*)$",
                     re.DOTALL)
_ALTER = re.compile(r"^ALTER TABLE (\w+)\.(\w+)\s+(.*)$", re.DOTALL)
_INSERT = re.compile(r"^INSERT INTO (\w+)\.(\w+) (\([^)]*\))\s*(SELECT .*)$", re.DOTALL)
_VIEW = re.compile(r"^CREATE VIEW (IF NOT EXISTS )?(\w+)\.(\w+) AS\s+(SELECT .*)$", re.DOTALL)
_DROP = re.compile(r"^DROP TABLE (IF EXISTS )?(\w+)\.(\w+)$")
_RENAME = re.compile(r"^RENAME TABLE (\w+)\.(\w+) TO (\w+)\.(\w+)$")
_EXCHANGE = re.compile(r"^EXCHANGE TABLES (\w+)\.(\w+) AND (\w+)\.(\w+)$")
_VERSIONED = re.compile(r"_v\d+$")  # a migration's temporary copy (grader_failures_v4) keys as its table

# Sharding keys, each a function of the table's ORDER BY (tests/unit/sinks/store/test_cluster_ddl.py checks it).
_GPU_KEYED = {"gpu_samples": "cityHash64(hw_id)", "placements": "cityHash64(ifNull(hw_id, ''))",
              "alerts": "cityHash64(key)", "kafka_errors": "cityHash64(topic, partition)", "capacity": "cityHash64(pool)"}
RUN_KEY = "cityHash64(project, run_id)"


class UnclusteredStatement(Error, ValueError):
    """A migration statement this module does not know how to run on a cluster."""


def check_name(kind: str, name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"invalid {kind} name {name!r}: letters, digits and _ only, not starting with a digit")
    return name


def local(table: str) -> str:
    """The name of a table's per-shard part."""
    return f"{table}_local"


def sharding_key(table: str) -> str:
    """The Distributed table's sharding key for ``table`` (a migration's ``_vN`` copy keys as its table)."""
    return _GPU_KEYED.get(_VERSIONED.sub("", table), RUN_KEY)


def replicated_engine(table: str, args: str = "") -> str:
    """``ReplicatedReplacingMergeTree`` for ``table``'s local part; ``args``: the version column, if any."""
    extra = f", {args}" if args else ""
    return (f"ReplicatedReplacingMergeTree('/clickhouse/tables/{{shard}}/{{database}}/{local(table)}', "
            f"'{{replica}}'{extra})")


def distributed(db: str, table: str, cluster: str) -> str:
    return (f"CREATE TABLE IF NOT EXISTS {db}.{table} ON CLUSTER {cluster} AS {db}.{local(table)} "
            f"ENGINE = Distributed({cluster}, {db}, {local(table)}, {sharding_key(table)})")


def bootstrap_statements(db: str, cluster: str) -> list[str]:
    """The database on every node, and schema_migrations replicated to every node (no shard in its path)."""
    return [f"CREATE DATABASE IF NOT EXISTS {db} ON CLUSTER {cluster}",
            f"CREATE TABLE IF NOT EXISTS {db}.schema_migrations ON CLUSTER {cluster} "
            "(version String, applied_at DateTime DEFAULT now()) ENGINE = ReplicatedReplacingMergeTree("
            "'/clickhouse/tables/{database}/schema_migrations', '{replica}') ORDER BY version"]


def cluster_statements(statement: str, cluster: str) -> list[str]:
    """One single-server migration statement as the statements that do it on ``cluster``."""
    check_name("cluster", cluster)
    s = statement.strip()
    if m := _CREATE.match(s):
        exists, db, table, columns, args, rest = m.groups()
        rest = rest.replace("non_replicated_deduplication_window", "replicated_deduplication_window")
        engine = replicated_engine(table, (args or "()")[1:-1].strip())
        return [f"CREATE TABLE {exists or ''}{db}.{local(table)} ON CLUSTER {cluster} {columns} ENGINE = {engine}\n{rest}",
                distributed(db, table, cluster)]
    if m := _ALTER.match(s):
        db, table, clauses = m.groups()
        out = [f"ALTER TABLE {db}.{local(table)} ON CLUSTER {cluster} {clauses}"]
        # The Distributed table mirrors the columns (it has no sorting key): its own ALTER adds them.
        added = [c for c in top_level_clauses(clauses) if c.upper().startswith("ADD COLUMN")]
        if added:
            out.append(f"ALTER TABLE {db}.{table} ON CLUSTER {cluster} " + ", ".join(added))
        return out
    if m := _VIEW.match(s):
        exists, db, view, select = m.groups()
        # A plain view on every node reads the Distributed tables its SELECT names: every shard's rows.
        return [f"CREATE VIEW {exists or ''}{db}.{view} ON CLUSTER {cluster} AS {select}"]
    if m := _INSERT.match(s):
        db, table, columns, select = m.groups()
        # Into the Distributed table, written through to the shards before the statement returns,
        # so the migration's next statement (a DROP, an EXCHANGE) sees every row in place.
        return [f"INSERT INTO {db}.{table} {columns} SETTINGS distributed_foreground_insert = 1 {select}"]
    if m := _DROP.match(s):
        exists, db, table = m.groups()
        return [f"DROP TABLE {exists or ''}{db}.{t} ON CLUSTER {cluster} SYNC" for t in (table, local(table))]
    if m := _RENAME.match(s):
        db, old, db2, new = m.groups()
        # The Distributed table names its local part, so it is recreated under the new name.
        return [f"RENAME TABLE {db}.{local(old)} TO {db2}.{local(new)} ON CLUSTER {cluster}",
                f"DROP TABLE {db}.{old} ON CLUSTER {cluster} SYNC",
                distributed(db2, new, cluster)]
    if m := _EXCHANGE.match(s):
        db, a, db2, b = m.groups()
        # Each Distributed table still names <its name>_local, which now holds the other's rows.
        return [f"EXCHANGE TABLES {db}.{local(a)} AND {db2}.{local(b)} ON CLUSTER {cluster}"]
    raise UnclusteredStatement(f"no cluster form for migration statement {s[:120]!r}: teach sinks/store/cluster_ddl.py "
                               "how to run it ON CLUSTER")


def top_level_clauses(text: str) -> list[str]:
    """An ALTER's comma-separated clauses (commas inside parentheses belong to a clause)."""
    clauses, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            clauses.append(text[start:i].strip())
            start = i + 1
    return [c for c in (*clauses, text[start:].strip()) if c]
