"""A garbage writer under load: for a minute, someone who can write to the raw topics
sends malformed, oversized and hostile messages at a steady rate while training jobs publish
real runs, through the processes users run (``rlpulse streams`` and ``rlpulse sink`` as children,
the real broker, the backend's ClickHouse: chDB by default).

What is sent: :data:`RATE` hostile messages a second for :data:`GARBAGE_S` seconds, the kinds of
:data:`KINDS` in turn (each about 16 times), on ``spans``, ``steps`` and ``hardware``, with keys
that put them on the good runs' partitions, on another key, or anywhere (no key); meanwhile the
three jobs of ``tests.integration.workload`` publish a step a second each (6 rollouts graded on
two terms, clipped and zero rewards in patterns that fire alerts).

At the end:

* the figures in ClickHouse equal the jobs' ground truth exactly (grader failures and windows,
  step stats, reward histograms, alerts; every accepted event once, sequences 1..n) and no table
  holds a row of a hostile message (their records say project ``p``);
* every hostile message is exactly one dead letter whose source (topic, partition, offset) is the
  one the broker gave it when it was sent, with a reason naming what is wrong with it; no other
  message is dead-lettered; the two over the broker's size are kept truncated with their size and
  digest. The streams do not dead-letter (the sink does): they skip and count; their log must name
  every hostile message, by the same source, with a reason, and skip nothing else;
* neither process restarted: the same pids, alive until the test stops them, started once (their
  logs), no traceback; both exit 0 on SIGTERM;
* peak RSS (the kernel's ``VmHWM``) of each process under its bound in :data:`PEAK_RSS_MIB`;
* the read endpoint (``open_reader``, the client ``rlpulse query`` uses) answered a count every
  second throughout, each within :data:`ANSWER_WITHIN_S`, with no failure.

A one-line summary of the figures is printed (``pytest -s`` or ``-rA`` shows it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from rlpulse.pipeline import Pipeline, offsets, wait_groups_ready
from rlpulse.schemas.catalogue import DLQ_TOPIC, RAW_TOPICS
from rlpulse.schemas.codec import Codec
from rlpulse.schemas.limits import Limits
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics, read_topic
from rlpulse.sinks.store.clickhouse import Store, open_reader, open_store
from rlpulse.sinks.write.dlq import (ORIGINAL_SHA256, ORIGINAL_SIZE, REASON, SOURCE_OFFSET, SOURCE_PARTITION, SOURCE_TOPIC,
                               TRUNCATED)
from tests.integration.workload import (JUDGE_FAILURE, PROJECT, Job, assert_figures_equal, check_delivery,
                                        emitted_more_than_once, expected, figures_in, read_figures, stop_jobs)
from tests.unit.sinks.write.test_bounded_decoder import (SPAN, STEP, container, deflate_bomb, endless_span, many_records,
                                                          record_bytes, span)

pytestmark = [pytest.mark.integration, pytest.mark.full]  # ~60 s of garbage plus set-up and drain: make test-all

GARBAGE_S = 60.0
RATE = 4.0  # hostile messages a second: 240 in all
# Each process's VmHWM. Measured here: streams 117 MiB, sink 444 MiB (chDB in the process). Streams
# inflating one deflate bomb whole (200 MiB) or decoding the 20 MiB strings would pass 384.
PEAK_RSS_MIB = {"streams": 384, "sink": 1024}
ANSWER_WITHIN_S = 5.0  # each answer of the read endpoint
LIMITS = Limits()
HOSTILE_PROJECT = "p"  # what every hostile record says it is (tests.unit.sinks.write.test_bounded_decoder.span)


# -- the garbage -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    name: str
    short: str  # the raw topic it goes to
    value: bytes | None
    reason: str  # in its dead letter's reason (the sink's)
    streams_reason: str | None = None  # in the streams' log line, where it says it in other words
    truncated: bool = False  # too big for the broker as a dead letter: kept truncated

    @property
    def streams_says(self) -> str:
        return self.reason if self.streams_reason is None else self.streams_reason


def _huge_string_step() -> bytes:
    """One Step whose ``stage`` is a 20 MiB string (as in test_hostile_messages)."""
    record = dict(project=HOSTILE_PROJECT, run_id="r", attempt=1, stage="x" * (20 << 20), time_ns=1, type="STEP",
                  trainer="rl", step=1, step_count=1, tokens=1, duration_s=1.0, throughput=1.0, mfu=None,
                  dropped_events=0, writer_id="w", sequence_id=1)
    return container(STEP, [(1, record_bytes(STEP, record))])


def _deep_schema(levels: int = 40) -> dict:
    inner: object = "long"
    for _ in range(levels):
        inner = {"type": "array", "items": inner}
    fields = [{"name": "a", "type": "long"}, {"name": "deep", "type": inner}]
    return {"type": "record", "name": "rlpulse.v1.Step", "fields": fields}


def build_kinds() -> list[Kind]:
    """Each hostile message, built once (the same bytes are sent again and again)."""
    one = record_bytes(SPAN, span())
    good = Codec().encode("Span", [span(i) for i in range(1, 6)])
    alien = {"type": "record", "name": "Thing", "namespace": "evil", "fields": [{"name": "a", "type": "long"}]}
    run_id_as_long = dict(SPAN, fields=[dict(f, type="long") if f["name"] == "run_id" else f for f in SPAN["fields"]])
    over_bytes = f"over the sink's limit of {LIMITS.max_message_bytes} a message"
    return [
        Kind("not-avro", "spans", b"\x00\x01 this is not Avro " + bytes(range(256)), "not an Avro container"),
        Kind("empty", "steps", b"", "empty message (no value)", "message too short for an Avro container (0 bytes)"),
        Kind("tombstone", "spans", None, "empty message (no value)", "message too short for an Avro container (0 bytes)"),
        Kind("truncated", "spans", good[:-20], "runs past the end"),  # a good container, its last block cut
        Kind("2**62-items", "spans", endless_span(), "array of items that take no bytes"),  # 2.7 KB
        Kind("deflate-bomb", "steps", deflate_bomb(), over_bytes),  # 200 MiB inflated
        Kind("20MiB-string", "steps", _huge_string_step(), over_bytes, truncated=True),  # gzip on the wire
        Kind("too-many-records", "spans", many_records(LIMITS.max_message_records + 1),
             f"{LIMITS.max_message_records + 1} records, over the sink's limit of {LIMITS.max_message_records}",
             truncated=True),  # 8.9 MB of records, gzip on the wire (at the bound)
        Kind("unknown-schema", "spans", container(alien, [(1, b"\x0a")]), "record type evil.Thing does not belong on topic",
             "record type evil.Thing is not one of"),
        Kind("span-on-hardware", "hardware", good, "record type rlpulse.v1.Span does not belong on topic",
             "record type rlpulse.v1.Span is not one of"),
        Kind("deep-nesting", "steps", container(_deep_schema(), []),
             f"nests deeper than the sink's limit of {LIMITS.max_nesting}"),
        Kind("bzip2-codec", "spans", container(SPAN, [(1, one)], codec="bzip2"), "codec 'bzip2' is not one of"),
        Kind("too-many-blocks", "hardware", container(SPAN, [(1, one)] * (LIMITS.max_blocks + 1)),
             f"over the sink's limit of {LIMITS.max_blocks} blocks"),
        Kind("unresolvable-schema", "spans", container(run_id_as_long, [(1, one)]), "does not resolve into the reader schema",
             "SchemaResolutionError"),
        # Framing and schema check out, so only ClickHouse finds it (its insert fails, the sink splits the
        # insert until this message stands alone): a block that says 2 records and holds one.
        Kind("block-short-of-its-count", "spans", container(SPAN, [(2, one)]), "ClickHouse rejected the spans rows",
             "truncated Avro data"),
    ]


@dataclass(frozen=True)
class Sent:
    kind: Kind
    topic: str
    partition: int
    offset: int

    @property
    def source(self) -> tuple[str, int, int]:
        return self.topic, self.partition, self.offset


async def send_garbage(settings: Settings, kinds: list[Kind], check: Callable[[], None]) -> list[Sent]:
    """:data:`RATE` messages a second for :data:`GARBAGE_S` seconds, on a fixed schedule; each with
    the place the broker gave it. ``check`` runs between sends (a process or a job that died fails at once)."""
    # gzip on the wire: the broker checks only the compressed batch against its 1 MiB, so a
    # message far over it gets through
    producer = AIOKafkaProducer(compression_type="gzip", max_request_size=128 << 20, max_batch_size=128 << 20,
                                linger_ms=0, **settings.kafka_client_kwargs())
    keys = (f"{PROJECT}/run0".encode(), b"p/r", None)  # a good run's partition, another key, any partition
    sent: list[Sent] = []
    await producer.start()
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        for i in range(int(GARBAGE_S * RATE)):
            await asyncio.sleep(max(0.0, started + i / RATE - loop.time()))
            check()
            kind = kinds[i % len(kinds)]
            key = keys[(i + i // len(kinds)) % len(keys)]
            if kind.value is None and key is None:
                key = keys[0]  # a tombstone needs a key
            meta = await producer.send_and_wait(settings.topic(kind.short), key=key, value=kind.value)
            sent.append(Sent(kind, meta.topic, meta.partition, meta.offset))
    finally:
        await producer.stop()
    return sent


# -- the read endpoint, asked every second -----------------------------------------------------
class EndpointProbe(threading.Thread):
    """Counts the spans through ``store`` (a reader: the sink's read endpoint on chDB) every second
    until stopped; each answer's latency, or the failure."""

    def __init__(self, store: Store, every_s: float = 1.0):
        super().__init__(name="endpoint-probe", daemon=True)
        self.store, self.every_s = store, every_s
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        next_at = time.monotonic()
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                self.store.client.query(f"SELECT count() FROM {self.store.database}.spans")
                self.latencies.append(time.monotonic() - started)
            except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                self.failures.append(f"after {time.monotonic() - started:.1f}s: {type(exc).__name__}: {str(exc)[:200]}")
            next_at += self.every_s
            self.stopping.wait(max(0.0, next_at - time.monotonic()))

    def stop(self) -> None:
        self.stopping.set()
        self.join(ANSWER_WITHIN_S + 5)
        if self.is_alive():
            self.failures.append(f"a query still unanswered {ANSWER_WITHIN_S + 5:.0f}s after the probe was stopped")


def reader_of(settings: Settings, pipeline: Pipeline, timeout: float = 60.0) -> Store:
    """The reader of the running sink's store (its read endpoint, on chDB), once it serves."""
    deadline = time.monotonic() + timeout
    while True:
        pipeline.check_alive()
        try:
            store = open_reader(settings.clickhouse_dsn, owner="test_garbage_writer")
            store.client.query(f"SELECT count() FROM {store.database}.spans")
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    if settings.clickhouse_dsn.startswith("chdb://"):
        assert store.endpoint, "the sink holds the chDB store: reads must go through its endpoint"
    return store


# -- what the processes and the topics say -----------------------------------------------------
def peak_rss_mib(pid: int) -> float:
    """The kernel's peak resident set of ``pid`` (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def dead_letters(settings: Settings) -> list[tuple[tuple[str, int, int], dict[str, str], bytes | None]]:
    """(source topic, partition, offset), headers and value of every dead letter."""
    out = []
    for msg in asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic(DLQ_TOPIC))):
        h = {k: v.decode(errors="replace") for k, v in msg.headers}
        out.append(((h.get(SOURCE_TOPIC, ""), int(h.get(SOURCE_PARTITION, -1)), int(h.get(SOURCE_OFFSET, -1))), h, msg.value))
    return out


SKIPPED = re.compile(r"skipping undecodable message (\S+)\[(\d+)\]@(\d+): (.*) \((\d+) skipped so far")


def streams_skipped(log: str) -> list[tuple[tuple[str, int, int], str]]:
    """(source, reason) of each message the streams' log says they skipped as undecodable."""
    return [((m.group(1), int(m.group(2)), int(m.group(3))), m.group(4)) for m in SKIPPED.finditer(log)]


def hostile_rows(settings: Settings) -> dict[str, int]:
    """Rows of the hostile messages' project in every table that has a project column."""
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        q, db = store.client.query, store.database
        tables = [t for (t,) in q(f"SELECT table FROM system.columns WHERE database = '{db}' AND name = 'project'").result_rows]
        return {t: q(f"SELECT count() FROM {db}.{t} WHERE project = '{HOSTILE_PROJECT}'").result_rows[0][0] for t in tables}


def test_a_garbage_writer_under_load_changes_no_figure_and_every_message_is_accounted_for(settings: Settings) -> None:
    settings = dataclasses.replace(settings, window=10.0)  # as test_faults' workload; lateness 5 s (conftest)
    kinds = build_kinds()
    ensure_topics(settings)
    jobs = [Job(settings, i) for i in range(len(JUDGE_FAILURE))]
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        procs = dict(pipeline.procs)
        pids = {name: p.pid for name, p in procs.items()}
        probe = EndpointProbe(reader_of(settings, pipeline))
        probe.start()
        for job in jobs:
            job.start()

        def check() -> None:
            pipeline.check_alive()
            for job in jobs:
                job.check()

        began = time.monotonic()
        sent = asyncio.run(send_garbage(settings, kinds, check))
        garbage_s = time.monotonic() - began
        stop_jobs(jobs)
        want = expected(jobs, settings)
        drain_from = time.monotonic()
        pipeline.wait_caught_up(until=figures_in(settings, want), timeout=240)
        drain_s = time.monotonic() - drain_from
        probe.stop()
        # neither process restarted: the same two, alive all along
        pipeline.check_alive()
        assert {name: p.pid for name, p in pipeline.procs.items()} == pids
        peaks = {name: peak_rss_mib(pid) for name, pid in pids.items()}
        end, _ = offsets(settings, settings.sink_group, RAW_TOPICS)
        pipeline.stop()
    assert {name: p.returncode for name, p in procs.items()} == {"streams": 0, "sink": 0}  # SIGTERM: a clean exit
    got = read_figures(settings)
    counts = check_delivery(jobs, got)
    again = emitted_more_than_once(settings)
    letters = dead_letters(settings)
    logs = settings.home / "logs"
    streams_log, sink_log = (logs / "streams.log").read_text(), (logs / "sink.log").read_text()
    skipped = streams_skipped(streams_log)
    rows = hostile_rows(settings)

    by_source = {s.source: s for s in sent}
    letter_reasons = Counter(by_source[src].kind.name if src in by_source else f"not sent as garbage: {src}"
                             for src, _, _ in letters)
    answers = probe.latencies
    summary = {
        "garbage_s": round(garbage_s, 1), "rate_per_s": round(len(sent) / garbage_s, 2),
        "sent_good_messages": sum(end.values()) - len(sent),
        "sent_good_events": counts["accepted_spans"] + counts["accepted_steps"],
        "sent_hostile": len(sent), "dead_letters": len(letters), "dead_letters_by_kind": dict(sorted(letter_reasons.items())),
        "streams_skipped": len(skipped), "peak_rss_mib": {k: round(v, 1) for k, v in sorted(peaks.items())},
        "endpoint_answers": len(answers), "endpoint_max_s": round(max(answers, default=0.0), 3),
        "endpoint_failures": len(probe.failures), "drain_s": round(drain_s, 1),
        "figures_compared": {name: len(want[name]) for name in ("steps", "windows", "failures", "histograms", "alerts")},
    }
    print(f"\ngarbage writer: {json.dumps(summary)}")

    # the figures are the truth's; no hostile record anywhere
    assert counts["dropped"] == 0
    assert_figures_equal(want, got)
    assert again == {"step-stats": [], "grader-windows": []}
    assert rows and set(rows.values()) == {0}, rows
    # every hostile message is one dead letter, from where it was sent, with its reason; nothing else is
    assert len(sent) == int(GARBAGE_S * RATE)
    assert Counter(src for src, _, _ in letters) == Counter(s.source for s in sent), "dead letters are not the garbage sent"
    for src, headers, value in letters:
        kind = by_source[src].kind
        assert headers.get(REASON) and kind.reason in headers[REASON], (kind.name, headers.get(REASON))
        assert bool(headers.get(TRUNCATED)) == kind.truncated, (kind.name, headers)
        if kind.truncated:
            original = kind.value or b""
            assert (int(headers[ORIGINAL_SIZE]), headers[ORIGINAL_SHA256]) == (len(original),
                                                                               hashlib.sha256(original).hexdigest())
            assert value is not None and value == original[:len(value)] and len(value) < 1 << 20
        else:
            assert value == kind.value or (kind.value is None and value in (None, b"")), kind.name
    assert letter_reasons == Counter(s.kind.name for s in sent)
    # the streams skip and count (the sink dead-letters): every hostile message, with its reason, and nothing else
    assert {src for src, _ in skipped} == set(by_source), "the streams' skips are not exactly the garbage sent"
    for src, reason in skipped:
        assert reason and by_source[src].kind.streams_says in reason, (by_source[src].kind.name, reason)
    assert "the decoder failed on it" not in streams_log
    assert max(int(m.group(5)) for m in SKIPPED.finditer(streams_log)) == len(skipped)  # its own count agrees
    # started once each, no agent restarted inside the worker, no traceback; the sink counted the letters too
    assert sink_log.count("sink consuming") == 1 and streams_log.count("[^Worker]: Starting...") == 1
    assert "Crashed" not in streams_log and "Traceback" not in sink_log and "Traceback" not in streams_log
    stopped = re.search(r"sink stopped: .*, dead letters (\d+),", sink_log)
    assert stopped and int(stopped.group(1)) == len(sent), stopped
    # bounded memory; the endpoint answered throughout
    assert all(peaks[name] < bound for name, bound in PEAK_RSS_MIB.items()), (peaks, PEAK_RSS_MIB)
    assert probe.failures == [], probe.failures
    assert len(answers) >= GARBAGE_S and max(answers) < ANSWER_WITHIN_S, (len(answers), max(answers, default=None))
