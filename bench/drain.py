"""The two timed phases of the end-to-end benchmark, with streams and sink running.

* :func:`measure_drain`: a backlog published before the pipeline started drains through the
  streams and the sink. The rate counts from the first offset the streams group commits (so
  process start-up and group joins stay out of it; they are reported apart) to the first
  moment both groups are at lag 0 on every topic with the derived topics no longer growing.
* :func:`measure_latency`: a live load, open loop: built beforehand, each message stamped with
  when it is due and sent then; a record's latency is from its ``time_ns`` to the first time
  the sink group's committed offset is past its message. The sink commits only after the
  insert, so that is when its row is in ClickHouse.
"""

from __future__ import annotations

import asyncio
import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

from aiokafka import AIOKafkaProducer, TopicPartition

from bench.monitor import CpuMeter, EventIndex, OffsetSample, OffsetWatcher, RssSampler, profile_report, start_profile
from bench.stats import weighted_percentile
from bench.workload import LiveRuns, Message
from rlpulse.pipeline import Pipeline
from rlpulse.progress import Ticker
from rlpulse.base.settings import Settings
from rlpulse.schemas.catalogue import DERIVED_TOPICS, RAW_TOPICS, SINK_TOPICS
from rlpulse.schemas.codec import Codec

Progress = Callable[[str], None]


@dataclass
class DrainConfig:
    timeout_s: float = 360.0  # give up (and report a partial rate) after this long from the start
    sample_s: float = 0.5
    quiet_s: float = 5.0  # derived topics unchanged and every lag 0 for this long: drained
    profile_s: float = 15.0  # py-spy records this long from the first commit (0: no profile)
    profile_dir: Path | None = None
    broker_pid: int | None = None  # the broker `services up` started (its CPU per event too), when it is ours


@dataclass
class DrainResult:
    figures: dict[str, Any] = field(default_factory=dict)
    timeline: list[list[float]] = field(default_factory=list)  # [s since start, streams events, sink raw events, sink lag]


def producer_kwargs(settings: Settings) -> dict[str, Any]:
    """What our writers use (DESIGN, wire format): idempotent, acks=all, lz4."""
    return dict(settings.kafka_client_kwargs(), acks="all", enable_idempotence=True, compression_type="lz4",
                linger_ms=5, max_batch_size=1 << 20, max_request_size=1 << 20)


@dataclass(frozen=True)
class Sent:
    """An acknowledged message, without its records (a backlog's records would not fit in memory)."""

    tp: TopicPartition
    offset: int
    short: str
    records: int
    time_ns: int  # of its first record
    size: int  # bytes of the container


async def send_all(producer: AIOKafkaProducer, settings: Settings, codec: Codec, batch: list[Message],
                   sent: list[Sent]) -> None:
    """Encode and send ``batch``; append what the broker acknowledged to ``sent``."""
    futures = []
    for m in batch:
        value = codec.encode(m.record, m.records)
        future = await producer.send(settings.topic(m.short), value=value, key=m.key.encode())
        futures.append((m.short, len(m.records), m.records[0]["time_ns"], len(value), future))
    for short, records, time_ns, size, future in futures:
        meta = await future
        sent.append(Sent(TopicPartition(meta.topic, meta.partition), meta.offset, short, records, time_ns, size))


async def measure_drain(settings: Settings, pipeline: Pipeline, index: EventIndex, config: DrainConfig,
                        started: float, progress: Progress) -> DrainResult:
    raw = tuple(settings.topic(s) for s in RAW_TOPICS)
    derived = tuple(settings.topic(s) for s in DERIVED_TOPICS)
    everything = tuple(settings.topic(s) for s in SINK_TOPICS)
    streams, sink = settings.app_id, settings.sink_group
    result = DrainResult()
    rss = RssSampler({name: proc.pid for name, proc in pipeline.procs.items()})
    cpu = CpuMeter({name: proc.pid for name, proc in pipeline.procs.items()}
                   | ({"broker": config.broker_pid} if config.broker_pid else {}))
    cpu_at_drained: dict[str, float] = {}
    first: OffsetSample | None = None  # first sample with a streams commit
    first_sink: OffsetSample | None = None
    candidate: OffsetSample | None = None  # first sample of the current all-done, nothing-growing stretch
    streams_done: OffsetSample | None = None
    ready: dict[str, float] = {}  # group -> when it was first seen Stable with members
    profiles: dict[str, Any] = {}
    last_print = 0.0
    async with OffsetWatcher(settings, everything, (streams, sink)) as watch:
        while True:
            pipeline.check_alive()
            for group in (streams, sink):
                if group not in ready and await watch.stable(group):
                    ready[group] = time.monotonic()
            s = await watch.sample()
            rss.sample()
            streams_events = index.events_committed(s.committed[streams])
            sink_events = index.events_committed(s.committed[sink])
            sink_lag = s.lag(sink, everything)
            result.timeline.append([round(s.t - started, 2), streams_events, sink_events, sink_lag])
            if first is None and streams_events > 0:
                first = s
                cpu.start()
                if config.profile_s > 0 and config.profile_dir is not None:
                    for name, proc in pipeline.procs.items():
                        out = config.profile_dir / f"profile-{name}.raw"
                        out.unlink(missing_ok=True)
                        profiles[name] = (await start_profile(proc.pid, config.profile_s, out), out)
            if first_sink is None and sink_events > 0:
                first_sink = s
            streams_lag = s.lag(streams, raw)
            if streams_done is None and first is not None and streams_lag == 0:
                streams_done = s
            done = first is not None and streams_lag == 0 and sink_lag == 0
            if not done:
                candidate = None
            elif candidate is None or {tp: n for tp, n in s.end.items() if tp.topic in derived} != \
                    {tp: n for tp, n in candidate.end.items() if tp.topic in derived}:
                candidate = s
                cpu_at_drained = cpu.stop()
            if candidate is not None and s.t - candidate.t >= config.quiet_s:
                break
            if s.t - started > config.timeout_s:
                progress(f"drain: gave up after {config.timeout_s:.0f}s (streams lag {streams_lag}, sink lag {sink_lag})")
                break
            if s.t - last_print >= 10:
                last_print = s.t
                progress(f"drain: {s.t - started:5.0f}s  streams {streams_events:>9,}/{index.total:,} events"
                         f"  sink {sink_events:>9,} raw events, lag {sink_lag:,} messages")
            await asyncio.sleep(max(0.0, config.sample_s - (time.monotonic() - s.t)))
    figures = result.figures
    figures["drain_complete"] = candidate is not None
    for group, name in ((streams, "streams"), (sink, "sink")):
        figures[f"startup_to_{name}_group_ready_s"] = round(ready[group] - started, 2) if group in ready else None
    figures["startup_to_first_streams_commit_s"] = None if first is None else round(first.t - started, 2)
    figures["startup_to_first_sink_commit_s"] = None if first_sink is None else round(first_sink.t - started, 2)
    if first is not None:
        end = candidate or s
        counted = index.total - index.events_committed(first.committed[streams])
        if candidate is None:  # partial: what both groups got through
            counted = min(index.events_committed(end.committed[streams]), index.events_committed(end.committed[sink])) \
                - index.events_committed(first.committed[streams])
        seconds = end.t - first.t
        figures.update({"e2e_events_per_s": counted / seconds if seconds > 0 and counted > 0 else None,
                        "drain_seconds": round(seconds, 2), "drain_events_counted": counted,
                        "drain_events_before_first_commit": index.events_committed(first.committed[streams])})
        if len(ready) == 2 and candidate is not None:
            # The same drain timed from when both groups had their partitions: counts the events read
            # before the first commit too, and is the figure when a small backlog drains inside one commit interval.
            figures["e2e_events_per_s_from_groups_ready"] = index.total / (candidate.t - max(ready.values()))
        figures["e2e_rate_basis"] = "from the streams group's first commit to drained"
        if figures["e2e_events_per_s"] is None and figures.get("e2e_events_per_s_from_groups_ready"):
            figures["e2e_events_per_s"] = figures["e2e_events_per_s_from_groups_ready"]
            figures["e2e_rate_basis"] = "from both groups ready to drained (the backlog drained before the first commit)"
        if streams_done is not None and streams_done.t > first.t:
            figures["streams_only_events_per_s"] = counted / (streams_done.t - first.t)
        # CPU per event, from the first commit to drained: steady on a busy machine, where the rate is not
        for name, seconds in cpu_at_drained.items():
            figures[f"{name}_cpu_us_per_event"] = round(seconds / counted * 1e6, 3) if counted > 0 else None
    peaks = rss.peaks_mib()
    figures.update({"streams_peak_rss_mib": peaks.get("streams"), "sink_peak_rss_mib": peaks.get("sink"),
                    "rss_samples": rss.samples})
    for name, (proc, out) in profiles.items():
        if proc is None:
            figures[f"profile_{name}"] = {"error": "py-spy is not installed (pip install py-spy)"}
            continue
        output, _ = await proc.communicate()
        figures[f"profile_{name}"] = profile_report(name, out, output.decode(errors="replace"))
    return result


@dataclass(frozen=True)
class Scheduled:
    """A live message, encoded ahead of its phase, and when to send it (seconds after the phase starts)."""

    at_s: float
    short: str
    key: bytes
    value: bytes
    records: int


def schedule(live: LiveRuns, codec: Codec, rate: float, seconds: float, t0_ns: int,
             tick_s: float = 0.05) -> list[Scheduled]:
    """The live load as an open-loop schedule: every ``tick_s``, enough span containers to keep
    ``rate`` span events/s, their records stamped with the tick's time (``t0_ns`` + its offset)."""
    out: list[Scheduled] = []
    events, tick = 0, 1
    while (at := tick * tick_s) <= seconds:
        while events < rate * at:
            for m in live.spans(t0_ns + int(at * 1e9)):
                out.append(Scheduled(at, m.short, m.key.encode(), codec.encode(m.record, m.records), len(m.records)))
                events += len(m.records) if m.short == "spans" else 0
        tick += 1
    return out


def _start_after(live: LiveRuns, codec: Codec, rate: float, seconds: float) -> float:
    """Seconds from now after which the schedule will surely be built: its cost, timed on a copy
    of ``live`` (the real one's sequences must not skip), with half again and a second to spare."""
    sample_s = min(seconds, 0.5)
    t = time.process_time()
    schedule(copy.deepcopy(live), codec, rate, sample_s, time.time_ns())
    return (time.process_time() - t) * seconds / sample_s * 1.5 + 1.0


async def measure_latency(settings: Settings, codec: Codec, live: LiveRuns, rate: float, seconds: float,
                          progress: Progress, settle_s: float = 30.0, poll_s: float = 0.1) -> dict[str, Any]:
    """Publish ``rate`` span events/s for ``seconds``; latency per record from its time_ns to the sink's commit.

    Open loop: the messages are built and encoded before the phase, each stamped with the time it
    is due, and sent when due. A message sent late keeps its stamp, so the lag counts in its
    latency. (Built during the phase, on the same two cores as the pipeline, the generator itself
    fell behind: 21 µs of CPU per span to build and encode it, and 30-33k span events/s at most.)
    """
    spans = settings.topic("spans")
    pending: dict[TopicPartition, list[tuple[int, int, int]]] = {}  # tp -> [(offset, time_ns, records)] in order
    latencies: list[tuple[float, int]] = []
    stop = asyncio.Event()

    async def watch() -> None:
        async with OffsetWatcher(settings, (spans,), (settings.sink_group,)) as w:
            while True:
                committed = await w.committed(settings.sink_group)
                seen_ns = time.time_ns()  # after the answer: never earlier than the commit it reports
                for tp, queue in pending.items():
                    done = committed.get(tp, 0)
                    while queue and queue[0][0] < done:
                        _, t_ns, n = queue.pop(0)
                        latencies.append(((seen_ns - t_ns) / 1e9, n))
                if stop.is_set() and not any(pending.values()):
                    return
                await asyncio.sleep(poll_s)

    producer = AIOKafkaProducer(**producer_kwargs(settings))
    await producer.start()
    watcher = asyncio.create_task(watch())
    try:
        await send_all(producer, settings, codec, live.starts(time.time_ns()), [])
        t0_ns = time.time_ns() + int(_start_after(live, codec, rate, seconds) * 1e9)
        plan = schedule(live, codec, rate, seconds, t0_ns)
        late_start_s = max(0.0, (time.time_ns() - t0_ns) / 1e9)
        await asyncio.sleep(max(0.0, (t0_ns - time.time_ns()) / 1e9))
        sent_events, i, behind_s = 0, 0, 0.0
        while i < len(plan):
            at = plan[i].at_s
            await asyncio.sleep(max(0.0, (t0_ns + at * 1e9 - time.time_ns()) / 1e9))
            behind_s = max(behind_s, (time.time_ns() - t0_ns) / 1e9 - at)
            futures = []
            while i < len(plan) and plan[i].at_s == at:
                m = plan[i]
                futures.append((m, await producer.send(settings.topic(m.short), value=m.value, key=m.key)))
                i += 1
            for m, future in futures:
                meta = await future
                if m.short == "spans":
                    pending.setdefault(TopicPartition(meta.topic, meta.partition), []).append(
                        (meta.offset, t0_ns + int(at * 1e9), m.records))
                    sent_events += m.records
        achieved = sent_events / max((time.time_ns() - t0_ns) / 1e9, 1e-9)
        await send_all(producer, settings, codec, live.ends(time.time_ns()), [])
        stop.set()
        progress(f"latency: sent {sent_events:,} span events at {achieved:,.0f}/s (open loop, built beforehand; "
                 f"at most {behind_s:.2f}s behind schedule); waiting for the sink's commits")
        try:
            with Ticker("latency: waiting for the sink's commits", say=progress, every=10):
                await asyncio.wait_for(asyncio.shield(watcher), settle_s)
        except asyncio.TimeoutError:
            pass
    finally:
        watcher.cancel()
        await producer.stop()
    missing = sum(n for queue in pending.values() for _, _, n in queue)
    return {
        "e2e_latency_p50_s": weighted_percentile(latencies, 50),
        "e2e_latency_p99_s": weighted_percentile(latencies, 99),
        "e2e_latency_max_s": max((v for v, _ in latencies), default=None),
        "latency_target_events_per_s": rate, "latency_events_per_s": achieved, "latency_events": sent_events,
        "latency_events_not_committed": missing, "latency_behind_schedule_s": behind_s,
        "latency_late_start_s": late_start_s,
        "latency_method": (f"open loop: span containers built and encoded before the phase, each record stamped with "
                           f"when its message is due and sent then; latency from that stamp to the first poll "
                           f"({poll_s:.1f}s apart) that shows the sink group's committed offset past its message; "
                           "the sink commits after the insert"),
    }
