"""SDK benchmarks: the cost of one call on the training thread, and SDK calls to broker acks.

``make bench`` (bench/run.py) imports :func:`measure_sdk_call` and :func:`measure_sdk_to_kafka`.
Run alone: ``.venv/bin/python -m bench.sdk [--calls N] [--events N] [--no-kafka]``.

The call cost is compared with a floor measured the same way in the same process: building
the record dict a ``rollout()`` call stands for (with its ``term_shares``) and appending it to
a list, which is the least any SDK that keeps the event must do on the caller's thread.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import itertools
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlpulse.producers import TrainingTelemetry  # noqa: E402
from rlpulse.producers.sdk.sender import SenderConfig  # noqa: E402
from rlpulse.base.settings import Settings  # noqa: E402

CALLS = 20_000
REPETITIONS = 5
SHARES = {"judge": 0.5, "format": 0.3}


def _pct(times: list[int], q: float) -> int:
    times = sorted(times)
    return times[min(len(times) - 1, int(len(times) * q))]


def _time_rollouts(tel: TrainingTelemetry, ids: list[str]) -> list[int]:
    clock = time.perf_counter_ns
    times = []
    append = times.append
    rollout = tel.rollout
    for rid in ids:
        t0 = clock()
        rollout(step=3, rollout_id=rid, reward=0.8, term_shares=SHARES, completion_tokens=512, max_tokens=1024,
                sample_id="prompt-17")
        append(clock() - t0)
    return times


def _time_floor(ids: list[str]) -> list[int]:
    """Build the Span record a rollout() stands for and append it: no checks, no queue, no lock."""
    clock = time.perf_counter_ns
    now = time.time_ns
    seq = itertools.count(1)
    out: list[dict[str, Any]] = []
    times = []
    append = times.append
    trace, span = b"t" * 16, b"s" * 8
    for rid in ids:
        t0 = clock()
        t = now()
        out.append({
            "project": "bench", "run_id": "b", "attempt": 1, "stage": "", "time_ns": t, "trace_id": trace,
            "span_id": span, "parent_span_id": None, "name": "rollout", "kind": "ROLLOUT", "start_time_ns": t,
            "end_time_ns": t, "status": "OK", "status_message": "", "rollout_id": rid, "attempt_id": "",
            "sequence_id": next(seq), "writer_id": "0123456789abcdef", "step": 3, "attributes": {}, "term": None,
            "outcome": None, "score": None, "judge_input_tokens": None, "judge_output_tokens": None, "reward": 0.8,
            "term_shares": dict(SHARES), "completion_tokens": 512, "max_tokens": 1024, "clipped": False,
            "sample_id": "prompt-17"})
        append(clock() - t0)
    return times


def measure_sdk_call(calls: int = CALLS, repetitions: int = REPETITIONS) -> dict[str, Any]:
    """Median and p99 ns of one ``rollout()`` call and of the floor, each the median over repetitions.

    The telemetry is not started, so nothing else competes for the GIL: this is the call's own
    cost (``measure_sdk_to_kafka`` reports it with the sender running too). Floor and call
    alternate within each repetition so that machine noise hits both alike.
    """
    settings = Settings.load({})
    ids = [f"rollout-{i}" for i in range(calls)]
    call_med, call_p99, floor_med = [], [], []
    for _ in range(max(3, repetitions)):
        tel = TrainingTelemetry(project="bench", run_id="b", settings=settings)  # never started: queues only
        tel.rollout(step=3, rollout_id="warm", reward=0.8, term_shares=SHARES)  # the terms become known
        gc.collect()
        floor = _time_floor(ids)
        times = _time_rollouts(tel, ids)
        assert tel.pending == calls + 1 and tel.dropped == 0
        call_med.append(statistics.median(times))
        call_p99.append(_pct(times, 0.99))
        floor_med.append(statistics.median(floor))
        del tel, floor, times
    med, floor = statistics.median(call_med), statistics.median(floor_med)
    return {"sdk_call_ns_median": med, "sdk_call_ns_p99": statistics.median(call_p99), "sdk_floor_ns_median": floor,
            "sdk_call_over_floor": med / floor, "sdk_call_calls": calls, "sdk_call_repetitions": len(call_med)}


def measure_sdk_call_broker_down(calls: int = 2000, buffer_bytes: int = 40_000) -> dict[str, Any]:
    """Median, p99 and slowest ns of a ``grader()`` call while no broker answers, the sender
    running and failing to connect, and the byte-bounded buffer filling then dropping (moved
    here from tests/integration/producers/sdk/test_sdk_broker_down.py, which checks the drops and the delivery).

    The rare slower call waits for the GIL while the sender thread handles the refused
    connection (Python's switch interval is 5 ms); the call itself never touches the network.
    """
    import logging

    settings = dataclasses.replace(Settings.load({}), kafka_bootstrap="127.0.0.1:9",  # nothing listens on port 9
                                   topic_prefix=f"bench-down-{uuid.uuid4().hex[:6]}", heartbeat_interval=3600.0)
    quiet = [logging.getLogger(name) for name in ("rlpulse", "aiokafka")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:  # the sender's retries would fill the bench's output
        logger.setLevel(logging.CRITICAL)
    try:
        tel = TrainingTelemetry(project="bench", run_id="down", settings=settings, buffer_bytes=buffer_bytes)
        tel.start()
        time.sleep(0.5)  # the sender has tried and failed to connect
        clock, times = time.perf_counter_ns, []
        for i in range(calls):
            t0 = clock()
            tel.grader(step=1, rollout_id=f"down{i}", term="judge", outcome="timeout", duration_s=0.1)
            times.append(clock() - t0)
        dropped = tel.dropped
        tel.close(0.5)
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return {"sdk_call_ns_median_broker_down": statistics.median(times), "sdk_call_ns_p99_broker_down": _pct(times, 0.99),
            "sdk_call_ns_max_broker_down": max(times), "sdk_calls_broker_down": calls,
            "sdk_dropped_broker_down": dropped}


def _delete_topics(settings: Settings) -> None:
    """Best effort: the benchmark's topics are of no use afterwards."""
    from aiokafka.admin import AIOKafkaAdminClient

    async def run() -> None:
        admin = AIOKafkaAdminClient(**settings.kafka_client_kwargs())
        await admin.start()
        try:
            names = [t for t in await admin.list_topics() if t.startswith(f"{settings.topic_prefix}.")
                     or t.startswith(f"{settings.app_id}-")]
            if names:
                await admin.delete_topics(names)
        finally:
            await admin.close()

    try:
        asyncio.run(run())
    except Exception:
        pass


def measure_sdk_to_kafka(settings: Settings, events: int = 200_000, repetitions: int = 3) -> dict[str, Any]:
    """Events per second from the first SDK call to the broker's acknowledgement of the last (median of runs).

    A workload of grader and rollout events (two graders per rollout), on topics of a fresh
    prefix so it never mixes with another benchmark's (deleted afterwards); the writer is
    started and its topics exist before the clock starts. Also reports the call cost while
    the sender runs, which then competes with the call for the GIL.
    """
    rates, live_med, live_p99 = [], [], []
    clock = time.perf_counter_ns
    for r in range(repetitions):
        s = dataclasses.replace(settings, topic_prefix=f"{settings.topic_prefix}-sdkbench-{uuid.uuid4().hex[:6]}",
                                heartbeat_interval=3600.0)
        with TrainingTelemetry(project="bench", run_id=f"k{r}", settings=s,
                               sender_config=SenderConfig(buffer_bytes=256 * 1024 * 1024)) as tel:
            if tel.flush(60) != 0:
                raise RuntimeError(f"no broker acknowledged RUN_START at {s.kafka_bootstrap} within 60 s")
            times = []
            append = times.append
            started = time.perf_counter()
            for i in range(events // 3):
                rid = f"r{i}"
                step = i // 100
                t0 = clock()
                tel.grader(step=step, rollout_id=rid, term="judge", outcome="ok", duration_s=0.5, score=0.5)
                t1 = clock()
                tel.grader(step=step, rollout_id=rid, term="format", outcome="timeout", duration_s=1.5)
                t2 = clock()
                tel.rollout(step=step, rollout_id=rid, reward=0.25, term_shares={"judge": 0.25, "format": 0.0},
                            completion_tokens=300, max_tokens=1024, sample_id=f"p{i // 4}")
                append(t1 - t0)
                append(t2 - t1)
                append(clock() - t2)
            calls_done = time.perf_counter()
            undelivered = tel.flush(300)
            elapsed = time.perf_counter() - started
            if undelivered or tel.dropped:
                raise RuntimeError(f"{undelivered} undelivered, {tel.dropped} dropped")
            rates.append(len(times) / elapsed)
            live_med.append(statistics.median(times))
            live_p99.append(_pct(times, 0.99))
        _delete_topics(s)
    return {"producer_events_per_s": statistics.median(rates), "producer_events": len(times),
            "producer_calls_s": calls_done - started, "producer_repetitions": len(rates),
            "sdk_call_ns_median_live": statistics.median(live_med),
            "sdk_call_ns_p99_live": statistics.median(live_p99)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=CALLS)
    parser.add_argument("--repetitions", type=int, default=REPETITIONS)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--kafka-repetitions", type=int, default=3)
    parser.add_argument("--no-kafka", action="store_true", help="only the call cost")
    args = parser.parse_args()
    out = measure_sdk_call(args.calls, args.repetitions)
    out.update(measure_sdk_call_broker_down())
    if not args.no_kafka:
        out.update(measure_sdk_to_kafka(Settings.load(), args.events, args.kafka_repetitions))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
