"""The Faust application: binds the worker to topics, tables and timers, and nothing more.

* ``runs`` agent: ``spans``, ``steps`` and ``ticks``, co-partitioned by ``project/run_id``; every
  figure and alert of a run comes from :class:`rlpulse.streams.runs.RunProcessor`, its state one entry of
  the ``runs`` table written once per message.
* ``gpus`` agent: ``hardware`` and ``ticks``; XID and slowdown alerts per GPU.
* A timer sends one tick to every partition of ``ticks`` twice a second: a Faust table can only
  be written while an event of its partition is processed, and idle runs, stalls and silence
  need the wall clock. A partition's runs get no wall-clock work until this worker has read
  what was waiting on it when it got it (``ProcessedOffsets.caught_up``): after a restart the
  rebalance alone takes ``broker_session_timeout``, and a run whose messages are still in Kafka
  is neither idle nor silent.

What each event does (offsets, catch-up, ticks, publishing) is :class:`rlpulse.streams.worker.StreamsWorker`,
which knows no Faust type; the adapters below give it Faust's consumer and topics.

Processing is at-least-once (``concurrency=1``); replays are skipped by the sequence marks kept
in each run's state, and Faust flushes its producer (outputs and changelog) before it commits.
"""

from __future__ import annotations

import gc
import logging
import sys
from typing import Any
from collections.abc import Mapping

import faust
from aiokafka.partitioner import DefaultPartitioner, murmur2
from faust.types import TP

from rlpulse.schemas import lz4_level
from rlpulse.schemas.catalogue import DERIVED_TOPICS, HARDWARE_TOPICS, RUN_TOPICS, TICKS_TOPIC
from rlpulse.base.files import private_dir
from rlpulse.base.settings import Settings
from rlpulse.streams.commits import DropFault, TopicPartition
from rlpulse.streams.inputs import KafkaRanges
from rlpulse.streams.runs import RunConfig, RunProcessor
from rlpulse.streams.stage import HardwareStage, RunStage
from rlpulse.streams.worker import Clock, Lane, StreamsWorker, SystemClock

log = logging.getLogger(__name__)

TICK_INTERVAL_S = 0.5

class CachedPartitioner:
    """aiokafka's ``DefaultPartitioner`` (Kafka's murmur2 of the key) with each key's hash kept.

    A worker sends every output and changelog write of a run under the run's key, some 56 sends
    a run in make bench's drain, and aiokafka's murmur2 is pure Python (1.8 us a key; 1.2% of the
    streams' CPU in the drain's profile). The same key gives the same partition as before: the hash
    is the library's own, taken once. Bounded: forgotten whole when full.
    """

    MAX_KEYS = 1 << 16

    def __init__(self) -> None:
        self._default = DefaultPartitioner()
        self._hashes: dict[bytes, int] = {}

    def __call__(self, key: bytes | None, all_partitions: list[int], available: list[int]) -> int:
        if key is None:
            return int(self._default(key, all_partitions, available))  # a random partition, as aiokafka's
        h = self._hashes.get(key)
        if h is None:
            if len(self._hashes) >= self.MAX_KEYS:
                self._hashes.clear()
            h = self._hashes[key] = murmur2(key) & 0x7FFFFFFF
        return all_partitions[h % len(all_partitions)]


# Faust settings, each with the figure that justified it (`rlpulse bench --skip-sdk --reps 1`,
# 1,012,000-event backlog of 1,000 runs, streams + sink on this 2-core machine; docs/performance.md).
FAUST_TUNING: dict[str, Any] = {
    # The derived topics and the changelog get many small messages: batch them and compress.
    # Linger 5 ms sent many small produce requests: `rlpulse bench --quick` drained 65,424 and 73,236
    # events/s (streams 11.2-11.3 µs CPU per event, broker 2.4); 50 ms: 95,979 and 92,970 (streams 9.3-9.5,
    # broker 0.75-0.77); 20 ms: 89,117; 200 ms: 83,405. Outputs wait at most 50 ms more; the raw
    # events' latency to ClickHouse does not go through the streams.
    "producer_linger": 0.05,
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


class FaustTopics:
    """Faust's producer as the worker's publisher (``rlpulse.streams.worker.Publisher``), by short name.

    Straight to the producer, not through ``Topic.send``: Faust's channel machinery (a
    FutureMessage, the serializer registry, sensors) cost about a third of each send, and the
    values are bytes already. Faust flushes this same producer before every commit
    (``Consumer.commit``), so at-least-once holds as before; a send that fails is logged.
    """

    def __init__(self, app: faust.App, names: Mapping[str, str]):
        self.app, self.names = app, names

    async def send(self, topic: str, key: bytes, value: bytes, partition: int | None = None) -> None:
        future = await self.app.producer.send(self.names[topic], key, value, partition, None, None)
        future.add_done_callback(_failed_send)  # type: ignore[attr-defined]  # aiokafka's asyncio.Future


def _failed_send(future: Any) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("an output was not delivered: %s", future.exception())


class FaustConsumer:
    """Faust's consumer as the worker's ``rlpulse.streams.commits.ConsumerView``, partitions converted both
    ways. The committed offsets and the commit itself are Faust's private parts: see rlpulse.streams.commits
    for why this worker commits at all, through Faust's own path (producer flushed first)."""

    def __init__(self, app: faust.App):
        self.app = app

    @property
    def consumer(self) -> Any:
        """Faust's consumer, read at each call (Faust builds it lazily); its abstract type lacks what is used here."""
        return self.app.consumer

    def committed(self, tp: TopicPartition) -> int | None:
        return self.consumer._committed_offset.get(TP(*tp))  # noqa: SLF001 - see the class docstring

    def highwater(self, tp: TopicPartition) -> int | None:
        return self.consumer.highwater(TP(*tp))

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition(*tp) for tp in self.consumer.assignment()}

    async def commit_under_way(self) -> bool:
        return bool(await self.consumer.maybe_wait_for_commit_to_finish())

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        await self.consumer._commit_offsets({TP(*tp): o for tp, o in offsets.items()})  # noqa: SLF001


def create_app(settings: Settings, clock: Clock | None = None) -> faust.App:
    clock = clock or SystemClock()
    lz4_level.install()  # the changelog and derived topics at lz4's fast level (rlpulse.schemas.lz4_level)
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
        producer_partitioner=CachedPartitioner(),
        **FAUST_TUNING,
    )

    def topic(*shorts: str) -> faust.TopicT:
        return app.topic(*(settings.topic(s) for s in shorts), key_type=bytes, value_type=bytes,
                         key_serializer="raw", value_serializer="raw", partitions=settings.partitions)

    runs = RunStage(RunProcessor(RunConfig.from_settings(settings), resumed_ns=clock.wall_ns()),
                    app.Table("runs", default=None, partitions=settings.partitions, value_type=bytes))
    gpus = HardwareStage(settings.alerts, app.Table("gpus", default=None, partitions=settings.partitions))
    worker = StreamsWorker(
        settings.topic_prefix, settings.partitions, runs, gpus, clock=clock,
        publisher=FaustTopics(app, {short: settings.topic(short) for short in (*DERIVED_TOPICS, TICKS_TOPIC)}),
        ranges=KafkaRanges(settings.kafka_client_kwargs), consumer=FaustConsumer(app),
    )
    fault = DropFault(settings.faults.drop_first)
    if fault.first:
        fault.install(app.consumer, {settings.topic(s) for s in RUN_TOPICS + HARDWARE_TOPICS if s != TICKS_TOPIC})

    async def drive(stream: faust.StreamT, lane: Lane) -> None:
        async for event in stream.events():
            msg = event.message
            await worker.on_event(lane, TopicPartition(msg.topic, msg.partition), msg.offset, event.value)

    @app.agent(topic(*RUN_TOPICS), concurrency=1)
    async def run_agent(stream: faust.StreamT) -> None:
        await drive(stream, worker.runs)

    @app.agent(topic(*HARDWARE_TOPICS), concurrency=1)
    async def gpu_agent(stream: faust.StreamT) -> None:
        await drive(stream, worker.gpus)

    @app.timer(interval=TICK_INTERVAL_S)
    async def tick() -> None:
        await worker.send_ticks()

    @app.timer(interval=10.0)
    async def report() -> None:
        worker.report()

    # Twice Faust's interval: it only steps in where Faust's own commit did not move.
    @app.timer(interval=2 * settings.streams_commit_interval)
    async def commit_behind() -> None:
        await worker.commit_behind()

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]  # mode's handler type wants no named argument
    async def on_revoked(app: faust.App, revoked: set, **kwargs: Any) -> None:
        worker.forget({TopicPartition(*tp) for tp in revoked})

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
    tune_gc()
    worker.execute_from_commandline()


GC_THRESHOLDS = (20_000, 20, 10)  # Python's default is (700, 10, 10)


def tune_gc() -> None:
    """Fewer cyclic collections in the worker, and none over what it loaded before its first message.

    A worker allocates and frees dicts by the million (records, outputs, figures), few of them in
    cycles; at Python's default a collection ran every 700 allocations and the full ones walked
    the whole heap, Faust's and aiokafka's modules included: 0.73 s of the streams' 10.4 s of CPU in
    make bench's drain, 985 collections. Objects alive now move to the permanent generation
    (``gc.freeze``); collections still run, less often, so a cycle is still freed.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
