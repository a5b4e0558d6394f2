"""ClickHouse's Kafka engine (``rlpulse migrate --kafka-engine``, sinks/store/kafka_engine.py) loads the raw
topics into the same rows the Python sink writes.

One SDK workload (simulated runs with GPUs, a simulated vLLM engine and capacity reports) and one
undecodable message go to fresh topics. The sink alone loads them into one chDB store; ClickHouse's
Kafka engine, in chDB, loads them into another through the generated Kafka tables and views. Every
row of spans, steps, gpu_samples, placements, engine_samples and capacity is compared; the
undecodable message is the sink's dead letter and the engine's ``kafka_errors`` row, at the same
topic, partition and offset.

chDB cannot reopen a store that holds a Kafka table, so the engine's store lives in one
subprocess and is thrown away (a user's store never gets one: migrate refuses it on chDB).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from rlpulse.producers.simulators.engine_sim import simulate_capacity, simulate_engine
from rlpulse.producers.simulators.simulator import SimConfig, simulate
from rlpulse.pipeline import Pipeline
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics

pytestmark = [pytest.mark.integration, pytest.mark.full]  # the Kafka engine, a deployment's option: make test-all
REPO = Path(__file__).resolve().parents[4]
TABLES = ("spans", "steps", "gpu_samples", "placements", "engine_samples", "capacity")

# argv: store, mode (engine | dump), prefix, bootstrap, expected counts JSON, timeout s.
# engine: migrate, create the Kafka engine DDL, wait until the tables hold the expected counts.
# Prints {"counts": ..., "rows": {table: [row as JSON text, sorted]}, "errors": [...]}.
SCRIPT = textwrap.dedent("""
    import json, sys, time
    import clickhouse_connect
    from rlpulse.sinks.store import kafka_engine
    from rlpulse.sinks.store.clickhouse import Store, migrate, table_columns
    store_dir, mode, prefix, bootstrap, expected, timeout = sys.argv[1:7]
    expected, timeout = json.loads(expected), float(timeout)
    client = clickhouse_connect.get_client(dsn=f"chdb://{store_dir}")
    store = Store(client=client, database="rlpulse", url=f"chdb://{store_dir}")
    if mode == "engine":
        migrate(store)
        for s in kafka_engine.statements("rlpulse", table_columns(store), kafka_engine.KafkaEngine(bootstrap, prefix)):
            try:
                client.command(s)
            except Exception as exc:  # chDB reports its Kafka table's start as failed, yet it runs
                if "Shutdown was called" not in str(exc):
                    raise
        deadline = time.monotonic() + timeout
        while True:
            counts = {t: client.query(f"SELECT count() FROM rlpulse.{t}").result_rows[0][0] for t in expected}
            if counts == expected or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    counts = {t: client.query(f"SELECT count() FROM rlpulse.{t}").result_rows[0][0] for t in expected}
    rows = {t: sorted(json.dumps(list(r), default=str, sort_keys=True)
                      for r in client.query(f"SELECT * FROM rlpulse.{t}").result_rows) for t in expected if t != "kafka_errors"}
    errors = []
    if mode == "engine":
        errors = client.query("SELECT topic, partition, offset, error != '', raw_message FROM rlpulse.kafka_errors").result_rows
    print(json.dumps({"counts": counts, "rows": rows, "errors": [list(e) for e in errors]}, default=str), flush=True)
""")


def load(store: Path, mode: str, settings: Settings, expected: dict[str, int], timeout: float = 120.0) -> dict:
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(store), mode, settings.topic_prefix, settings.kafka_bootstrap,
                          json.dumps(expected), str(timeout)], cwd=REPO, capture_output=True, text=True, timeout=timeout + 120)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


async def publish_garbage(settings: Settings) -> tuple[int, int]:
    producer = AIOKafkaProducer(**settings.kafka_client_kwargs())
    await producer.start()
    try:
        meta = await producer.send_and_wait(settings.topic("spans"), b"not an avro container", key=b"sim/sim-run1")
        return meta.partition, meta.offset
    finally:
        await producer.stop()


def test_the_kafka_engine_loads_the_rows_the_sink_loads(settings: Settings, backend: dict[str, str], tmp_path: Path) -> None:
    if backend["name"] != "local":
        pytest.skip("the containers backend's ClickHouse would need a route to the Kafka container's internal listener; "
                    "this test runs the engine in chDB")
    pytest.importorskip("chdb")
    ensure_topics(settings)
    truth = simulate(settings, SimConfig(runs=2, steps=3, rollouts_per_step=6, gpu=True))
    engine_samples = len(simulate_engine(settings, "sim", "sim-run1", samples=6))  # the hardware topic's other records
    capacity_rows = simulate_capacity(settings)
    partition, offset = asyncio.run(publish_garbage(settings))

    with Pipeline(settings) as pipeline:  # the sink alone: raw topics only, nothing derived
        pipeline.start(("sink",))
        pipeline.wait_caught_up(0, timeout=180)
    sink = load(Path(settings.clickhouse_dsn.removeprefix("chdb://")), "dump", settings, {t: 0 for t in TABLES})
    assert sink["counts"]["spans"] == truth.spans and sink["counts"]["gpu_samples"] == truth.gpu_samples > 0
    assert sink["counts"]["steps"] >= truth.step_events and sink["counts"]["placements"] > 0  # steps: + heartbeats
    assert (sink["counts"]["engine_samples"], sink["counts"]["capacity"]) == (engine_samples, capacity_rows) == (6, 18)

    engine = load(tmp_path / "engine-store", "engine", settings, {**sink["counts"], "kafka_errors": 1})
    assert engine["counts"] == {**sink["counts"], "kafka_errors": 1}
    for table in TABLES:
        assert engine["rows"][table] == sink["rows"][table], table
    assert engine["errors"] == [[settings.topic("spans"), partition, offset, True, "not an avro container"]]
