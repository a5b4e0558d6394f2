"""Span.metrics (an entry span's rollout_metrics / reward_metrics), both ways: a writer from before
it reads with the default (in the streams and through the sink's own INSERT into ClickHouse), and a
reader from before it reads a new writer's spans without it."""

from __future__ import annotations

import copy
import io
import time
from pathlib import Path

import fastavro

from rlpulse.schemas.codec import Codec
from rlpulse.sinks.store.clickhouse import migrate, open_store
from rlpulse.streams.inputs import Inputs
from rlpulse.streams.testing import Harness
from tests.traced_agent import load_spans
from tests.unit.schemas import test_schema_evolution as base
from tests.unit.schemas.test_schema_evolution import CONFIG, container, evolved, feed, span, step

decoder = base.decoder  # the fixture: both decoding paths (the C extension and fastavro)

BEFORE_METRICS_SPAN = evolved("Span", removed=("metrics",))
METRICS = {"turns": 3.0, "tool_calls": 1.0}


def rollouts(**extra) -> list[dict]:
    return [span(1 + i * 0.1, "ROLLOUT", i + 1, step=0, reward=1.0, completion_tokens=10, rollout_id=f"r{i}",
                 span_id=bytes([i]) * 8, **extra) for i in range(2)]


def test_a_writer_before_metrics_reads_with_the_default_and_counts_the_same(decoder: Inputs) -> None:
    old = container(BEFORE_METRICS_SPAN, rollouts())
    assert [r["metrics"] for r in Codec().decode(old).records] == [{}, {}]
    figures = []
    for data in (old, Codec().encode("Span", rollouts(metrics=METRICS))):
        h = Harness(CONFIG)
        feed(h, decoder, "spans", data)
        feed(h, decoder, "steps", Codec().encode("Step", [step(2, "STEP", 1, 1, step=0, trainer="rl")]))
        h.advance(8)
        [stats] = h.emissions("step-stats")
        figures.append((stats["rollouts"], stats["reward_mean"]))
    assert figures == [(2, 1.0), (2, 1.0)]


def test_a_reader_before_metrics_reads_a_new_writers_spans() -> None:
    new = Codec().encode("Span", rollouts(metrics=METRICS))
    old = fastavro.parse_schema(copy.deepcopy(BEFORE_METRICS_SPAN))
    got = list(fastavro.reader(io.BytesIO(new), reader_schema=old))
    assert [(r["rollout_id"], r["reward"], "metrics" in r) for r in got] == [("r0", 1.0, False), ("r1", 1.0, False)]


def test_the_sink_inserts_both_writers_and_fills_the_default(tmp_path: Path) -> None:
    now = {"time_ns": time.time_ns(), "start_time_ns": time.time_ns(), "end_time_ns": time.time_ns()}  # within the TTL
    old = container(BEFORE_METRICS_SPAN, [{**r, **now} for r in rollouts()])
    new = Codec().encode("Span", [{**r, **now, "run_id": "r2"} for r in rollouts(metrics=METRICS)])
    with open_store(f"chdb://{tmp_path / 'ch'}", owner="test") as store:
        migrate(store)
        load_spans(store, [old, new])
        rows = store.client.query(f"SELECT run_id, rollout_id, metrics FROM {store.database}.spans "
                                  "ORDER BY run_id, rollout_id").result_rows
    assert rows == [("r1", "r0", {}), ("r1", "r1", {}), ("r2", "r0", METRICS), ("r2", "r1", METRICS)]
