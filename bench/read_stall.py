"""How much heavy reads on the sink's read endpoint stall ingestion.

The sink runs in this process as ``rlpulse sink`` wires it (open the chDB store, migrate, serve
reads, run the sink) while this process publishes spans at a steady rate on fresh topics. Each
message's ingestion delay is the time from its publish to the sink's commit of its offset (the
sink commits only after the insert, so its rows are then in ClickHouse). Two phases of equal
length: no reads, then a reader process keeps the endpoint's query slots busy with heavy queries
(a CPU-bound scan capped by ``max_execution_time`` and a GROUP BY over the spans with FINAL).

    python -m bench.read_stall                 # 20 s per phase, 5,000 spans/s
    python -m bench.read_stall --seconds 30 --rate 10000

Prints the delay percentiles per phase, the event loop's lag and the reads that ran.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition

from bench.e2e import delete_topics
from bench.sink import span_records
from rlpulse.base.env import BENCH_READ_PASSWORD
from rlpulse.base.settings import Settings
from rlpulse.schemas.codec import Codec
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.write.checkpoint import Policy
from rlpulse.sinks.store.clickhouse import migrate, open_store
from rlpulse.sinks.read.read_endpoint import serve_reads
from rlpulse.sinks.write.sink import ClickHouseSink

HEAVY = (
    "SELECT count() FROM numbers(1000000000000) WHERE sipHash64(number) % 7 = 1",  # CPU until max_execution_time
    "SELECT run_id, rollout_id, count() AS n, avg(score) FROM rlpulse.spans FINAL GROUP BY run_id, rollout_id "
    "ORDER BY n DESC, run_id, rollout_id LIMIT 10",
)


def reader(port: int, seconds: float, threads: int) -> None:
    """Loop the heavy queries on ``threads`` clients for ``seconds``; print what ran, as JSON."""
    import clickhouse_connect

    done: list[tuple[int, float, str]] = []

    def loop(i: int) -> None:
        client = clickhouse_connect.get_client(host="127.0.0.1", port=port, send_receive_timeout=120, username="rlpulse",
                                               password=os.environ[BENCH_READ_PASSWORD])
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            started = time.monotonic()
            try:
                client.query(HEAVY[i % len(HEAVY)])
                outcome = "ok"
            except Exception as exc:  # the CPU-bound one ends at the time cap by design
                outcome = "timeout" if getattr(exc, "code", None) == 159 else f"error {getattr(exc, 'code', '')}"
            done.append((i % len(HEAVY), time.monotonic() - started, outcome))

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(json.dumps(done))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(settings: Settings, store: Any, port: int, seconds: float, rate: int, per_message: int,
                  threads: int) -> dict[str, Any]:
    sink = ClickHouseSink(settings, store, Policy(max_rows=25_000, interval=1.0))  # rlpulse sink's defaults
    stop = asyncio.Event()
    sink_task = asyncio.create_task(sink.run(stop))
    while not sink.assigned.is_set():
        await asyncio.sleep(0.05)
    producer = AIOKafkaProducer(acks="all", compression_type="lz4", linger_ms=2, **settings.kafka_client_kwargs())
    await producer.start()
    sent_at: dict[tuple[TopicPartition, int], float] = {}
    delays: dict[str, list[float]] = {"no reads": [], "heavy reads": []}
    lags: dict[str, list[float]] = {"no reads": [], "heavy reads": []}
    phase = "no reads"
    codec, spans = Codec(), settings.topic("spans")

    async def publish(until: float) -> None:
        seq, interval = 0, per_message / rate
        next_at = time.monotonic()
        while time.monotonic() < until:
            value = codec.encode("Span", span_records(seq % 16, seq, per_message, time.time_ns()))
            fut = await producer.send(spans, value=value, key=f"bench/run-{seq % 16}".encode())
            sent_t = time.monotonic()
            fut.add_done_callback(lambda f, t=sent_t: sent_at.__setitem__(
                (TopicPartition(spans, f.result().partition), f.result().offset), t))
            seq += per_message
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def watch(until: float) -> None:
        while time.monotonic() < until + 10 and (time.monotonic() < until or sent_at):
            now = time.monotonic()
            for key in [k for k in sent_at if sink.committed.get(k[0], -1) > k[1]]:
                delays[phase].append(now - sent_at.pop(key))
            await asyncio.sleep(0.02)

    async def loop_lag(until: float) -> None:
        while time.monotonic() < until:
            started = time.monotonic()
            await asyncio.sleep(0.01)
            lags[phase].append(time.monotonic() - started - 0.01)

    reads: list = []
    try:
        for phase in ("no reads", "heavy reads"):
            until = time.monotonic() + seconds
            proc = None
            if phase == "heavy reads":
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "bench.read_stall", "--reader", str(port), "--seconds", str(seconds),
                    "--threads", str(threads), stdout=subprocess.PIPE)
            await asyncio.gather(publish(until), watch(until), loop_lag(until))
            if proc is not None:
                out, _ = await proc.communicate()
                reads = json.loads(out or b"[]")
    finally:
        await producer.stop()
        stop.set()
        await sink_task
    figures: dict[str, Any] = {}
    for name in delays:
        d, lag = delays[name], lags[name]
        figures[name] = {"messages": len(d), "delay_p50_s": round(pct(d, 0.5), 3), "delay_p99_s": round(pct(d, 0.99), 3),
                         "delay_max_s": round(max(d, default=float("nan")), 3),
                         "loop_lag_p99_ms": round(pct(lag, 0.99) * 1000, 1),
                         "loop_lag_max_ms": round(max(lag, default=float("nan")) * 1000, 1)}
    figures["reads"] = {HEAVY[i][:60]: {"runs": len(r := [x for x in reads if x[0] == i]),
                                        "mean_s": round(statistics.mean([x[1] for x in r]), 2) if r else None,
                                        "outcomes": sorted({x[2] for x in r})} for i in range(len(HEAVY))}
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    p.add_argument("--rate", type=int, default=5000, help="spans published per second")
    p.add_argument("--per-message", type=int, default=250, help="spans per Kafka message (the SDK batches)")
    p.add_argument("--threads", type=int, default=2, help="reader clients (the endpoint runs 2 queries at once)")
    p.add_argument("--reader", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the reader child process
    args = p.parse_args()
    if args.reader:
        reader(args.reader, args.seconds, args.threads)
        return 0
    base = Settings.load()
    tmp = Path(tempfile.mkdtemp(prefix="rlpulse-read-stall-"))
    settings = dataclasses.replace(base, topic_prefix=f"readstall-{uuid.uuid4().hex[:8]}",
                                   clickhouse_url=f"chdb://{tmp / 'store'}", home=tmp)
    try:
        ensure_topics(settings)
        with open_store(settings.clickhouse_dsn, owner="rlpulse sink (bench)") as store:
            migrate(store)
            with serve_reads(store, port=0) as endpoint:
                assert endpoint is not None
                os.environ[BENCH_READ_PASSWORD] = endpoint.password  # the reader child's, never its argv
                figures = asyncio.run(measure(settings, store, endpoint.address[1], args.seconds, args.rate,
                                              args.per_message, args.threads))
                limits = endpoint.engine.limits
        figures["limits"] = dataclasses.asdict(limits)
        print(json.dumps(figures, indent=2))
    finally:
        asyncio.run(delete_topics(settings))
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
