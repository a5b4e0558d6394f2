"""Scaling out the sink: two ``rlpulse sink`` processes in one consumer group, while
training jobs publish on six partitions (one job per partition) and one streams worker computes
the figures.

The group splits the partitions; one sink leaves (SIGTERM) and comes back mid-stream, each time
a graceful rebalance (the leaving side writes and commits its checkpoint when its partitions are
revoked); at the end one sink is SIGKILLed and the other takes its partitions over from the last
committed offsets.

* ``containers`` (a ClickHouse server, where Docker answers): both sinks write to one database.
  Every event is exactly one row (FINAL: the replayed range after the kill is deduplicated by the
  insert tokens and the ReplacingMergeTree key), and every figure and alert equals the truth.
* ``local`` (chDB): a chDB store belongs to one process, so the two sinks write to two stores, and
  the test reads their union. What it shows: the group split the events between the sinks (both
  stores hold rows); through both graceful rebalances no event was written by both sinks; the only
  events in both stores are ones at offsets the group had not committed when the sink was killed
  (the range Kafka hands to the survivor), and those are the same rows; each store alone has one
  row per key (FINAL); and the union, each key once, is exactly the truth.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition

from rlpulse.pipeline import Pipeline, offsets, wait_groups_ready
from rlpulse.base.settings import Settings
from rlpulse.schemas.codec import Codec
from rlpulse.schemas.topics import ensure_topics, read_topic
from rlpulse.sinks.store.clickhouse import open_store
from tests.integration.workload import (PROJECT, RAW, Job, assert_figures_equal, expected, figures_in,
                                        indices_by_partition, read_figures, run_for, stop_jobs)

pytestmark = [pytest.mark.integration, pytest.mark.full]  # scale: make test-all (make test-scale)


def event_rows(dsn: str) -> tuple[Counter, Counter]:
    """Rows per event key in one store: as written (no FINAL), and after FINAL.
    Keys: ('spans', run_id, sequence_id) and ('steps', run_id, time_ns, type), heartbeats left out."""
    with open_store(dsn, owner="test") as store:
        db, p = store.database, {"p": PROJECT}
        out = []
        for final in ("", "FINAL"):
            rows = Counter()
            for r, seq, n in store.client.query(
                    f"SELECT run_id, sequence_id, count() FROM {db}.spans {final} WHERE project = {{p:String}} "
                    "GROUP BY run_id, sequence_id", parameters=p).result_rows:
                rows[("spans", r, seq)] += n
            for r, t, kind, n in store.client.query(
                    f"SELECT run_id, time_ns, type, count() FROM {db}.steps {final} WHERE project = {{p:String}} "
                    "AND type != 'HEARTBEAT' GROUP BY run_id, time_ns, type", parameters=p).result_rows:
                rows[("steps", r, t, kind)] += n
            out.append(rows)
        return out[0], out[1]


def event_offsets(settings: Settings) -> dict[tuple, tuple[Any, int]]:
    """Event key (as in ``event_rows``) -> (topic-partition, offset) of the message that carried it."""
    codec, out = Codec(), {}
    for short in RAW:
        for m in asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic(short))):
            for r in codec.decode(m.value).records:
                if r["project"] != PROJECT or r.get("type") == "HEARTBEAT":
                    continue
                key = ("spans", r["run_id"], r["sequence_id"]) if short == "spans" else \
                    ("steps", r["run_id"], r["time_ns"], r["type"])
                out[key] = (TopicPartition(m.topic, m.partition), m.offset)
    return out


def union_figures(settings: Settings, dsns: list[str]) -> dict[str, Any]:
    """The figures of several stores as one: a key in two stores must have the same figures there."""
    parts = [read_figures(settings, dsn) for dsn in dsns]
    out: dict[str, Any] = {}
    for name in ("failures", "windows", "steps", "histograms"):
        merged: dict = {}
        for part in parts:
            for k, v in part[name].items():
                assert merged.setdefault(k, v) == v, f"{name} {k}: {merged[k]} in one store, {v} in another"
        out[name] = merged
    rows = sorted({row for part in parts for row in part["alert_rows"]})  # the alerts table's key, across stores
    out["alerts"] = sorted((rule, key, state, summary) for rule, key, _first, state, summary in rows)
    return out


def test_two_sinks_one_group(settings: Settings, backend: dict[str, str], tmp_path: Path) -> None:
    settings = dataclasses.replace(settings, partitions=6, window=10.0, allowed_lateness=Settings().allowed_lateness)
    local = backend["name"] == "local"
    dsns = [f"chdb://{tmp_path / 'clickhouse-a'}", f"chdb://{tmp_path / 'clickhouse-b'}"] if local \
        else [settings.clickhouse_dsn] * 2
    ensure_topics(settings)
    jobs = [Job(settings, i) for i in indices_by_partition(settings)]
    group, sink = settings.sink_group, {"sink": dsns[0], "sink-2": dsns[1]}

    def start(name: str) -> None:
        pipeline.start((name,), extra_env={"RLPULSE_CLICKHOUSE_URL": sink[name]})

    with Pipeline(settings) as pipeline:
        pipeline.start(("streams",))
        start("sink")
        start("sink-2")
        wait_groups_ready(settings, (settings.app_id,), pipeline)
        wait_groups_ready(settings, (group,), pipeline, size=2)
        for job in jobs:
            job.start()
        run_for(15, pipeline, jobs)
        pipeline.stop(("sink-2",))  # SIGTERM: its partitions are revoked after its checkpoint
        wait_groups_ready(settings, (group,), pipeline, size=1)
        run_for(10, pipeline, jobs)
        start("sink-2")
        wait_groups_ready(settings, (group,), pipeline, size=2)
        run_for(10, pipeline, jobs)
        committed_at_kill = offsets(settings, group, RAW)[1]
        pipeline.stop(("sink-2",), sig=signal.SIGKILL)
        killed = time.monotonic()
        wait_groups_ready(settings, (group,), pipeline, size=1)
        takeover_s = round(time.monotonic() - killed, 1)
        run_for(5, pipeline, jobs)
        stop_jobs(jobs)
        pipeline.wait_caught_up(until=figures_in(settings, expected(jobs, settings), dsns), timeout=240)
        pipeline.stop()

    stores = list(dict.fromkeys(dsns))
    written = [event_rows(dsn) for dsn in stores]
    where = event_offsets(settings)
    truth = set(where)
    assert len(truth) == sum(j.truth.accepted for j in jobs) and all(j.tel.dropped == 0 for j in jobs)
    in_stores = Counter(k for _, final in written for k in final)  # stores holding each key
    overlap = sorted(k for k, n in in_stores.items() if n > 1)
    uncommitted = {k for k, (tp, o) in where.items() if o >= committed_at_kill[tp]}
    print(f"\n{backend['name']}: {len(truth)} events; rows per store (as written, FINAL): "
          f"{[(sum(w.values()), sum(f.values())) for w, f in written]}; in both stores: {len(overlap)}; "
          f"events at offsets not committed when the sink was killed (what followed included): {len(uncommitted)}; "
          f"the group held the killed sink's "
          f"partitions again {takeover_s} s after the kill")

    for _, final in written:
        assert set(final.values()) <= {1}, "a key with two rows after FINAL in one store"
        assert set(final) <= truth, "rows of events nobody published"
    assert set(in_stores) == truth, f"{len(truth - set(in_stores))} events in no store"
    if local:
        assert all(final for _, final in written), "the group gave one sink nothing"
        assert set(overlap) <= uncommitted, f"written by both sinks outside the killed sink's uncommitted range: " \
                                            f"{sorted(set(overlap) - uncommitted)[:5]}"
    got = union_figures(settings, stores)
    assert_figures_equal(expected(jobs, settings), got)
