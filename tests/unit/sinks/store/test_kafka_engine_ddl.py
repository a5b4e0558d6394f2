"""The Kafka engine's DDL (sinks/store/kafka_engine.py): golden statements for the hardware topic (four record
types on one topic), each view's SELECT being the sink's own expressions, cluster forms, and every
statement through ClickHouse's parser. tests/integration/sinks/store/test_kafka_engine.py runs the engine (in
chDB) and compares its rows with the sink's."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlpulse.base.settings import Settings
from rlpulse.schemas.catalogue import DERIVED_TOPICS, SINK_TOPICS, sink_topics
from rlpulse.sinks.store import kafka_engine
from rlpulse.sinks.store.avro_sql import build_plan, reader_schemas
from rlpulse.schemas.codec import full_name
from tests.unit.sinks.store.test_cluster_ddl import parse_with_clickhouse

REPO = Path(__file__).resolve().parents[4]
ENGINE = kafka_engine.KafkaEngine("kafka:9092", "rlpulse", num_consumers=2)

COLUMNS = textwrap.dedent("""
    import json, sys, tempfile
    import clickhouse_connect
    from rlpulse.sinks.store.clickhouse import Store, migrate, table_columns
    store = Store(client=clickhouse_connect.get_client(dsn=f"chdb://{tempfile.mkdtemp()}/s"), database="rlpulse", url="")
    migrate(store)
    print(json.dumps(table_columns(store)))
""")


@pytest.fixture(scope="module")
def columns() -> dict[str, dict[str, str]]:
    """The tables' columns after every migration, as the sink and migrate read them (system.columns)."""
    pytest.importorskip("chdb")
    run = subprocess.run([sys.executable, "-c", COLUMNS], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_hardware_topic_has_one_kafka_table_and_a_view_per_record_type(columns: dict) -> None:
    ddl = kafka_engine.statements("rlpulse", columns, ENGINE)
    table = next(s for s in ddl if s.startswith("CREATE TABLE IF NOT EXISTS rlpulse.kafka_hardware ("))
    assert table.endswith(
        ") ENGINE = Kafka\nSETTINGS kafka_broker_list = 'kafka:9092', kafka_topic_list = 'rlpulse.hardware', "
        "kafka_group_name = 'rlpulse-ch-kafka', kafka_format = 'Avro', kafka_num_consumers = 2, "
        "kafka_handle_error_mode = 'stream', input_format_avro_allow_missing_fields = 1")
    # both records' fields; nullable where they differ (hw_id, index, rank, role) and for the markers
    for column in ("`hw_id` Nullable(String)", "`index` Nullable(Int32)", "`power_w` Nullable(Float64)",
                   "`stage` Nullable(String)", "`temperature_c` Float64", "`xid_last` Nullable(Int64)"):
        assert f"    {column}," in table.splitlines() or f"    {column}" in table.splitlines()
    gpu = next(s for s in ddl if "kafka_hardware_to_gpu_samples" in s)
    assert gpu.startswith("CREATE MATERIALIZED VIEW IF NOT EXISTS rlpulse.kafka_hardware_to_gpu_samples TO "
                          "rlpulse.gpu_samples AS SELECT `project` AS `project`, `run_id` AS `run_id`, "
                          "accurateCast(`attempt`, 'UInt32') AS `attempt`, ")
    assert gpu.endswith(" FROM rlpulse.kafka_hardware WHERE length(_error) = 0 AND `power_w` IS NOT NULL")
    placements = next(s for s in ddl if "kafka_hardware_to_placements" in s)
    assert placements.endswith(" FROM rlpulse.kafka_hardware WHERE length(_error) = 0 AND `stage` IS NOT NULL")
    errors = next(s for s in ddl if "kafka_hardware_errors" in s)
    assert errors == (
        "CREATE MATERIALIZED VIEW IF NOT EXISTS rlpulse.kafka_hardware_errors TO rlpulse.kafka_errors AS SELECT "
        "_topic AS topic, _partition AS partition, _offset AS offset, if(length(_error) > 0, _error, 'neither power_w "
        "nor stage nor url nor pool: no record type of topic hardware') AS error, _raw_message AS raw_message FROM "
        "rlpulse.kafka_hardware WHERE length(_error) > 0 OR (`power_w` IS NULL AND `stage` IS NULL AND `url` IS NULL "
        "AND `pool` IS NULL)")
    # engine samples and capacity samples share the topic; they are told apart by their own first required field
    engines = next(s for s in ddl if "kafka_hardware_to_engine_samples" in s)
    assert engines.endswith(" FROM rlpulse.kafka_hardware WHERE length(_error) = 0 AND `url` IS NOT NULL")
    capacity = next(s for s in ddl if "kafka_hardware_to_capacity" in s)
    assert capacity.endswith(" FROM rlpulse.kafka_hardware WHERE length(_error) = 0 AND `pool` IS NOT NULL")
    spans_errors = next(s for s in ddl if "kafka_spans_errors" in s)
    assert spans_errors.endswith("_error AS error, _raw_message AS raw_message FROM rlpulse.kafka_spans WHERE length(_error) > 0")


def test_each_view_selects_the_sinks_own_expressions(columns: dict) -> None:
    ddl = kafka_engine.statements("rlpulse", columns, ENGINE)
    views = {s.split()[6]: s for s in ddl if s.startswith("CREATE MATERIALIZED VIEW") and not s.split()[6].endswith("_errors")}
    assert set(views) == {"rlpulse.kafka_spans_to_spans", "rlpulse.kafka_steps_to_steps",
                          "rlpulse.kafka_hardware_to_gpu_samples", "rlpulse.kafka_hardware_to_placements",
                          "rlpulse.kafka_hardware_to_engine_samples", "rlpulse.kafka_hardware_to_capacity"}
    for record, table in (("Span", "spans"), ("Step", "steps"), ("GpuSample", "gpu_samples"), ("Placement", "placements"),
                          ("EngineSample", "engine_samples"), ("CapacitySample", "capacity")):
        plan = build_plan(table, reader_schemas()[full_name(record)], columns[table])
        view = next(v for name, v in views.items() if name.endswith(f"_to_{table}"))
        select = view.split(" AS SELECT ", 1)[1].split(" FROM rlpulse.kafka_", 1)[0]
        assert select == ", ".join(f"{e} AS `{c}`" for c, e in zip(plan.columns, plan.expressions))
    assert "lower(hex(`trace_id`)) AS `trace_id`" in views["rlpulse.kafka_spans_to_spans"]
    assert "mapSort(mapApply((k, v) -> (k, toString(v)), `attributes`)) AS `attributes`" in views["rlpulse.kafka_spans_to_spans"]


def test_cluster_mode_runs_on_every_node_into_the_distributed_tables(columns: dict) -> None:
    ddl = kafka_engine.statements("rlpulse", columns, ENGINE, cluster="rlpulse")
    assert ddl[0].startswith("CREATE TABLE IF NOT EXISTS rlpulse.kafka_errors_local ON CLUSTER rlpulse (")
    assert ddl[1] == ("CREATE TABLE IF NOT EXISTS rlpulse.kafka_errors ON CLUSTER rlpulse AS rlpulse.kafka_errors_local "
                      "ENGINE = Distributed(rlpulse, rlpulse, kafka_errors_local, cityHash64(topic, partition))")
    for s in ddl[2:]:
        assert " ON CLUSTER rlpulse " in s.split(" AS SELECT ")[0] + " ", s[:150]
    assert "rlpulse.kafka_spans_to_spans ON CLUSTER rlpulse TO rlpulse.spans AS SELECT" in "\n".join(ddl)


def test_every_statement_is_valid_clickhouse_sql(columns: dict) -> None:
    ddl = (kafka_engine.statements("rlpulse", columns, ENGINE) + kafka_engine.statements("rlpulse", columns, ENGINE, "c")
           + kafka_engine.drop_statements("rlpulse") + kafka_engine.drop_statements("rlpulse", "c"))
    for statement, (status, formatted) in zip(ddl, parse_with_clickhouse(ddl)):
        assert status == "ok", (statement[:200], formatted)


def test_quotes_and_names_cannot_break_out(columns: dict) -> None:
    ddl = kafka_engine.statements("rlpulse", columns, kafka_engine.KafkaEngine("h:9092', kafka_format = 'CSV", "p"))
    table = next(s for s in ddl if "rlpulse.kafka_spans (" in s)
    status, formatted = parse_with_clickhouse([table])[0]
    assert status == "ok" and "kafka_broker_list = 'h:9092\\', kafka_format = \\'CSV'" in formatted
    assert formatted.count("kafka_format = 'Avro'") == 1 and "kafka_format = 'CSV'" not in formatted
    with pytest.raises(ValueError, match="invalid database name"):
        kafka_engine.statements("rl-pulse", columns, ENGINE)
    with pytest.raises(ValueError, match="invalid cluster name"):
        kafka_engine.drop_statements("rlpulse", "c ON")
    with pytest.raises(ValueError, match="needs a ClickHouse server"):
        kafka_engine.refuse_chdb("chdb:///tmp/store")
    kafka_engine.refuse_chdb("http://ch:8123/rlpulse")  # a server: allowed


def test_the_sink_can_leave_the_raw_topics_to_the_engine() -> None:
    assert Settings.load({}).sink_raw is True
    assert Settings.load({"RLPULSE_SINK_RAW": "0"}).sink_raw is False
    with pytest.raises(ValueError, match="RLPULSE_SINK_RAW: expected 1 or 0"):
        Settings.load({"RLPULSE_SINK_RAW": "sometimes"})
    assert sink_topics(True) == SINK_TOPICS and sink_topics(False) == DERIVED_TOPICS
    assert Settings.load({"RLPULSE_CLICKHOUSE_CLUSTER": "rlpulse"}).clickhouse_cluster == "rlpulse"
