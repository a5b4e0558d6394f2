"""``rlpulse otlp-ingest``: reads the OTLP topics (the Collector's kafka exporter, ``rlpulse otlp``),
turns each request into rlpulse's records and publishes them where the SDK's would go.

At-least-once, as the sink: a poll's records are translated in order, their outputs and dead
letters are sent and acknowledged by the broker, and only then are the offsets committed. A
message that is not an OTLP request, breaks a bound (:mod:`rlpulse.producers.otlp.decode`) or
cannot be placed (no run id) goes to the dead-letter topic with the reason, and the messages
around it go on; nothing of a refused request is published (translation is all-or-nothing).

The metric translator differences cumulative series in memory; whenever the ingest gets its
partitions that memory is rebuilt from the messages before the committed offset
(:mod:`rlpulse.producers.otlp.warmup`), so a restart does not count a series whole again, and a
message replayed after a crash is differenced against the same previous point. Spans carry the
same ids on a replay, so ClickHouse keeps one row, and spans and steps carry the same replay marks
(:func:`number`), so the streams apply them once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from rlpulse.base.settings import Settings
from rlpulse.producers.otlp.decode import METRICS, TRACES, OtlpLimits, decode
from rlpulse.producers.otlp.identity import OtlpRejected, Out
from rlpulse.producers.otlp.metrics import MetricTranslator
from rlpulse.producers.otlp.spans import translate_spans
from rlpulse.producers.otlp.warmup import Warmup
from rlpulse.producers.sdk.containers import MAX_MESSAGE_BYTES
from rlpulse.schemas import lz4_level
from rlpulse.schemas.catalogue import DLQ_TOPIC, OTLP_METRICS_TOPIC, OTLP_SPANS_TOPIC, OTLP_WRITER_PREFIX
from rlpulse.schemas.codec import Codec
from rlpulse.schemas.compression import refusal
from rlpulse.schemas.dead_letters import build_letter

log = logging.getLogger(__name__)

SIGNALS = {OTLP_SPANS_TOPIC: TRACES, OTLP_METRICS_TOPIC: METRICS}
BATCH_RECORDS = 500  # records of one container, at most (then halved until it fits the broker)


def ingest_group(settings: Settings) -> str:
    return f"{settings.topic_prefix}-otlp"


class Translator:
    """Bytes of an OTLP topic into rlpulse's records; Kafka-free, so the tests drive it directly."""

    def __init__(self, limits: OtlpLimits | None = None, metrics: MetricTranslator | None = None):
        self.limits = limits or OtlpLimits()
        self.metrics = metrics or MetricTranslator()

    def translate(self, signal: str, value: bytes | None, now_ns: int) -> list[Out]:
        """The records of one message; raises OtlpRejected with the reason for a dead letter."""
        request = decode(signal, value, self.limits)
        if signal == TRACES:
            return translate_spans(request, now_ns)
        return self.metrics.translate(request, now_ns)


SEQUENCE_SHIFT = 16  # the mark = (offset + 1) << 16 | index: room for every record of one request
# The field the streams read a record's replay mark from (``writer_sequence or sequence_id``).
MARKS = {"Span": "writer_sequence", "Step": "sequence_id"}


def number(outs: list[Out], partition: int, offset: int) -> None:
    """Give the records that carry replay marks (spans, steps) their publish order from the Kafka
    position of their OTLP message, in place: the writer id gains ``@partition`` and the mark
    (a span's ``writer_sequence``, a step's ``sequence_id``) is ``(offset + 1) << 16 | index``. A replayed
    message repeats its numbers, so the streams skip it as they skip an SDK writer's replay, and
    ClickHouse keeps one row of it (OTLP_WRITER_PREFIX: the streams expect the jumps)."""
    index = 0
    for out in outs:
        record = out.record
        mark = MARKS.get(out.record_type)
        if mark is None:
            continue
        if index >= 1 << SEQUENCE_SHIFT:  # cannot happen within OtlpLimits; never a number shared with the next offset
            raise OtlpRejected(f"more than {1 << SEQUENCE_SHIFT} spans and steps from one OTLP request")
        writer = str(record.get("writer_id") or OTLP_WRITER_PREFIX)
        if not writer.startswith(OTLP_WRITER_PREFIX):
            writer = OTLP_WRITER_PREFIX + writer
        record["writer_id"] = f"{writer[:200]}@{partition}"
        # offset + 1: a mark of 0 reads as "none" to the streams (``writer_sequence or sequence_id``)
        record[mark] = ((offset + 1) << SEQUENCE_SHIFT) | index
        index += 1


def containers(codec: Codec, outs: Iterable[Out], max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, bytes, bytes]]:
    """(topic short name, key, Avro container) for ``outs``, in order: consecutive records of one
    topic, key and type share a container, each within ``max_bytes``."""
    runs: list[tuple[str, str, str, list[dict[str, Any]]]] = []
    for out in outs:
        if runs and runs[-1][:3] == (out.topic, out.key, out.record_type):
            runs[-1][3].append(out.record)
        else:
            runs.append((out.topic, out.key, out.record_type, [out.record]))
    messages = []
    for topic, key, record_type, records in runs:
        for chunk in _fitting(codec, record_type, records, max_bytes):
            messages.append((topic, key.encode(), chunk))
    return messages


def _fitting(codec: Codec, record_type: str, records: list[dict[str, Any]], max_bytes: int) -> list[bytes]:
    out = []
    pending = [records[i:i + BATCH_RECORDS] for i in range(0, len(records), BATCH_RECORDS)]
    while pending:
        chunk = pending.pop(0)
        data = codec.encode(record_type, chunk)
        if len(data) <= max_bytes or len(chunk) == 1:
            out.append(data)  # one record over the bound: the broker refuses it, and says so in the log
        else:
            half = len(chunk) // 2
            pending[:0] = [chunk[:half], chunk[half:]]
    return out


class OtlpIngest:
    """The consumer loop; ``run`` until ``stop`` is set."""

    def __init__(self, settings: Settings, translator: Translator | None = None):
        self.settings = settings
        self.translator = translator or Translator()
        self.codec = Codec()
        self.translated = 0  # OTLP requests turned into records
        self.dead = 0  # dead-lettered
        self.published = 0  # rlpulse records published

    async def run(self, stop: asyncio.Event) -> None:
        settings = self.settings
        kwargs = settings.kafka_client_kwargs()
        consumer = AIOKafkaConsumer(
            group_id=ingest_group(settings), enable_auto_commit=False, auto_offset_reset="earliest",
            max_partition_fetch_bytes=16 * 1024 * 1024, fetch_max_bytes=64 * 1024 * 1024, **kwargs)
        self.warmup = Warmup(self.translator, settings.topic(OTLP_METRICS_TOPIC), kwargs, self.translator.limits)
        self.warmup.consumer = consumer
        consumer.subscribe([settings.topic(t) for t in SIGNALS], listener=self.warmup)
        lz4_level.install()
        producer = AIOKafkaProducer(acks="all", enable_idempotence=True, linger_ms=5, compression_type="lz4",
                                    max_request_size=2 * MAX_MESSAGE_BYTES, **kwargs)
        signal_of = {settings.topic(short): signal for short, signal in SIGNALS.items()}
        await producer.start()
        try:
            await consumer.start()
            try:
                while not stop.is_set():
                    batch = await consumer.getmany(timeout_ms=500, max_records=200)
                    # aiokafka may hand out records of a new assignment while its listener still
                    # runs: none is translated before the state is rebuilt
                    await self.warmup.ready.wait()
                    if batch:
                        await self._handle(producer, consumer, signal_of, batch)
            finally:
                await consumer.stop()
        finally:
            await producer.stop()

    async def _handle(self, producer: AIOKafkaProducer, consumer: AIOKafkaConsumer, signal_of: dict[str, str],
                      batch: dict[TopicPartition, list[Any]]) -> None:
        futures = []
        offsets = {}
        for tp, messages in batch.items():
            for msg in messages:
                futures += await self._one(producer, signal_of[tp.topic], msg)
                offsets[tp] = msg.offset + 1
        for future in futures:
            await future  # a send that failed raises: no commit past a lost output or letter
        await consumer.commit(offsets)

    async def _one(self, producer: AIOKafkaProducer, signal: str, msg: Any) -> list[asyncio.Future]:
        where = f"{msg.topic}[{msg.partition}]@{msg.offset}"
        refused = refusal(msg.value)  # a compressed batch the bound refused: its one stand-in message
        if refused is not None:
            return [await self._dead(producer, msg, refused, where)]
        try:
            outs = self.translator.translate(signal, msg.value, time.time_ns())
            number(outs, msg.partition, msg.offset)
            messages = containers(self.codec, outs)
        except OtlpRejected as exc:
            return [await self._dead(producer, msg, str(exc), where)]
        except Exception as exc:  # noqa: BLE001 - a translator bug costs this message, not the ingest
            log.exception("the OTLP translator failed on %s", where)
            return [await self._dead(producer, msg, f"the translator failed: {type(exc).__name__}: {exc}", where)]
        self.translated += 1
        self.published += len(outs)
        return [await producer.send(self.settings.topic(topic), value=value, key=key) for topic, key, value in messages]

    async def _dead(self, producer: AIOKafkaProducer, msg: Any, reason: str, where: str) -> asyncio.Future:
        self.dead += 1
        log.warning("dead-lettering %s: %s (%d so far)", where, reason, self.dead)
        letter = build_letter(msg, reason)
        return await producer.send(self.settings.topic(DLQ_TOPIC), value=letter.value, key=letter.key,
                                   headers=letter.headers)


def run_ingest(settings: Settings) -> int:
    """``rlpulse otlp-ingest``: create the topics, then consume until SIGINT/SIGTERM."""
    import signal

    from rlpulse.schemas.topics import ensure_topics

    ensure_topics(settings)
    ingest = OtlpIngest(settings)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        log.info("reading %s into rlpulse's topics (group %s)", ", ".join(settings.topic(t) for t in SIGNALS),
                 ingest_group(settings))
        await ingest.run(stop)

    asyncio.run(main())
    log.info("stopped: %d requests translated into %d records, %d dead-lettered",
             ingest.translated, ingest.published, ingest.dead)
    metrics = ingest.translator.metrics
    if metrics.ignored:  # names rlpulse does not translate: a typo in a job's metric name shows here
        log.info("metrics ignored, by name: %s", ", ".join(f"{name} {n}" for name, n in metrics.ignored.most_common(20)))
    if metrics.counts:
        log.info("metric translator: %s", ", ".join(f"{k} {n}" for k, n in sorted(metrics.counts.items())))
    return 0
