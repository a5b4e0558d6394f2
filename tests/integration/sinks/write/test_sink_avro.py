"""Avro containers on the topics -> ClickHouse decodes them into the tables (real broker, real chDB).

Containers are produced directly with the codec and aiokafka, so these tests depend on the
sink alone: exact values per record type, older and newer writer schemas, dead letters for
garbage and for the wrong record type, and replays that leave the same rows.
"""

from __future__ import annotations

import asyncio
import copy
import io
import time
from typing import Any

import fastavro
import pytest
from aiokafka import AIOKafkaProducer

from rlpulse.base.settings import Settings
from rlpulse.schemas.catalogue import TABLES
from rlpulse.schemas.codec import Codec, load_schemas
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.write.checkpoint import Policy
from rlpulse.sinks.store.clickhouse import Store, migrate, open_store
from rlpulse.sinks.write.dlq import read_dead_letters
from rlpulse.sinks.write.sink import Limits, SinkStats, drain

pytestmark = pytest.mark.integration
CODEC = Codec()
NOW = time.time_ns()  # recent event times: rows older than a table's TTL would be dropped on insert
PROJECT, RUN = "sinkp", "sinkp-run1"


def ident(**extra: Any) -> dict[str, Any]:
    return dict(project=PROJECT, run_id=RUN, attempt=1, **extra)


def span(seq: int, **kw: Any) -> dict[str, Any]:
    record = ident(stage="train", time_ns=NOW + seq, trace_id=bytes(range(16)), span_id=seq.to_bytes(8, "big"),
                   parent_span_id=None, name="rollout", kind="ROLLOUT", start_time_ns=NOW - 1000 + seq,
                   end_time_ns=NOW + seq, status="OK", status_message="", rollout_id="s1-r3", attempt_id="a1",
                   sequence_id=seq, writer_id="w1", step=3, attributes={}, term=None, outcome=None, score=None,
                   judge_input_tokens=None, judge_output_tokens=None, reward=0.75, term_shares={"judge": 0.5},
                   completion_tokens=512, max_tokens=1024, clipped=False, sample_id="prompt-17")
    record.update(kw)
    return record


def step(seq: int, **kw: Any) -> dict[str, Any]:
    record = ident(stage="train", time_ns=NOW + seq, type="STEP", trainer="rl", step=seq, step_count=seq + 1,
                   tokens=1000 + seq, duration_s=4.5, throughput=222.25, mfu=None, dropped_events=0, writer_id="w1",
                   sequence_id=seq)
    record.update(kw)
    return record


def samples() -> dict[str, list[dict[str, Any]]]:
    """Records of every type the sink writes, by record short name, with nulls and values both."""
    return {
        "Span": [
            span(1, attributes={"s": "text", "b": True, "f": False, "l": -5, "d": 0.25}, kind="GRADER", name="judge",
                 parent_span_id=bytes.fromhex("00000000000000ff"), term="judge", outcome="timeout", score=None,
                 judge_input_tokens=10, judge_output_tokens=20, reward=None, term_shares={}, completion_tokens=None,
                 max_tokens=None, clipped=None, sample_id=None, step=None, status="ERROR", status_message="slow"),
            span(2),
        ],
        "Step": [step(1), step(2, type="RUN_END", trainer="sft", mfu=0.41, step=-1)],
        "GpuSample": [dict(project=PROJECT, run_id=RUN, attempt=1, time_ns=NOW, hw_id="GPU-1", index=0, host="h",
                           node="n", pod="p", rank=None, role=None, power_w=300.5, temperature_c=70.0,
                           gpu_utilization=0.9, memory_used_bytes=2**33, memory_total_bytes=2**34,
                           memory_utilization=0.5, memory_activity=0.25, sm_clock_mhz=1980.0, throttle_reasons=8,
                           xid_errors=1, xid_last=79)],
        "Placement": [dict(project=PROJECT, run_id=RUN, attempt=1, stage="train", time_ns=NOW, role="trainer", rank=0,
                           pod="p", node="n", host="h", index=None, hw_id=None),
                      dict(project=PROJECT, run_id=RUN, attempt=1, stage="train", time_ns=NOW, role="trainer", rank=1,
                           pod="p", node="n", host="h", index=1, hw_id="GPU-1")],
        "GraderFailureWindow": [ident(term="judge", cause="timeout", window_start_ns=NOW - 60 * 10**9,
                                      window_end_ns=NOW, failures=3, graded=10, emitted_at_ns=NOW)],
        "GraderWindow": [ident(term="judge", window_start_ns=NOW - 60 * 10**9, window_end_ns=NOW, graded=10,
                               failures=3, failure_rate=0.3, duration_p50_s=1.5, duration_p90_s=2.5,
                               duration_p99_s=3.5, duration_max_s=4.0, emitted_at_ns=NOW)],
        "StepStats": [ident(step=3, rollouts=4, clipped=1, clipped_ratio=0.25, reward_mean=0.5, reward_std=0.1,
                            reward_min=0.0, reward_max=1.0, reward_zero_fraction=0.25, completion_mean=400.0,
                            completion_min=100, completion_max=1024, samples=2, samples_same_reward=1,
                            sample_reward_spread_mean=0.05, complete=True, emitted_at_ns=NOW)],
        "RewardHistogram": [ident(step=3, term="total", bounds=[0.0, 0.5, 1.0], bucket_counts=[1, 2, 1, 0], count=4,
                                  sum=2.0, min=0.0, max=1.0, zero_fraction=0.25, emitted_at_ns=NOW)],
        "CompletionLengthHistogram": [ident(step=3, scale=2, zero_count=0, offset=-3, bucket_counts=[1, 0, 3], count=4,
                                            sum=1600.0, min=100.0, max=1024.0, emitted_at_ns=NOW)],
        "Alert": [dict(rule="stalled_run", state="FIRING", key=f"{RUN}/1", severity="warning", summary="no progress",
                       value=900.0, threshold=600.0, project=PROJECT, run_id=RUN, attempt=1, time_ns=NOW,
                       first_seen_ns=NOW - 10**9, last_seen_ns=NOW)],
    }


TOPIC_OF = {"Span": "spans", "Step": "steps", "GpuSample": "hardware", "Placement": "hardware",
            "GraderFailureWindow": "grader-failures", "GraderWindow": "grader-windows", "StepStats": "step-stats",
            "RewardHistogram": "reward-histograms", "CompletionLengthHistogram": "length-histograms", "Alert": "alerts"}


def encode_with(schema: dict[str, Any], records: list[dict[str, Any]], codec: str = "null") -> bytes:
    """A container under an arbitrary writer schema (an older or newer SDK's), or codec."""
    buf = io.BytesIO()
    fastavro.writer(buf, fastavro.parse_schema(schema), records, codec=codec)
    return buf.getvalue()


async def publish_async(settings: Settings, messages: list[tuple[str, bytes]], key: str = f"{PROJECT}/{RUN}") -> None:
    producer = AIOKafkaProducer(acks="all", **settings.kafka_client_kwargs())
    await producer.start()
    try:
        for short, value in messages:
            await producer.send(settings.topic(short), value=value, key=key.encode())
        await producer.flush()
    finally:
        await producer.stop()


def publish(settings: Settings, messages: list[tuple[str, bytes]], key: str = f"{PROJECT}/{RUN}") -> None:
    asyncio.run(publish_async(settings, messages, key))


def run_sink(settings: Settings, policy: Policy | None = None, **options: Any) -> SinkStats:
    """Run the sink in this process until it has committed everything published so far."""
    with open_store(settings.clickhouse_dsn, owner="test sink") as store:
        migrate(store)
        stats, _ = asyncio.run(drain(settings, store, policy, timeout=120, **options))
    return stats


def rows(store: Store, table: str, order: str, final: bool = False) -> list[dict[str, Any]]:
    result = store.client.query(f"SELECT * FROM {store.database}.{table} {'FINAL' if final else ''} ORDER BY {order}")
    return [dict(zip(result.column_names, row)) for row in result.result_rows]


def counts(store: Store, final: bool) -> dict[str, int]:
    q = store.client.query
    return {t: q(f"SELECT count() FROM {store.database}.{t} {'FINAL' if final else ''}").result_rows[0][0]
            for t in TABLES.values()}


def test_every_record_type_lands_with_exact_values(settings: Settings) -> None:
    ensure_topics(settings)
    data = samples()
    publish(settings, [(TOPIC_OF[name], CODEC.encode(name, records)) for name, records in data.items()])
    stats = run_sink(settings)
    assert stats.dead_letters == 0
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        spans = rows(store, "spans", "sequence_id")
        grader, rollout = spans
        assert grader["trace_id"] == bytes(range(16)).hex() and grader["span_id"] == "0000000000000001"
        assert grader["parent_span_id"] == "00000000000000ff" and rollout["parent_span_id"] is None
        assert grader["attributes"] == {"b": "true", "d": "0.25", "f": "false", "l": "-5", "s": "text"}
        assert (grader["kind"], grader["status"], grader["status_message"]) == ("GRADER", "ERROR", "slow")
        assert (grader["term"], grader["outcome"], grader["score"], grader["step"]) == ("judge", "timeout", None, None)
        assert (grader["judge_input_tokens"], grader["reward"], grader["clipped"], grader["sample_id"]) == (10, None, None, None)
        assert (rollout["reward"], rollout["clipped"], rollout["sample_id"], rollout["step"]) == (0.75, False, "prompt-17", 3)
        assert rollout["term_shares"] == {"judge": 0.5} and rollout["writer_id"] == "w1"
        assert rollout["end_time"].timestamp() == pytest.approx((NOW + 2) / 1e9)
        # every other table: each stored field equals the record's value
        for name, records in data.items():
            if name == "Span":
                continue
            table = TABLES[f"rlpulse.v1.{name}"]
            got = rows(store, table, "tuple()")
            assert len(got) == len(records), table
            for record in records:
                assert any(all(row[k] == v for k, v in record.items() if k in row) for row in got), (table, record, got)
        assert rows(store, "steps", "sequence_id")[1]["mfu"] == 0.41
        assert rows(store, "grader_failures", "tuple()")[0]["failure_rate"] == 0.3


def test_older_and_newer_writer_schemas_insert(settings: Settings) -> None:
    ensure_topics(settings)
    schemas = load_schemas()
    old_span = copy.deepcopy(schemas["rlpulse.v1.Span"])
    old_span["fields"] = [f for f in old_span["fields"] if f["name"] != "writer_id"]
    old_step = copy.deepcopy(schemas["rlpulse.v1.Step"])
    old_step["fields"] = [f for f in old_step["fields"] if f["name"] not in ("writer_id", "sequence_id", "step")]
    new_span = copy.deepcopy(schemas["rlpulse.v1.Span"])
    kind = next(f for f in new_span["fields"] if f["name"] == "kind")
    kind["type"]["symbols"].append("SUBAGENT")
    new_span["fields"].append({"name": "gpu_seconds", "type": "double", "default": 0.0})
    old = [{k: v for k, v in span(i).items() if k != "writer_id"} for i in (1, 2)]
    newer = [dict(span(3, kind="SUBAGENT"), gpu_seconds=1.5), dict(span(4, kind="TOOL"), gpu_seconds=0.5)]
    old_steps = [{k: v for k, v in step(i).items() if k not in ("writer_id", "sequence_id", "step")} for i in (1, 2)]
    publish(settings, [("spans", encode_with(old_span, old)), ("spans", encode_with(new_span, newer)),
                       ("spans", CODEC.encode("Span", [span(5)])), ("steps", encode_with(old_step, old_steps))])
    stats = run_sink(settings)
    assert stats.dead_letters == 0 and stats.rows == {"spans": 5, "steps": 2}
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        got = {r["sequence_id"]: r for r in rows(store, "spans", "sequence_id")}
        assert [got[i]["writer_id"] for i in (1, 2, 3, 4, 5)] == ["", "", "w1", "w1", "w1"]
        assert got[3]["kind"] == "CUSTOM" and got[4]["kind"] == "TOOL"  # an unknown symbol reads as the default
        assert got[1]["reward"] == 0.75 and got[1]["span_id"] == "0000000000000001"
        # fields an older writer lacks take the reader schema's defaults, not ClickHouse's zero values
        assert [(r["writer_id"], r["sequence_id"], r["step"]) for r in rows(store, "steps", "time_ns")] == [("", 0, -1)] * 2


def test_garbage_and_the_wrong_record_type_are_dead_lettered_and_neighbours_land(settings: Settings) -> None:
    ensure_topics(settings)
    good = CODEC.encode("Span", [span(i) for i in range(1, 4)])
    truncated = good[:-20]
    corrupt_sync = good[:-1] + bytes([good[-1] ^ 0xFF])
    messages = [
        ("spans", good),
        ("spans", b"\x00\x01 this is not Avro, just some bytes of garbage"),
        ("spans", CODEC.encode("Step", [step(1)])),
        ("spans", truncated),
        ("spans", corrupt_sync),
        ("spans", CODEC.encode("Span", [span(4)])),
        ("steps", CODEC.encode("Step", [step(1)])),
    ]
    publish(settings, messages)
    stats = run_sink(settings)
    assert stats.dead_letters == 4 and stats.rows == {"spans": 4, "steps": 1}
    letters = asyncio.run(read_dead_letters(settings.kafka_client_kwargs(), settings.topic("dlq")))
    reasons = {int(d["source"].rsplit("@", 1)[1]): d["reason"] for d in letters}
    assert "not an Avro container" in reasons[1]
    assert "rlpulse.v1.Step does not belong on topic" in reasons[2] and settings.topic("spans") in reasons[2]
    assert "runs past the end" in reasons[3] or "truncated" in reasons[3]
    assert "sync marker" in reasons[4]
    assert all(d["source"].startswith(settings.topic("spans")) for d in letters)
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        assert [r["sequence_id"] for r in rows(store, "spans", "sequence_id")] == [1, 2, 3, 4]


def test_truncated_and_oversize_containers_are_dead_lettered_and_neighbours_land(settings: Settings) -> None:
    """The sink's limits (``rlpulse.sinks.write.sink.Limits``), here 50 records and 64 KiB of decoded records a
    message: one record over, one byte-heavy record over, and containers cut short in the header
    and in a block go to the dead-letter topic with their reasons; the good messages between
    them, in the same checkpoint, land whole."""
    ensure_topics(settings)
    good = [CODEC.encode("Span", [span(10 * m + i) for i in range(10)]) for m in range(4)]  # 40 spans
    too_many = CODEC.encode("Span", [span(1000 + i) for i in range(51)])
    too_big = CODEC.encode("Step", [step(900, stage="x" * 70_000)])
    messages = [
        ("spans", good[0]),
        ("spans", good[1][:40]),
        ("spans", too_many),
        ("spans", good[1]),
        ("steps", CODEC.encode("Step", [step(i) for i in range(5)])),
        ("steps", too_big),
        ("spans", good[2][:-20]),
        ("spans", good[2]),
        ("steps", CODEC.encode("Step", [step(5)])),
        ("spans", good[3]),
    ]
    publish(settings, messages)
    stats = run_sink(settings, limits=Limits(max_message_records=50, max_message_bytes=64 * 1024))
    assert stats.dead_letters == 4 and stats.rows == {"spans": 40, "steps": 6}
    letters = asyncio.run(read_dead_letters(settings.kafka_client_kwargs(), settings.topic("dlq")))
    reasons = {(d["source"].split("[")[0], int(d["source"].rsplit("@", 1)[1])): d["reason"] for d in letters}
    spans, steps = settings.topic("spans"), settings.topic("steps")
    assert set(reasons) == {(spans, 1), (spans, 2), (steps, 1), (spans, 4)}
    assert "truncated" in reasons[(spans, 1)] and "container header" in reasons[(spans, 1)]  # cut inside the header
    assert "container holds 51 records, over the sink's limit of 50 a message" in reasons[(spans, 2)]
    assert "over the sink's limit of 65536 a message" in reasons[(steps, 1)]
    assert "runs past the end" in reasons[(spans, 4)]
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        assert [r["sequence_id"] for r in rows(store, "spans", "sequence_id")] == list(range(40))
        assert [r["sequence_id"] for r in rows(store, "steps", "sequence_id")] == list(range(6))


def test_a_deflate_bomb_over_the_default_limit_is_dead_lettered_and_neighbours_land(settings: Settings) -> None:
    """A deflate container of ~17 KB on the wire whose one record decodes to 17 MiB, over the
    default limit of 16 MiB of decoded records a message: refused before ClickHouse inflates it."""
    ensure_topics(settings)
    schema = load_schemas()["rlpulse.v1.Step"]
    bomb = encode_with(schema, [step(7, stage="\0" * (17 * 1024 * 1024))], codec="deflate")
    assert len(bomb) < 100_000
    publish(
        settings,
        [
            ("steps", encode_with(schema, [step(i) for i in range(3)], codec="deflate")),
            ("steps", bomb),
            ("steps", CODEC.encode("Step", [step(3)])),
        ],
    )
    stats = run_sink(settings)
    assert stats.dead_letters == 1 and stats.rows == {"steps": 4}
    [letter] = asyncio.run(read_dead_letters(settings.kafka_client_kwargs(), settings.topic("dlq")))
    assert letter["source"] == f"{settings.topic('steps')}[{letter['source'].split('[')[1].split(']')[0]}]@1"
    assert f"over {Limits().max_message_bytes} bytes decoded" in letter["reason"] and letter["bytes"] == len(bomb)
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        assert [r["sequence_id"] for r in rows(store, "steps", "sequence_id")] == [0, 1, 2, 3]


def test_a_replayed_range_leaves_the_same_rows(settings: Settings, rewind_sink) -> None:
    ensure_topics(settings)
    data = samples()
    messages = [(TOPIC_OF[name], CODEC.encode(name, records)) for name, records in data.items()]
    messages += [("spans", CODEC.encode("Span", [span(i) for i in range(10 * b, 10 * b + 10)])) for b in range(1, 6)]
    publish(settings, messages)
    run_sink(settings)
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        first = counts(store, final=False)
    assert first["spans"] == 52 and sum(first.values()) == 52 + sum(len(r) for n, r in data.items() if n != "Span")
    # The same offsets again, cut into the same checkpoint: the dedup tokens drop the whole replay.
    rewind_sink()
    run_sink(settings)
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        assert counts(store, final=False) == first
    # Cut differently (a checkpoint every few records): other tokens, so copies may land until a
    # merge; the ReplacingMergeTree keys make FINAL, and OPTIMIZE … FINAL, read one row per event.
    rewind_sink()
    run_sink(settings, Policy(max_rows=7))
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        assert counts(store, final=True) == first
        for table in TABLES.values():
            store.client.command(f"OPTIMIZE TABLE {store.database}.{table} FINAL")
        assert counts(store, final=False) == first


def test_a_retried_insert_carries_the_same_token_and_adds_no_copy(settings: Settings) -> None:
    """The writer's insert, repeated (a retry after a lost reply), leaves one copy of each row."""
    from types import SimpleNamespace

    from rlpulse.schemas.codec import read_header
    from rlpulse.sinks.store.avro_sql import Plans
    from rlpulse.sinks.store.clickhouse import table_columns
    from rlpulse.sinks.write.writer import Entry, TableWriter, inserter_for

    async def no_dead_letters(msg: Any, reason: str) -> None:
        raise AssertionError(reason)

    with open_store(settings.clickhouse_dsn, owner="test") as store:
        migrate(store)
        writer = TableWriter("steps", inserter_for(store), Plans(table_columns(store)), no_dead_letters)
        entries = []
        for offset in range(3):
            value = CODEC.encode("Step", [step(offset)])
            msg = SimpleNamespace(topic=settings.topic("steps"), partition=0, offset=offset, key=None, value=value)
            entries.append(Entry(msg, read_header(value), 1))
        asyncio.run(writer.write(entries))
        asyncio.run(writer.write(entries))
        assert store.client.query(f"SELECT count() FROM {store.database}.steps").result_rows[0][0] == 3
