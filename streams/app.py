"""The Faust application: binds the processors to topics and tables, and nothing more.

* ``runs`` agent: ``spans``, ``steps`` and ``ticks``, co-partitioned by ``project/run_id``; every
  figure and alert of a run comes from :class:`streams.runs.RunProcessor`, its state one entry of
  the ``runs`` table written once per message.
* ``gpus`` agent: ``hardware`` and ``ticks``; XID and slowdown alerts per GPU.
* A timer sends one tick to every partition of ``ticks`` twice a second: a Faust table can only
  be written while an event of its partition is processed, and idle runs, stalls and silence
  need the wall clock. A partition's runs get no wall-clock work until this worker has read
  what was waiting on it when it got it (``ProcessedOffsets.caught_up``): after a restart the
  rebalance alone takes ``broker_session_timeout``, and a run whose messages are still in Kafka
  is neither idle nor silent.

Processing is at-least-once (``concurrency=1``); replays are skipped by the sequence marks kept
in each run's state, and Faust flushes its producer (outputs and changelog) before it commits.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import defaultdict
from typing import Any, Callable

import faust
from faust.types import TP

from rlpulse.schemas.files import private_dir
from rlpulse.schemas.settings import Settings
from rlpulse.schemas.catalogue import DERIVED_TOPICS, HARDWARE_TOPICS, RUN_TOPICS, TICKS_TOPIC
from rlpulse.schemas.codec import Codec
from rlpulse.streams.commits import DropFault, ProcessedOffsets, TickWatch
from rlpulse.streams.inputs import Inputs, read_range
from rlpulse.streams.runs import Output, RunConfig, RunProcessor
from rlpulse.streams.stage import HardwareStage, RunStage

log = logging.getLogger(__name__)

TICK_INTERVAL_S = 0.5

# Faust settings, each with the figure that justified it (`rlpulse bench --skip-sdk --reps 1`,
# 1,012,000-event backlog of 1,000 runs, streams + sink on this 2-core machine; README "Performance").
FAUST_TUNING: dict[str, Any] = {
    # The derived topics and the changelog get many small messages: batch them and compress.
    "producer_linger": 0.005,
    "producer_max_batch_size": 1024 * 1024,
    "producer_compression_type": "lz4",
    "producer_acks": -1,
    # Large polls keep the agent fed: with 100 records a poll (and a 64-message buffer) the
    # processor sat idle waiting for messages, 29,741 events/s end to end; with Faust's 500 (and
    # its 4,096 buffer), 43,887; with 2,000, 47,909. Streams peak RSS 188 MiB against 99.
    "broker_max_poll_records": 2000,
    # Fetch up to 8 MiB a partition (Faust: 1 MiB, about 30 of our containers): one drain went from
    # 47,270 to 62,606 events/s (streams peak RSS 199 -> 221 MiB).
    "consumer_max_fetch_size": 8 * 1024 * 1024,
}


def create_app(settings: Settings, clock: Callable[[], int] = time.time_ns) -> faust.App:
    datadir = private_dir(private_dir(settings.home / "faust") / settings.app_id)  # the owner's only, as the store
    app = faust.App(
        settings.app_id,
        broker=f"kafka://{settings.kafka_bootstrap}",
        store="memory://",
        topic_partitions=settings.partitions,
        processing_guarantee="at_least_once",
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
        datadir=str(datadir),
        table_cleanup_interval=3600.0,  # our state is cleaned by the processors, not by Faust
        broker_credentials=_credentials(settings),
        # A killed worker's partitions move to its replacement after this long (Faust's default is 60 s).
        broker_session_timeout=10.0,
        broker_heartbeat_interval=3.0,
        broker_commit_interval=settings.streams_commit_interval,
        **FAUST_TUNING,
    )
    codec = Codec()

    def topic(*shorts: str) -> faust.TopicT:
        return app.topic(*(settings.topic(s) for s in shorts), key_type=bytes, value_type=bytes,
                         key_serializer="raw", value_serializer="raw", partitions=settings.partitions)

    outputs = {short: topic(short) for short in DERIVED_TOPICS}
    ticks = topic(TICKS_TOPIC)
    runs = RunStage(RunProcessor(RunConfig.from_settings(settings), resumed_ns=clock()),
                    app.Table("runs", default=None, partitions=settings.partitions))
    gpus = HardwareStage(settings.alerts, app.Table("gpus", default=None, partitions=settings.partitions))

    async def publish(out: list[Output]) -> None:
        """One container per (topic, key, record type); sent, not awaited: Faust flushes before committing."""
        groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
        for o in out:
            groups[(o.topic, o.key, o.schema)].append(o.record)
        for (short, key, schema), records in groups.items():
            await outputs[short].send(key=key.encode(), value=codec.encode(schema, records))

    inputs = Inputs(codec)
    processed = ProcessedOffsets()
    fault = DropFault.from_env(os.environ)
    if fault.first:
        fault.install(app.consumer, {settings.topic(s) for s in RUN_TOPICS + HARDWARE_TOPICS if s != TICKS_TOPIC})
    prefix_len = len(settings.topic_prefix) + 1

    async def drive(stream: faust.StreamT, on_message: Callable[..., list[Output]],
                    on_tick: Callable[[int, int, bytes], list[Output]], tracks_catch_up: bool = False) -> None:
        """One agent's loop: a tick or a message in, the outputs published, the offset marked done.
        ``tracks_catch_up``: this agent's inputs are the ones ``run_tick`` follows (and reads when stuck)."""
        async for event in stream.events():
            msg, now = event.message, clock()
            short = msg.topic[prefix_len:]
            if short == TICKS_TOPIC:
                await publish(on_tick(msg.partition, now, event.value))
                for tp, first, end in processed.take_stuck() if tracks_catch_up else ():
                    for offset, value in await read_range(settings.kafka_client_kwargs(), tp, first, end):
                        await handle(tp.topic[prefix_len:], tp.topic, tp.partition, offset, value, on_message)
                        processed.done_offset(tp, offset)
            else:
                first = processed.missed(app.consumer, msg)
                if first is not None:  # offsets Faust never handed us: read them first, in order
                    for offset, value in await read_range(settings.kafka_client_kwargs(), msg.tp, first, msg.offset):
                        await handle(short, msg.topic, msg.partition, offset, value, on_message)
                        processed.done_offset(msg.tp, offset)
                await handle(short, msg.topic, msg.partition, msg.offset, event.value, on_message, now)
            processed.done(msg)

    async def handle(short: str, topic: str, partition: int, offset: int, value: bytes | None,
                     on_message: Callable[..., list[Output]], now: int | None = None) -> None:
        records = inputs.decode(short, value, f"{topic}[{partition}]@{offset}")
        if records:
            await publish(on_message(short, partition, records, clock() if now is None else now))

    tick_watch = TickWatch()

    def run_tick(partition: int, now: int, value: bytes) -> list[Output]:
        sources = [TP(settings.topic(short), partition) for short in RUN_TOPICS if short != TICKS_TOPIC]
        if tick_watch.cut_off(partition, TickWatch.sent(value), now):
            processed.recheck(sources)  # events published while we were cut off may still be on their way
        return runs.on_tick(partition, now, caught_up=processed.caught_up(app.consumer, sources, time.monotonic()))

    @app.agent(topic(*RUN_TOPICS), concurrency=1)
    async def run_agent(stream: faust.StreamT) -> None:
        await drive(stream, runs.on_message, run_tick, tracks_catch_up=True)

    @app.agent(topic(*HARDWARE_TOPICS), concurrency=1)
    async def gpu_agent(stream: faust.StreamT) -> None:
        await drive(stream, lambda short, partition, records, now: gpus.on_message(partition, records, now),
                    lambda partition, now, value: gpus.on_tick(partition, now))

    @app.timer(interval=TICK_INTERVAL_S)
    async def tick() -> None:
        for partition in range(settings.partitions):
            await ticks.send(key=b"tick", value=TickWatch.stamp(clock()), partition=partition)

    throughput = {"at": time.monotonic(), "records": 0}

    @app.timer(interval=10.0)
    async def report() -> None:
        # One line every 10 s while records flow: what a person watching the worker wants to know.
        p, now = runs.processor, time.monotonic()
        records = p.applied - throughput["records"]
        if records:
            log.info("run processor: %d records in %.0fs (%.0f/s); %d replayed records skipped, %d missing "
                     "(sequence gaps), %d refused by the input limits so far", records, now - throughput["at"],
                     records / (now - throughput["at"]), p.duplicates, p.sequence_gaps,
                     p.terms_refused + p.names_refused + p.runs_refused)
        throughput.update(at=now, records=p.applied)

    # Twice Faust's interval: it only steps in where Faust's own commit did not move.
    @app.timer(interval=2 * settings.streams_commit_interval)
    async def commit_behind() -> None:
        committed = await processed.commit_behind(app.consumer)
        if committed:
            log.info("committed %d partitions Faust had left behind", len(committed))

    @app.on_partitions_revoked.connect
    async def on_revoked(app: faust.App, revoked: set, **kwargs: Any) -> None:
        processed.forget(revoked)

    return app


def _credentials(settings: Settings) -> object | None:
    """Faust's form of the Kafka security settings (None for PLAINTEXT): the same protocol,
    mechanism, user and TLS context (client certificate included) as ``Settings.kafka_client_kwargs``."""
    protocol = settings.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return None
    ssl_context = settings.kafka_ssl_context()  # None for SASL_PLAINTEXT: Faust then says SASL_PLAINTEXT
    if protocol == "SSL":
        return faust.SSLCredentials(ssl_context)
    # Settings validated the mechanism at load: never Faust's silent default of PLAIN.
    return faust.SASLCredentials(
        username=settings.kafka_sasl_username, password=settings.kafka_sasl_password,
        mechanism=settings.kafka_sasl_mechanism, ssl_context=ssl_context,
    )


def run_worker(settings: Settings, loglevel: str = "INFO") -> None:
    """Run the Faust worker in this process until SIGTERM/SIGINT.

    Its topics are created first; topics that disagree on partition counts (one auto-created by
    the broker, say) end the worker with a message naming them, instead of Faust restarting its
    agents forever on ``PartitionsMismatch``.
    """
    from rlpulse.schemas.topics import PartitionMismatch, check_copartitioned, ensure_topics

    ensure_topics(settings)
    try:
        check_copartitioned(settings, tuple(dict.fromkeys(RUN_TOPICS + HARDWARE_TOPICS)))
    except PartitionMismatch as exc:
        print(f"rlpulse streams: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    app = create_app(settings)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()
