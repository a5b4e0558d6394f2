"""The streams' CPU per event, offline: the bench's backlog through the worker's own code, no Kafka.

Each message of the drain's workload (bench/workload.py, the same 240-record span containers and
step containers) is encoded once, then handed to :class:`rlpulse.streams.worker.StreamsWorker`
exactly as the Faust agent hands it over (decode, the run stage, the outputs encoded and sent),
with dicts for tables and a publisher that only counts. What it prints is process CPU time per
event, the figure ``make bench`` reports for the streams process, without the broker, Faust's
consumer or the other processes sharing the two cores, so a change to the hot path can be
profiled and compared in seconds:

    .venv/bin/python -m bench.streams_cpu                # 300 runs (366,600 events)
    .venv/bin/python -m bench.streams_cpu --profile      # the same under pyinstrument
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

from rlpulse.base.settings import AlertThresholds
from rlpulse.schemas.codec import Codec
from rlpulse.streams.commits import TopicPartition
from rlpulse.streams.runs import RunConfig, RunProcessor
from rlpulse.streams.stage import HardwareStage, RunStage
from rlpulse.streams.testing import MemoryBroker
from rlpulse.streams.worker import StreamsWorker

from bench.workload import WorkloadConfig, messages

PARTITIONS = 2


class CountingPublisher:
    """The worker's publisher that keeps nothing: how many messages and bytes the streams would send."""

    def __init__(self) -> None:
        self.messages = self.bytes = 0

    async def send(self, topic: str, key: bytes, value: bytes, partition: int | None = None) -> None:
        self.messages += 1
        self.bytes += len(value)


def measure(runs: int, profile: bool = False) -> dict[str, Any]:
    now = time.time_ns()
    codec = Codec()
    encoded = [(m.short, codec.encode(m.record, m.records), len(m.records)) for m in messages(WorkloadConfig(runs=runs), now)]
    events = sum(n for _, _, n in encoded)
    broker = MemoryBroker(now, PARTITIONS)
    table: dict[str, Any] = {}
    changelog = [0]  # bytes written to the runs table: what its changelog topic would carry

    class Table(dict):  # type: ignore[type-arg]
        def __setitem__(self, key: str, value: Any) -> None:
            changelog[0] += len(value)
            super().__setitem__(key, value)

    table = Table()
    # the bench's windows (bench/e2e.py): 10 s windows, 2 s of lateness
    stage = RunStage(RunProcessor(RunConfig(window_s=10, lateness_s=2, idle_s=4), resumed_ns=now), table)
    publisher = CountingPublisher()
    worker = StreamsWorker(broker.prefix, PARTITIONS, stage, HardwareStage(AlertThresholds(), {}), publisher=publisher,
                           ranges=broker, consumer=broker, clock=broker)
    lanes = {"spans": worker.runs, "steps": worker.runs, "hardware": worker.gpus}

    async def drain() -> None:
        for offset, (short, value, _) in enumerate(encoded):
            tp = TopicPartition(f"{broker.prefix}.{short}", offset % PARTITIONS)
            await worker._handle(lanes[short], tp, offset, value, now)  # noqa: SLF001 - the agent's own step

    profiler = None
    if profile:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005)
        profiler.start()
    started = time.process_time()
    asyncio.run(drain())
    cpu = time.process_time() - started
    if profiler is not None:
        profiler.stop()
        print(profiler.output_text(unicode=False, color=False), file=sys.stderr)
    span_messages = sum(1 for short, _, _ in encoded if short == "spans")
    return {"runs": runs, "events": events, "messages": len(encoded), "cpu_s": round(cpu, 3),
            "streams_cpu_us_per_event": round(cpu / events * 1e6, 3), "profiled": profile,
            "output_messages": publisher.messages, "output_bytes": publisher.bytes,
            "changelog_bytes_per_message": round(changelog[0] / len(encoded)),
            "changelog_bytes_per_span_message": round(changelog[0] / max(span_messages, 1)),
            "state_bytes_median_at_end": statistics.median(len(v) for v in table.values()) if table else 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="under pyinstrument (its profile on stderr; slower)")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.runs, args.profile), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
