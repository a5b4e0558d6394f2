"""Benchmarks (``make bench``): medians over repeated rounds, run side by side in one process.

Prints a table and writes bench/results/<timestamp>.json. This machine is noisy: compare the
ratios measured in one run, not absolute numbers across runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from producers import TrainingTelemetry  # noqa: E402
from rlpulse.settings import Settings  # noqa: E402
from schemas.codec import Codec  # noqa: E402

ROUNDS = 5


def per_call_us(fn: Callable[[int], None], n: int) -> tuple[float, float]:
    """Median and p99 of one call, in microseconds."""
    times = []
    for i in range(n):
        t = time.perf_counter_ns()
        fn(i)
        times.append(time.perf_counter_ns() - t)
    times.sort()
    return times[n // 2] / 1e3, times[int(n * 0.99)] / 1e3


def bench_sdk_calls() -> dict:
    tel = TrainingTelemetry(project="bench", run_id="b", settings=Settings.load({}))  # not started: pure call cost
    rounds = {"rollout": [], "grader": [], "step_completed": []}
    for _ in range(ROUNDS):
        rounds["rollout"].append(per_call_us(lambda i: tel.rollout(
            step=1, rollout_id=f"r{i}", reward=0.5, term_shares={"judge": 0.3, "format": 0.2},
            completion_tokens=300, max_tokens=1024, sample_id="s"), 5000))
        rounds["grader"].append(per_call_us(lambda i: tel.grader(
            step=1, rollout_id=f"r{i}", term="judge", outcome="timeout", duration_s=1.5), 5000))
        rounds["step_completed"].append(per_call_us(lambda i: tel.step_completed(step=i, tokens=1000, duration_s=1.0), 5000))
        tel._sender._queue.clear()  # noqa: SLF001 - keep the unsent buffer from growing across rounds
        tel._sender._pending_bytes = 0  # noqa: SLF001
    return {name: {"median_us": statistics.median(m for m, _ in r), "p99_us": statistics.median(p for _, p in r)}
            for name, r in rounds.items()}


def bench_codec() -> dict:
    codec = Codec()
    span = dict(project="p", run_id="r", attempt=1, time_ns=time.time_ns(), trace_id=b"t" * 16, span_id=b"s" * 8,
                name="rollout", kind="ROLLOUT", start_time_ns=1, end_time_ns=2, status="OK", sequence_id=1, step=3,
                reward=0.5, term_shares={"judge": 0.3}, completion_tokens=300, max_tokens=1024, sample_id="s")
    data = codec.encode("Span", span)
    enc = [per_call_us(lambda i: codec.encode("Span", span), 5000)[0] for _ in range(ROUNDS)]
    dec = [per_call_us(lambda i: codec.decode(data), 5000)[0] for _ in range(ROUNDS)]
    return {"span_bytes": len(data), "encode_median_us": statistics.median(enc), "decode_median_us": statistics.median(dec)}


def bench_clickhouse_insert() -> dict:
    """Rows per second inserting step rows into chDB, two batch sizes side by side."""
    from sinks.clickhouse import migrate, open_store
    from sinks.rows import TABLES

    spec = TABLES["rlpulse.v1.Step"]
    now = time.time_ns()
    out = {}
    with tempfile.TemporaryDirectory() as tmp, open_store(f"chdb://{tmp}/ch", owner="bench") as store:
        migrate(store)
        for batch in (1000, 5000):
            rates = []
            for r in range(ROUNDS):
                rows = [spec.row(dict(project="bench", run_id=f"r{r}", attempt=1, stage="", time_ns=now + batch * r + i,
                                      type="HEARTBEAT", trainer="rl", step=-1, step_count=i, tokens=0, duration_s=0.0,
                                      throughput=0.0, mfu=None, dropped_events=0)) for i in range(20_000)]
                t = time.perf_counter()
                for lo in range(0, len(rows), batch):
                    store.client.insert(f"{store.database}.steps", rows[lo:lo + batch], column_names=list(spec.columns),
                                        settings={"insert_deduplication_token": f"b{batch}-{r}-{lo}"})
                rates.append(len(rows) / (time.perf_counter() - t))
            out[f"rows_per_s_batch_{batch}"] = statistics.median(rates)
    out["ratio_5000_vs_1000"] = out["rows_per_s_batch_5000"] / out["rows_per_s_batch_1000"]
    return out


def bench_sdk_to_kafka() -> dict | None:
    """Events per second from SDK calls to broker acknowledgements (needs the local broker)."""
    from rlpulse import services
    from schemas.topics import ensure_topics

    settings = dataclasses.replace(Settings.load(), topic_prefix=f"bench{uuid.uuid4().hex[:6]}", heartbeat_interval=3600.0)
    if not services.broker_answers(settings.kafka_bootstrap, 5.0):
        return None
    ensure_topics(settings)
    rates = []
    for r in range(3):
        with TrainingTelemetry(project="bench", run_id=f"k{r}", settings=settings) as tel:
            t = time.perf_counter()
            for i in range(20_000):
                tel.grader(step=i // 100, rollout_id=f"r{i}", term="judge", outcome="ok", duration_s=0.1)
            assert tel.flush(120) == 0
            rates.append(20_000 / (time.perf_counter() - t))
    return {"events_per_s": statistics.median(rates)}


def main() -> int:
    started = time.strftime("%Y%m%d-%H%M%S")
    results = {"sdk_calls": bench_sdk_calls(), "codec": bench_codec(), "clickhouse_insert": bench_clickhouse_insert(),
               "sdk_to_kafka": bench_sdk_to_kafka(), "rounds": ROUNDS, "cpus": os.cpu_count()}
    print(json.dumps(results, indent=2))
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    path = out / f"{started}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
