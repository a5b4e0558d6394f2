"""ClickHouse's own Kafka engine for the raw events (``rlpulse migrate --kafka-engine``).

For each raw topic (spans, steps, hardware) a ``Kafka`` table reads the topic's messages with
ClickHouse's ``Avro`` format (each message is one Avro container file, which that format reads
whole) in the consumer group ``<prefix>-ch-kafka``, and materialized views load its rows into the
tables the Python sink writes: ``spans``, ``steps``, ``gpu_samples``, ``placements``, ``engine_samples``
and ``capacity`` (the hardware topic carries GPU samples, placements, engine samples and capacity).
The sink then reads the derived topics only (``RLPULSE_SINK_RAW=0``), so no raw event is written
twice by two writers.

Nothing here is written by hand: each view's SELECT is the sink's own per-column expressions
(``rlpulse.sinks.store.avro_sql.build_plan`` on the reader ``.avsc`` and the table's columns: ids as hex, an
unknown enum symbol as the enum's default, attributes as strings, checked narrowing casts), so
the views produce the rows the sink produces. Where they differ:

* the engine reads every container with the reader schema's columns and
  ``input_format_avro_allow_missing_fields``: a field an older writer lacks reads as its
  column type's default (0, '', NULL), not the reader schema's default as in the sink;
* the engine cannot see a container's record type name. On the hardware topic a row is a GPU
  sample when its ``power_w`` (a field the other records lack) is there, a placement when its
  ``stage`` is, an engine sample by its ``url``, capacity by its ``pool`` (:func:`markers`); a
  container with none of them is recorded as an error. A record of another type on spans or
  steps is read by field names, where the sink would dead-letter it.

Nothing is dropped silently: with ``kafka_handle_error_mode='stream'`` a message the format cannot
read becomes a row with ``_error`` set, which a view writes to ``kafka_errors`` (topic,
partition, offset, the raw message and the error); the data views skip such rows.

chDB runs the engine in-process, but cannot reopen a store holding a Kafka table (chDB 4.4 /
ClickHouse 26.9: "Load job 'startup table …' failed: Shutdown was called"), so on a chDB store the
engine is refused (:func:`refuse_chdb`); it is meant for a ClickHouse server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlpulse.base import env as envvars
from rlpulse.schemas.catalogue import BY_SHORT, RAW_TOPICS, TABLES
from rlpulse.sinks.store.avro_sql import build_plan, ch_type, reader_schemas, sql_ident, sql_quote
from rlpulse.sinks.store.cluster_ddl import check_name

ERRORS_TABLE = "kafka_errors"


@dataclass(frozen=True)
class KafkaEngine:
    """Where the engine reads: brokers as the ClickHouse server reaches them, and the topic prefix."""

    broker_list: str
    topic_prefix: str
    num_consumers: int = 1  # per Kafka table and server; at most the topic's partitions are busy

    @property
    def group(self) -> str:
        return f"{self.topic_prefix}-ch-kafka"

    def topic(self, short: str) -> str:
        return f"{self.topic_prefix}.{short}"


def refuse_chdb(dsn: str) -> None:
    """ValueError for a chDB store: it could not be opened again once it holds a Kafka table."""
    if dsn.startswith("chdb:"):
        raise ValueError(f"--kafka-engine needs a ClickHouse server ({envvars.CLICKHOUSE_URL}=http://…): chDB runs the "
                         "Kafka engine but cannot open a store again once it holds a Kafka table, so it is not "
                         "offered on a chDB store. The Python sink loads the raw topics there")


def _nullable(t: str) -> str:
    if t.startswith(("Nullable(", "Map(", "Array(", "Variant(")):
        return t
    return f"Nullable({t})"


def _fields(record: str, table_columns: dict[str, str]) -> list[tuple[str, Any]]:
    """The reader schema's fields of ``record`` that its table keeps: (name, Avro type)."""
    return [(f["name"], f["type"]) for f in reader_schemas()[record]["fields"] if f["name"] in table_columns]


def markers(short: str, columns: dict[str, dict[str, str]]) -> dict[str, str]:
    """Table -> the field that tells its records apart on a topic carrying several record types:
    the first required field of that record that the topic's other records lack."""
    records = BY_SHORT[short].records
    if len(records) == 1:
        return {}
    out = {}
    for record in records:
        others = {name for r in records if r != record for name, _ in _fields(r, columns[TABLES[r]])}
        mine = [name for name, t in _fields(record, columns[TABLES[record]]) if not isinstance(t, list) and name not in others]
        if not mine:
            raise ValueError(f"topic {short}: record {record} has no required field of its own to be told apart by")
        out[TABLES[record]] = mine[0]
    return out


def kafka_columns(short: str, columns: dict[str, dict[str, str]]) -> dict[str, str]:
    """The Kafka table's columns for topic ``short``: every stored field of its records, as ClickHouse's
    Avro input reads it; nullable where the records differ, and for each record's marker field."""
    out: dict[str, str] = {}
    marks = set(markers(short, columns).values())
    for record in BY_SHORT[short].records:
        for name, avro_type in _fields(record, columns[TABLES[record]]):
            t = ch_type(avro_type)
            if name in marks:
                t = _nullable(t)
            if name in out and out[name] != t:
                if _nullable(out[name]) != _nullable(t):
                    raise ValueError(f"topic {short}: field {name!r} is {out[name]} in one record, {t} in another")
                t = _nullable(t)
            out[name] = t
    return out


def errors_table_statement(db: str, ttl_days: int) -> str:
    """Messages the engine could not load; a ReplacingMergeTree on the message's position, so a
    redelivered message is one row."""
    return (f"CREATE TABLE IF NOT EXISTS {db}.{ERRORS_TABLE} (\n"
            "    topic LowCardinality(String),\n    partition UInt64,\n    offset UInt64,\n"
            "    error String,\n    raw_message String,\n"
            "    time DateTime64(3, 'UTC') DEFAULT now64(3)\n"
            ") ENGINE = ReplacingMergeTree\nPARTITION BY toDate(time)\nORDER BY (topic, partition, offset, error)\n"
            f"TTL toDateTime(time) + INTERVAL {int(ttl_days)} DAY")


def statements(db: str, columns: dict[str, dict[str, str]], engine: KafkaEngine, cluster: str = "",
               ttl_days: int = 90) -> list[str]:
    """The DDL: the errors table, then per raw topic its Kafka table, a view per table it loads
    and its errors view. ``columns``: table -> column -> type (``rlpulse.sinks.store.clickhouse.table_columns``)."""
    check_name("database", db)
    if engine.num_consumers < 1:
        raise ValueError("the Kafka engine needs at least one consumer per table")
    on = f" ON CLUSTER {check_name('cluster', cluster)}" if cluster else ""
    if cluster:
        from rlpulse.sinks.store.cluster_ddl import cluster_statements

        out = cluster_statements(errors_table_statement(db, ttl_days), cluster)
    else:
        out = [errors_table_statement(db, ttl_days)]
    for short in RAW_TOPICS:
        source = f"{db}.kafka_{short.replace('-', '_')}"
        cols = ",\n".join(f"    {sql_ident(n)} {t}" for n, t in kafka_columns(short, columns).items())
        out.append(
            f"CREATE TABLE IF NOT EXISTS {source}{on} (\n{cols}\n) ENGINE = Kafka\nSETTINGS "
            f"kafka_broker_list = {sql_quote(engine.broker_list)}, kafka_topic_list = {sql_quote(engine.topic(short))}, "
            f"kafka_group_name = {sql_quote(engine.group)}, kafka_format = 'Avro', "
            f"kafka_num_consumers = {int(engine.num_consumers)}, kafka_handle_error_mode = 'stream', "
            "input_format_avro_allow_missing_fields = 1")
        marks = markers(short, columns)
        for record in BY_SHORT[short].records:
            table = TABLES[record]
            plan = build_plan(table, reader_schemas()[record], columns[table])
            select = ", ".join(f"{e} AS {sql_ident(c)}" for c, e in zip(plan.columns, plan.expressions))
            where = "length(_error) = 0" + (f" AND {sql_ident(marks[table])} IS NOT NULL" if table in marks else "")
            out.append(f"CREATE MATERIALIZED VIEW IF NOT EXISTS {source}_to_{table}{on} TO {db}.{table} AS "
                       f"SELECT {select} FROM {source} WHERE {where}")
        unknown = " AND ".join(f"{sql_ident(m)} IS NULL" for m in marks.values())
        reason = (f"if(length(_error) > 0, _error, 'neither {' nor '.join(marks.values())}: no record type of topic "
                  f"{short}')") if marks else "_error"
        out.append(f"CREATE MATERIALIZED VIEW IF NOT EXISTS {source}_errors{on} TO {db}.{ERRORS_TABLE} AS "
                   f"SELECT _topic AS topic, _partition AS partition, _offset AS offset, {reason} AS error, "
                   f"_raw_message AS raw_message FROM {source} WHERE length(_error) > 0"
                   + (f" OR ({unknown})" if marks else ""))
    return out


def drop_statements(db: str, cluster: str = "") -> list[str]:
    """What undoes :func:`statements` but the errors table (the sink loads the raw topics again)."""
    on = f" ON CLUSTER {check_name('cluster', cluster)}" if cluster else ""
    out = []
    for short in RAW_TOPICS:
        source = f"{db}.kafka_{short.replace('-', '_')}"
        views = [f"{source}_to_{TABLES[r]}" for r in BY_SHORT[short].records] + [f"{source}_errors"]
        out += [f"DROP VIEW IF EXISTS {v}{on} SYNC" for v in views] + [f"DROP TABLE IF EXISTS {source}{on} SYNC"]
    return out
