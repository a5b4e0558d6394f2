"""The sink alone on a backlog: how fast it drains spans from Kafka into ClickHouse.

Publishes ``events`` Span records in containers of ``per_message`` (as the SDK batches them)
on fresh topics, then runs the sink in this process and times from its partition assignment
to the moment its group has committed every offset (lag 0). The sink commits only after
its inserts, so that is when the last row is in ClickHouse.

    python -m bench.sink --events 300000            # a scratch chDB store, deleted afterwards
    python -m bench.sink --events 300000 --profile out.prof   # cProfile of the drain
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import os
import resource
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer

from rlpulse.base.settings import Settings
from rlpulse.schemas.codec import Codec
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.write.checkpoint import Policy
from rlpulse.sinks.store.clickhouse import migrate, open_store
from rlpulse.sinks.write.sink import drain


def span_records(run: int, first_seq: int, count: int, now_ns: int) -> list[dict[str, Any]]:
    """``count`` distinct GRADER-ish spans of one run, attributes and nullable fields included."""
    trace = os.urandom(16)
    return [dict(project="bench", run_id=f"run-{run}", attempt=1, stage="train", time_ns=now_ns + seq,
                 trace_id=trace, span_id=(run << 40 | seq).to_bytes(8, "big"), parent_span_id=None if seq % 4 else trace[:8],
                 name="grade", kind="GRADER", start_time_ns=now_ns + seq - 1_000_000, end_time_ns=now_ns + seq,
                 status="OK", status_message="", rollout_id=f"r{seq // 8}", attempt_id="a", sequence_id=seq,
                 writer_id="bench", step=seq // 1000, attributes={"model": "judge-1", "retry": seq % 3 == 0, "n": seq},
                 term="judge", outcome="ok" if seq % 5 else "timeout", score=0.5, judge_input_tokens=300,
                 judge_output_tokens=20, reward=None, term_shares={}, completion_tokens=None, max_tokens=None,
                 clipped=None, sample_id=None)
            for seq in range(first_seq, first_seq + count)]


async def publish_spans(settings: Settings, events: int, per_message: int = 500, runs: int = 64) -> int:
    """Publish ``events`` spans in containers of ``per_message``, spread over ``runs`` run keys. Returns messages sent."""
    codec = Codec()
    producer = AIOKafkaProducer(acks="all", compression_type="lz4", linger_ms=5, max_request_size=4 * 1024 * 1024,
                                **settings.kafka_client_kwargs())
    await producer.start()
    now, sent, messages = time.time_ns(), 0, 0
    try:
        while sent < events:
            run = messages % runs
            count = min(per_message, events - sent)
            value = codec.encode("Span", span_records(run, sent, count, now))
            await producer.send(settings.topic("spans"), value=value, key=f"bench/run-{run}".encode())
            sent += count
            messages += 1
        await producer.flush()
    finally:
        await producer.stop()
    return messages


def measure_sink_drain(settings: Settings, events: int = 300_000, per_message: int = 500,
                       policy: Policy | None = None, profile: Path | None = None) -> float:
    """Events per second at which the sink alone drains a backlog of ``events`` spans.

    Topics are fresh (a unique prefix derived from ``settings.topic_prefix``); the rows go to
    ``settings.clickhouse_dsn``, opened in this process (chDB: this process must not hold
    another store), so pass a scratch store.
    """
    settings = dataclasses.replace(settings, topic_prefix=f"{settings.topic_prefix}-sinkbench-{uuid.uuid4().hex[:8]}")
    ensure_topics(settings)
    asyncio.run(publish_spans(settings, events, per_message))
    with open_store(settings.clickhouse_dsn, owner="rlpulse bench sink") as store:
        migrate(store, settings.ttl_raw_days, settings.ttl_aggregate_days)
        profiler = cProfile.Profile() if profile else None
        if profiler:
            profiler.enable()
        stats, seconds = asyncio.run(drain(settings, store, policy, timeout=600))
        if profiler:
            profiler.disable()
            profiler.dump_stats(str(profile))
    if stats.rows.get("spans", 0) != events:
        raise RuntimeError(f"sink wrote {stats.rows} rows, expected {events} spans (dead letters: {stats.dead_letters})")
    return events / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--per-message", type=int, default=500)
    parser.add_argument("--batch-rows", type=int, default=Policy.max_rows)
    parser.add_argument("--flush-interval", type=float, default=Policy.interval)
    parser.add_argument("--profile", type=Path, help="write a cProfile of the drain here")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="rlpulse-sinkbench-"))
    try:
        settings = dataclasses.replace(Settings.load(), home=home, clickhouse_url="")
        policy = Policy(max_rows=args.batch_rows, interval=args.flush_interval)
        rate = measure_sink_drain(settings, args.events, args.per_message, policy, args.profile)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # publisher included
        print(f"sink drained {args.events} spans at {rate:,.0f} events/s (process peak RSS {peak:.0f} MiB)")
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
