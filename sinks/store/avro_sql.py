"""How ClickHouse decodes an Avro container into a table: the structure and the SELECT list.

ClickHouse decodes every table the sink writes (spans, steps, gpu_samples, placements,
grader_failures, grader_windows, step_stats, reward_histograms, step_term_stats,
completion_length_histograms, alerts): the sink hands it the message bytes and one ``INSERT … SELECT`` per table, and no
record is decoded in Python. Nothing is derived from hand-written column lists: the columns are
the fields of the reader ``.avsc`` (``rlpulse.schemas.codec.load_schemas``) that the table has, and each
field's expression follows from its Avro type and the table's column type:

* ``bytes`` -> ``lower(hex(x))``: the tables keep ids (trace_id, span_id, parent_span_id) as hex.
* an enum -> the symbol when the reader knows it, else the enum's default (Avro resolution; a
  newer writer's new symbol must not fail the batch, and it reads as the streams read it).
* a map of a union of several types (Span.attributes) -> ``Map(String, String)`` through
  ``toString``: booleans as ``true``/``false``, numbers as ClickHouse prints them, keys sorted.
* an Avro int/long into an unsigned or narrower column -> ``accurateCast``: ClickHouse would
  otherwise wrap ``attempt = -1`` to 4294967295 silently; now the row is rejected, and the
  writer isolates and dead-letters its message.

The structure is the reader schema restricted to the fields the *writer* has (its schema is in
the container header): a field an older writer lacks is filled with the reader's default as a
literal, so old containers insert with the values a fastavro reader would give them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from rlpulse.schemas.codec import full_name, load_schemas
from rlpulse.base.errors import Error

_PRIMITIVES = {"string": "String", "bytes": "String", "int": "Int32", "long": "Int64", "float": "Float32",
               "double": "Float64", "boolean": "Bool"}
# Avro's promotions (writer type -> reader types it resolves into).
_PROMOTES = {"int": {"long", "float", "double"}, "long": {"float", "double"}, "float": {"double"},
             "string": {"bytes"}, "bytes": {"string"}}
_INT = re.compile(r"(U?)Int(\d+)")


class IncompatibleSchema(Error, ValueError):
    """A writer schema the reader schema cannot resolve; the message says which field and why."""


@dataclass(frozen=True)
class InsertPlan:
    """One table's INSERT for containers of one writer schema."""

    table: str
    columns: tuple[str, ...]  # table columns written, in SELECT order
    structure: str  # for file(…, 'Avro', structure) / input(structure)
    select: str  # the SELECT expression list, one per column
    # the same expressions one by one (rlpulse.sinks.store.kafka_engine names each for its view)
    expressions: tuple[str, ...] = ()

    def sql_from_file(self, database: str, path: str, token: str) -> str:
        """The INSERT for an embedded engine (chDB) reading the container from a file."""
        return (f"INSERT INTO {database}.{self.table} ({_cols(self.columns)}) SELECT {self.select} "
                f"FROM file({sql_quote(path)}, 'Avro', {sql_quote(self.structure)}) "
                f"SETTINGS insert_deduplication_token = {sql_quote(token)}")

    def sql_from_input(self, database: str) -> str:
        """The INSERT for a server: the container is the HTTP request body (token goes as a setting)."""
        return (f"INSERT INTO {database}.{self.table} ({_cols(self.columns)}) SELECT {self.select} "
                f"FROM input({sql_quote(self.structure)}) FORMAT Avro")


def sql_quote(text: str) -> str:
    """``text`` as a ClickHouse string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def sql_ident(name: str) -> str:
    """``name`` as a ClickHouse identifier (back-quoted: column names may be keywords, e.g. `index`)."""
    return "`" + name.replace("`", "``") + "`"


def _cols(columns: tuple[str, ...]) -> str:
    return ", ".join(sql_ident(c) for c in columns)


def _type_name(t: Any) -> str:
    """The Avro type's name for promotion checks: primitive name, or the complex type's kind."""
    if isinstance(t, str):
        return t if t in _PRIMITIVES or t == "null" else "named"
    if isinstance(t, list):
        return "union"
    return t["type"] if t["type"] in ("enum", "map", "array", "fixed", "record") else t["type"]


def ch_type(t: Any) -> str:
    """The ClickHouse type ClickHouse's Avro input reads ``t`` into."""
    if isinstance(t, str):
        if t in _PRIMITIVES:
            return _PRIMITIVES[t]
        raise IncompatibleSchema(f"named type reference {t!r} is not supported by the sink")
    if isinstance(t, list):
        branches = [b for b in t if b != "null"]
        if len(branches) == 1 and "null" in t:
            inner = ch_type(branches[0])
            return inner if inner.startswith(("Map(", "Array(")) else f"Nullable({inner})"
        if len(branches) == 1:
            return ch_type(branches[0])
        return "Variant(" + ", ".join(ch_type(b) for b in branches) + ")"  # a Variant is nullable itself
    kind = t["type"]
    if kind == "enum":
        return "String"
    if kind == "map":
        return f"Map(String, {ch_type(t['values'])})"
    if kind == "array":
        return f"Array({ch_type(t['items'])})"
    if kind == "fixed":
        return f"FixedString({int(t['size'])})"
    if kind in _PRIMITIVES:  # {"type": "long", "logicalType": ...}: the underlying type
        return _PRIMITIVES[kind]
    raise IncompatibleSchema(f"Avro type {kind!r} is not supported by the sink")


def _strip_lowcardinality(t: str) -> str:
    return t[len("LowCardinality("):-1] if t.startswith("LowCardinality(") else t


def _narrowing(src: str, dst: str) -> bool:
    """Does an integer in ``src`` need a checked cast to fit ``dst`` (unsigned or fewer bits)?"""
    s, d = _INT.search(src), _INT.search(dst)
    if not s or not d or s.group(0) == d.group(0):
        return False
    return d.group(1) == "U" or int(d.group(2)) < int(s.group(2))


def _literal(value: Any, avro_type: Any) -> str:
    """A reader default as a SQL literal (Avro JSON default encoding)."""
    name = _type_name(avro_type)
    if name == "union":  # a union's default belongs to its first branch
        return _literal(value, avro_type[0])
    if value is None:
        return "NULL"
    if name == "bytes" or name == "fixed":
        return sql_quote(value.encode("latin-1").hex())  # the JSON encoding of bytes is one char per byte
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return sql_quote(value)
    if isinstance(value, dict):
        values = avro_type["values"]
        return "map(" + ", ".join(f"{sql_quote(k)}, {_literal(v, values)}" for k, v in sorted(value.items())) + ")"
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v, avro_type["items"]) for v in value) + "]"
    raise IncompatibleSchema(f"cannot express default {value!r} in SQL")


def _resolvable(writer: Any, reader: Any) -> bool:
    """Can a value of the writer's type resolve into the reader's (Avro's rules, simplified)?"""
    w, r = _type_name(writer), _type_name(reader)
    if r == "union":
        return any(_resolvable(writer, b) for b in reader) if w != "union" else all(
            any(_resolvable(wb, rb) for rb in reader) for wb in writer)
    if w == "union":  # every branch the writer may use must fit (null into a non-union fails)
        return all(_resolvable(b, reader) for b in writer)
    if w == r:
        if w == "map":
            return _resolvable(writer["values"], reader["values"])
        if w == "array":
            return _resolvable(writer["items"], reader["items"])
        return True
    return r in _PROMOTES.get(w, set())


def _expression(name: str, avro_type: Any, table_type: str) -> str:
    col = sql_ident(name)
    kind = _type_name(avro_type)
    branches = [b for b in avro_type if b != "null"] if kind == "union" else [avro_type]
    base = _type_name(branches[0]) if len(branches) == 1 else "union"
    if base == "bytes":
        return f"lower(hex({col}))"
    if base == "enum":
        symbols = ", ".join(sql_quote(s) for s in branches[0]["symbols"])
        default = branches[0].get("default")
        if default is None:
            return col
        nullable = kind == "union" and "null" in avro_type
        known = f"({col} IS NULL OR {col} IN ({symbols}))" if nullable else f"{col} IN ({symbols})"
        return f"if({known}, {col}, {sql_quote(default)})"
    if base == "map" and ch_type(branches[0]).startswith("Map(String, Variant("):
        return f"mapSort(mapApply((k, v) -> (k, toString(v)), {col}))"
    if _narrowing(ch_type(avro_type), table_type):
        return f"accurateCast({col}, {sql_quote(table_type)})"
    return col


def build_plan(table: str, reader: dict[str, Any], table_columns: dict[str, str],
               writer: dict[str, Any] | None = None) -> InsertPlan:
    """The INSERT plan for ``table`` (column name -> ClickHouse type) from the reader record schema.

    ``writer`` is the writer record schema from the container header (None: same as the reader).
    Raises IncompatibleSchema when the writer cannot be resolved into the reader.
    """
    writer_fields = {f["name"]: f["type"] for f in (writer or reader)["fields"]}
    structure, columns, select = [], [], []
    for field in reader["fields"]:
        name, avro_type = field["name"], field["type"]
        if name not in writer_fields:
            if "default" not in field:
                raise IncompatibleSchema(f"writer schema lacks field {name!r}, which has no default in the reader schema")
        elif not _resolvable(writer_fields[name], avro_type):
            raise IncompatibleSchema(f"field {name!r}: writer type {json.dumps(writer_fields[name])} does not resolve "
                                     f"into reader type {json.dumps(avro_type)}")
        if name not in table_columns:  # a field the table does not keep (Span.time_ns = end_time_ns)
            continue
        table_type = _strip_lowcardinality(table_columns[name])
        columns.append(name)
        if name in writer_fields:
            structure.append(f"{sql_ident(name)} {ch_type(avro_type)}")
            select.append(_expression(name, avro_type, table_type))
        else:
            select.append(f"CAST({_literal(field['default'], avro_type)} AS {table_type})")
    if not structure:
        raise IncompatibleSchema(f"writer schema shares no stored field with table {table}")
    return InsertPlan(table=table, columns=tuple(columns), structure=", ".join(structure), select=", ".join(select),
                      expressions=tuple(select))


@lru_cache(maxsize=1)
def reader_schemas() -> dict[str, dict[str, Any]]:
    return load_schemas()


class Plans:
    """INSERT plans per (table, writer schema bytes), built once each: headers repeat, plans don't change."""

    def __init__(self, table_columns: dict[str, dict[str, str]], readers: dict[str, dict[str, Any]] | None = None):
        self._columns = table_columns  # table -> column -> type, from system.columns
        self._readers = readers or reader_schemas()
        self._cache: dict[tuple[str, bytes], InsertPlan | IncompatibleSchema] = {}

    def plan(self, table: str, record: str, schema_json: bytes) -> InsertPlan:
        """The plan for containers whose header carries ``schema_json``; raises IncompatibleSchema."""
        key = (table, schema_json)
        found = self._cache.get(key)
        if found is None:
            try:
                writer = json.loads(schema_json)
                found = build_plan(table, self._readers[full_name(record)], self._columns[table], writer)
            except IncompatibleSchema as exc:
                found = exc
            except (ValueError, KeyError, TypeError) as exc:
                found = IncompatibleSchema(f"unusable writer schema: {type(exc).__name__}: {exc}")
            if len(self._cache) > 1000:  # writer schemas are few; bogus headers must not grow this
                self._cache.clear()
            self._cache[key] = found
        if isinstance(found, IncompatibleSchema):
            raise found
        return found
