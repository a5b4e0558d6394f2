"""The catalogue's natural keys are the tables' deduplication keys, as the migrations leave them.

The migrations are read as text (no ClickHouse): each statement that sets a table's sorting key
(CREATE TABLE … ORDER BY, ALTER TABLE … MODIFY ORDER BY) or moves it to another name (RENAME,
EXCHANGE, DROP) is replayed in file order, so a key changed or a table rebuilt by a later
migration counts, not the one first created.
"""

from __future__ import annotations

import re

import pytest

from rlpulse.schemas.catalogue import BY_SHORT, DERIVED_TOPICS, KEY_FIELDS, NATURAL_KEYS, TABLES, record_key, topic_key
from rlpulse.schemas.codec import load_schemas
from rlpulse.sinks.store.clickhouse import MIGRATIONS, migration_statements
from rlpulse.streams.testing import NATURAL_KEYS as HARNESS_KEYS

DB = "db"
_NAME = rf"(?:{DB}\.)?`?(\w+)`?"
_CREATE = re.compile(rf"^CREATE TABLE (?:IF NOT EXISTS )?{_NAME}", re.I)
_ALTER = re.compile(rf"^ALTER TABLE {_NAME}", re.I)
_RENAME = re.compile(rf"^RENAME TABLE {_NAME} TO {_NAME}$", re.I)
_EXCHANGE = re.compile(rf"^EXCHANGE TABLES {_NAME} AND {_NAME}$", re.I)
_DROP = re.compile(rf"^DROP TABLE (?:IF EXISTS )?{_NAME}$", re.I)
_ORDER_BY = re.compile(r"\bORDER BY\s+", re.I)
_IFNULL = re.compile(r"^ifNull\(\s*`?(\w+)`?\s*,.*\)$", re.S)


def _key_text(statement: str) -> str:
    """The expression after the statement's last ORDER BY: a parenthesised tuple, or one column."""
    match = list(_ORDER_BY.finditer(statement))[-1]
    rest = statement[match.end():]
    if not rest.startswith("("):
        return rest.split()[0]
    depth = 0
    for i, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return rest[1:i]
    raise AssertionError(f"unbalanced ORDER BY in {statement!r}")


def _columns(key: str) -> tuple[str, ...]:
    """Each top-level part of a sorting key named by its column: `index` -> index, and
    ifNull(hw_id, '') -> hw_id (the only expression a key uses; any other fails here, to be mapped)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(key):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(key[start:i])
            start = i + 1
    parts.append(key[start:])
    out = []
    for part in (p.strip() for p in parts):
        wrapped = _IFNULL.match(part)
        column = wrapped.group(1) if wrapped else part.strip("`")
        assert re.fullmatch(r"\w+", column), f"sorting key part {part!r} is not a column nor ifNull(column, …)"
        out.append(column)
    return tuple(out)


def migrated_keys() -> dict[str, tuple[str, ...]]:
    """Table -> its sorting key's columns after every migration, in order."""
    keys: dict[str, tuple[str, ...]] = {}
    for path in sorted(MIGRATIONS.glob("*.sql")):
        for statement in migration_statements(path, DB):
            one_line = " ".join(statement.split())
            if created := _CREATE.match(one_line):
                keys[created.group(1)] = _columns(_key_text(statement))
            elif (altered := _ALTER.match(one_line)) and re.search(r"\bMODIFY ORDER BY\b", one_line, re.I):
                keys[altered.group(1)] = _columns(_key_text(statement))
            elif renamed := _RENAME.match(one_line):
                keys[renamed.group(2)] = keys.pop(renamed.group(1))
            elif exchanged := _EXCHANGE.match(one_line):
                a, b = exchanged.groups()
                keys[a], keys[b] = keys[b], keys[a]
            elif dropped := _DROP.match(one_line):
                keys.pop(dropped.group(1), None)
    return keys


def test_the_parser_takes_the_effective_key_of_an_altered_and_of_a_rebuilt_table() -> None:
    keys = migrated_keys()
    # 004 adds writer_id and sequence_id to the steps key; 005 rebuilds placements with the GPU in it.
    assert keys["steps"][-2:] == ("writer_id", "sequence_id")
    assert keys["placements"] == ("project", "run_id", "attempt", "role", "rank", "hw_id", "index", "time_ns")
    # 004 rebuilt grader_failures under a temporary name, without source_partition, then renamed it.
    assert "source_partition" not in keys["grader_failures"] and "grader_failures_v4" not in keys


def test_each_tables_natural_key_is_its_migrated_sorting_key() -> None:
    keys = migrated_keys()
    assert set(keys) == set(TABLES.values()) == set(NATURAL_KEYS)
    for table, key in NATURAL_KEYS.items():
        assert keys[table] == key, table


def test_each_key_column_is_a_field_of_the_tables_record() -> None:
    schemas = load_schemas()
    for record, table in TABLES.items():
        fields = {f["name"] for f in schemas[record]["fields"]}
        key = record_key(record)
        assert len(key) == len(NATURAL_KEYS[table])
        assert set(key) <= fields, (table, set(key) - fields)
    assert set(KEY_FIELDS) <= set(NATURAL_KEYS)


def test_the_stream_harness_keys_each_derived_topic_by_its_tables_key() -> None:
    assert set(HARNESS_KEYS) == set(DERIVED_TOPICS)
    for short, fields in HARNESS_KEYS.items():
        (record,) = BY_SHORT[short].records
        assert fields == NATURAL_KEYS[TABLES[record]]
    assert HARNESS_KEYS["grader-failures"] == ("project", "run_id", "attempt", "term", "cause", "window_start_ns")
    with pytest.raises(ValueError, match="hardware carries 4 record types"):
        topic_key("hardware")
