"""The INSERT … SELECT the sink derives from the reader .avsc and the table's column types."""

from __future__ import annotations

import copy
import json

import pytest

from rlpulse.schemas.codec import load_schemas
from rlpulse.sinks.store.avro_sql import IncompatibleSchema, Plans, build_plan, ch_type

SCHEMAS = load_schemas()
SPAN = SCHEMAS["rlpulse.v1.Span"]
STEP = SCHEMAS["rlpulse.v1.Step"]
# The columns of migrations 001 + 004 that matter here (types as system.columns reports them).
SPAN_COLUMNS = {
    "project": "LowCardinality(String)", "run_id": "String", "attempt": "UInt32", "stage": "LowCardinality(String)",
    "trace_id": "String", "span_id": "String", "parent_span_id": "Nullable(String)", "name": "String",
    "kind": "LowCardinality(String)", "start_time_ns": "Int64", "end_time_ns": "Int64",
    "start_time": "DateTime64(9, 'UTC')", "sequence_id": "UInt64", "writer_id": "String", "step": "Nullable(Int64)",
    "attributes": "Map(String, String)", "score": "Nullable(Float64)", "clipped": "Nullable(Bool)",
    "term_shares": "Map(String, Float64)",
}
STEP_COLUMNS = {"project": "String", "run_id": "String", "attempt": "UInt32", "time_ns": "Int64", "type": "String",
                "step": "Int64", "writer_id": "String", "sequence_id": "UInt64", "mfu": "Nullable(Float64)"}


def exprs(plan) -> dict[str, str]:
    # split the SELECT list on the top-level commas only
    out, depth, cur = [], 0, ""
    for ch in plan.select:
        depth += ch in "(["
        depth -= ch in ")]"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return dict(zip(plan.columns, out))


@pytest.mark.parametrize("avro, expected", [
    ("string", "String"), ("bytes", "String"), ("int", "Int32"), ("long", "Int64"), ("double", "Float64"),
    ("boolean", "Bool"), (["null", "long"], "Nullable(Int64)"), ({"type": "map", "values": "double"}, "Map(String, Float64)"),
    ({"type": "array", "items": "long"}, "Array(Int64)"), ({"type": "enum", "name": "E", "symbols": ["A"]}, "String"),
    ({"type": "map", "values": ["string", "boolean", "long", "double"]}, "Map(String, Variant(String, Bool, Int64, Float64))"),
])
def test_avro_types_map_to_what_clickhouse_avro_input_reads(avro, expected) -> None:
    assert ch_type(avro) == expected


def test_span_plan_columns_follow_the_avsc_and_skip_what_the_table_lacks() -> None:
    plan = build_plan("spans", SPAN, SPAN_COLUMNS)
    fields = [f["name"] for f in SPAN["fields"]]
    assert list(plan.columns) == [f for f in fields if f in SPAN_COLUMNS]
    assert "time_ns" not in plan.columns and "start_time" not in plan.columns  # not in the table / a DEFAULT column
    assert "`attributes` Map(String, Variant(String, Bool, Int64, Float64))" in plan.structure
    assert "`parent_span_id` Nullable(String)" in plan.structure


def test_span_expressions_hex_ids_stringify_attributes_resolve_enums_and_check_narrowing() -> None:
    e = exprs(build_plan("spans", SPAN, SPAN_COLUMNS))
    assert e["trace_id"] == "lower(hex(`trace_id`))" and e["parent_span_id"] == "lower(hex(`parent_span_id`))"
    assert e["attributes"] == "mapSort(mapApply((k, v) -> (k, toString(v)), `attributes`))"
    assert e["term_shares"] == "`term_shares`"
    assert e["kind"].startswith("if(`kind` IN ('ROLLOUT', 'REWARD'") and e["kind"].endswith(", `kind`, 'CUSTOM')")
    assert e["attempt"] == "accurateCast(`attempt`, 'UInt32')"  # Int32 -> UInt32: -1 must fail, not wrap
    assert e["sequence_id"] == "accurateCast(`sequence_id`, 'UInt64')"
    assert e["step"] == "`step`" and e["end_time_ns"] == "`end_time_ns`" and e["project"] == "`project`"


def test_fields_an_older_writer_lacks_take_the_reader_defaults() -> None:
    old = copy.deepcopy(STEP)
    old["fields"] = [f for f in old["fields"] if f["name"] not in ("writer_id", "sequence_id", "step")]
    plan = build_plan("steps", STEP, STEP_COLUMNS, writer=old)
    e = exprs(plan)
    assert e["writer_id"] == "CAST('' AS String)" and e["sequence_id"] == "CAST(0 AS UInt64)"
    assert e["step"] == "CAST(-1 AS Int64)"  # the .avsc default, not ClickHouse's zero
    assert "writer_id" not in plan.structure and "`time_ns` Int64" in plan.structure


def test_a_writer_the_reader_cannot_resolve_is_refused_with_the_field_named() -> None:
    missing = copy.deepcopy(STEP)
    missing["fields"] = [f for f in missing["fields"] if f["name"] != "step_count"]  # no default in the reader
    with pytest.raises(IncompatibleSchema, match="lacks field 'step_count'"):
        build_plan("steps", STEP, STEP_COLUMNS, writer=missing)
    wrong = copy.deepcopy(STEP)
    next(f for f in wrong["fields"] if f["name"] == "tokens")["type"] = "string"
    with pytest.raises(IncompatibleSchema, match="field 'tokens'"):
        build_plan("steps", STEP, STEP_COLUMNS, writer=wrong)


def test_avro_promotions_and_unions_resolve() -> None:
    promoted = copy.deepcopy(STEP)
    next(f for f in promoted["fields"] if f["name"] == "attempt")["type"] = "int"
    next(f for f in promoted["fields"] if f["name"] == "tokens")["type"] = "int"  # int -> long
    next(f for f in promoted["fields"] if f["name"] == "mfu")["type"] = "float"  # float -> ["null", "double"]
    build_plan("steps", STEP, STEP_COLUMNS, writer=promoted)
    nullable = copy.deepcopy(STEP)
    next(f for f in nullable["fields"] if f["name"] == "tokens")["type"] = ["null", "long"]  # null cannot become long
    with pytest.raises(IncompatibleSchema):
        build_plan("steps", STEP, STEP_COLUMNS, writer=nullable)


def test_plans_are_cached_per_writer_schema_and_refusals_too() -> None:
    plans = Plans({"steps": STEP_COLUMNS}, readers=SCHEMAS)
    raw = json.dumps(STEP).encode()
    assert plans.plan("steps", "rlpulse.v1.Step", raw) is plans.plan("steps", "rlpulse.v1.Step", raw)
    with pytest.raises(IncompatibleSchema, match="unusable writer schema"):
        plans.plan("steps", "rlpulse.v1.Step", b"{not json")


def test_sql_quotes_the_structure_path_and_token() -> None:
    plan = build_plan("steps", STEP, STEP_COLUMNS)
    sql = plan.sql_from_file("rlpulse", "/tmp/x'y/1.avro", "steps;abc;t.steps:0:1-5")
    assert sql.startswith("INSERT INTO rlpulse.steps (`project`, `run_id`, `attempt`")
    assert "FROM file('/tmp/x\\'y/1.avro', 'Avro', '`project` String" in sql
    assert sql.endswith("SETTINGS insert_deduplication_token = 'steps;abc;t.steps:0:1-5'")
    assert plan.sql_from_input("db").endswith("FROM input('" + plan.structure + "') FORMAT Avro")
