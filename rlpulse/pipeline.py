"""Runs the pipeline's processes (``rlpulse streams``, ``rlpulse sink``) as children and waits
until they have caught up; used by ``rlpulse demo`` and by the integration tests, so both
exercise the commands a user runs."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment
from aiokafka.errors import KafkaError

from rlpulse.base.files import PRIVATE_UMASK, private_dir, private_file
from rlpulse.base.settings import Settings
from rlpulse.producers.otlp.ingest import ingest_group
from rlpulse.schemas.topics import topics_partitions

from rlpulse.schemas.catalogue import OTLP_TOPICS, RAW_TOPICS, sink_topics

STREAMS_TOPICS = RAW_TOPICS  # the streams' consumer group commits these (ticks are not waited on)


def settings_env(settings: Settings) -> dict[str, str]:
    """Environment that gives a child process these settings: this one's, with every setting's
    variable set from ``settings`` (``Settings.env()``; the password included: the environment is
    the owner's only)."""
    return {**os.environ, **settings.env()}


async def offsets_async(settings: Settings, group: str,
                        shorts: tuple[str, ...]) -> tuple[dict[TopicPartition, int], dict[TopicPartition, int]]:
    """End offsets of the topics, and ``group``'s committed offsets on them (0 where it never committed)."""
    kafka = settings.kafka_client_kwargs()
    consumer = AIOKafkaConsumer(**kafka)
    admin = AIOKafkaAdminClient(**kafka)
    await consumer.start()
    await admin.start()
    try:
        topics = [settings.topic(s) for s in shorts]
        tps = await topics_partitions(consumer, topics)
        if len(tps) < len(topics):
            raise RuntimeError(f"topics missing on {settings.kafka_bootstrap}: {sorted(set(topics) - {tp.topic for tp in tps})}")
        end = await consumer.end_offsets(tps) if tps else {}
        committed = await admin.list_consumer_group_offsets(group)
        done = {}
        for tp in tps:
            meta = committed.get(tp)
            done[tp] = meta.offset if meta is not None and meta.offset >= 0 else 0
        return dict(end), done
    finally:
        await admin.close()
        await consumer.stop()


def offsets(settings: Settings, group: str,
            shorts: tuple[str, ...]) -> tuple[dict[TopicPartition, int], dict[TopicPartition, int]]:
    return asyncio.run(offsets_async(settings, group, shorts))


async def lag_async(settings: Settings, group: str, shorts: tuple[str, ...]) -> dict[str, int]:
    """Messages not yet committed by ``group``, per topic (a topic the group never committed counts whole)."""
    end, done = await offsets_async(settings, group, shorts)
    lag = {settings.topic(s): 0 for s in shorts}
    for tp, n in end.items():
        lag[tp.topic] += max(n - done[tp], 0)
    return lag


def lag(settings: Settings, group: str, shorts: tuple[str, ...]) -> dict[str, int]:
    return asyncio.run(lag_async(settings, group, shorts))


def partition_lag(settings: Settings, group: str, shorts: tuple[str, ...]) -> list[tuple[str, int, int, int]]:
    """``group``'s position on each partition of the topics: (topic, partition, committed, end), in
    the order of ``shorts`` then by partition; committed is 0 where the group never committed, and
    the lag is end - committed."""
    end, done = offsets(settings, group, shorts)
    order = {settings.topic(short): i for i, short in enumerate(shorts)}
    return sorted(((tp.topic, tp.partition, done[tp], n) for tp, n in end.items()), key=lambda r: (order[r[0]], r[1]))


async def rewind_async(settings: Settings, group: str, shorts: tuple[str, ...]) -> None:
    """Commit offset 0 for ``group`` on every partition of the topics: its next member reads them all again."""
    consumer = AIOKafkaConsumer(group_id=group, enable_auto_commit=False, **settings.kafka_client_kwargs())
    await consumer.start()
    try:
        tps = await topics_partitions(consumer, [settings.topic(s) for s in shorts])
        consumer.assign(tps)
        await consumer.commit({tp: 0 for tp in tps})
    finally:
        await consumer.stop()


def rewind(settings: Settings, group: str, shorts: tuple[str, ...]) -> None:
    asyncio.run(rewind_async(settings, group, shorts))


async def existing_groups_async(settings: Settings) -> set[str]:
    """The consumer groups the broker knows (those that ever committed or have members)."""
    admin = AIOKafkaAdminClient(**settings.kafka_client_kwargs())
    await admin.start()
    try:
        return {group for group, _protocol in await admin.list_consumer_groups()}
    finally:
        await admin.close()


def existing_groups(settings: Settings) -> set[str]:
    return asyncio.run(existing_groups_async(settings))


COMMANDS = ("streams", "sink", "otlp-ingest")


def command_of(name: str) -> str:
    """The command of a pipeline process's name: ``streams-2`` -> ``streams``, ``otlp-ingest`` as it is."""
    base, _, number = name.rpartition("-")
    return base if base and number.isdigit() else name


class Pipeline:
    """The pipeline's processes as children with their logs under ``home/logs``.

    A process is named by its command, with ``-N`` for a second or later one of the same command:
    ``streams``, ``streams-2``, ``sink-2``. Workers of one command share its consumer group
    (``<prefix>-streams``, ``<prefix>-sink``), so Kafka splits the partitions between them. Each
    streams worker's Kafka client id is ``rlpulse-<name>``: the group's members, and so which
    partitions a worker holds (:func:`members`), can be told apart. They may share the Faust datadir:
    with the in-memory table store it holds nothing but an empty ``tables`` folder.
    """

    def __init__(self, settings: Settings, log_dir: Path | None = None):
        self.settings = settings
        self.log_dir = log_dir or settings.home / "logs"
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, which: tuple[str, ...] = ("streams", "sink"), extra_env: dict[str, str] | None = None) -> None:
        private_dir(self.log_dir)
        for name in which:
            command = command_of(name)
            if command not in COMMANDS or (name != command and not name[len(command) + 1:].isdigit()):
                raise ValueError(f"unknown pipeline process {name!r}: streams, sink or otlp-ingest, optionally -N (streams-2)")
            if name in self.procs and self.procs[name].poll() is None:
                raise RuntimeError(f"rlpulse {name} is already running (pid {self.procs[name].pid})")
            env = {**settings_env(self.settings), **(extra_env or {})}
            if command == "streams":
                env["BROKER_CLIENT_ID"] = f"rlpulse-{name}"  # a Faust setting read from the environment
            # Settings (passwords included) travel in the environment, which only the owner can
            # read (/proc/PID/environ), never in argv, which `ps` shows every user.
            with open(private_file(self.log_dir / f"{name}.log"), "ab") as log:
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "rlpulse.cli", command], env=env,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True, umask=PRIVATE_UMASK,
                )

    def running(self, command: str) -> list[str]:
        """Names of this pipeline's processes of ``command`` (``streams``, ``sink`` or ``otlp-ingest``)."""
        return [name for name in self.procs if command_of(name) == command]

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"rlpulse {name} exited with {proc.returncode}; see {self.log_dir / (name + '.log')}")

    def stop(self, which: tuple[str, ...] | None = None, sig: int = signal.SIGTERM, timeout: float = 60.0) -> None:
        """Stop processes (all by default): ``sig``, then SIGKILL after ``timeout`` seconds.
        ``sig=signal.SIGKILL`` is a crash: nothing is flushed or committed, the group finds out
        only when the member's session times out."""
        for name in which or tuple(self.procs):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def wait_caught_up(self, closes_at_ns: int = 0, timeout: float = 180.0, progress=lambda line: None,
                       until: Callable[[], bool] | None = None) -> None:
        """Wait until every window that closes by ``closes_at_ns`` is emitted and everything is in ClickHouse.

        Caught up means: the wall clock is past ``closes_at_ns`` plus a second and a half; the
        streams have committed every raw topic and the sink every topic it reads; and the runs'
        windows are closed, which is known one of two ways:

        * ``until``: the condition the caller waits for, e.g. "the expected rows are in ClickHouse"
          (read through ``rlpulse.sinks.store.clickhouse.open_reader`` while the sink holds a chDB store). It is
          asked once both groups are at lag 0 and must hold twice in a row, half a second apart.
        * Without it (``rlpulse demo``, which cannot know its rows in advance): the streams stay at
          lag 0 long enough that a run gone idle was closed by the wall clock (twice the allowed
          lateness, plus two seconds for the tick and the commit), then the sink commits
          everything twice in a row, half a second apart.

        A run that ended (RUN_END from each writer, everything it numbered applied) is closed as
        soon as its last message is processed; the idle wait is only for runs that just stop.
        """
        deadline = time.monotonic() + timeout
        idle_wait = max(2 * self.settings.allowed_lateness, 1.0) + 2.0
        settled = 0
        streams_done_since: float | None = None
        last = None
        while time.monotonic() < deadline:
            self.check_alive()
            if time.time_ns() >= closes_at_ns + 1_500_000_000:
                # only the processes this pipeline runs: a sink alone need not wait for streams
                streams_lag = sink_lag = 0
                if self.running("otlp-ingest"):  # its outputs are the streams' and the sink's inputs
                    streams_lag += sum(lag(self.settings, ingest_group(self.settings), OTLP_TOPICS).values())
                if self.running("streams"):
                    streams_lag += sum(lag(self.settings, self.settings.app_id, STREAMS_TOPICS).values())
                if self.running("sink"):
                    sink_lag = sum(lag(self.settings, self.settings.sink_group, sink_topics(self.settings.sink_raw)).values())
                state = (streams_lag, sink_lag)
                if state != last:
                    progress(f"waiting: streams lag {streams_lag}, sink lag {sink_lag}")
                    last = state
                if streams_lag:
                    streams_done_since = None
                elif streams_done_since is None:
                    streams_done_since = time.monotonic()
                if until is not None:
                    closed = streams_lag == 0 and sink_lag == 0 and until()
                else:
                    closed = not self.running("streams") or (
                        streams_done_since is not None and time.monotonic() - streams_done_since >= idle_wait)
                settled = settled + 1 if streams_lag == 0 and sink_lag == 0 and closed else 0
                if settled >= 2:
                    return
            time.sleep(0.5)
        what = "and the condition waited for never held " if until is not None else ""
        raise TimeoutError(f"pipeline did not catch up {what}in {timeout:.0f}s; logs in {self.log_dir}")

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def describe_group_async(settings: Settings, group: str) -> tuple[str, dict[str, list[TopicPartition]]]:
    """``group``'s state (``Stable``, ``PreparingRebalance``, ..., ``Unknown`` while its coordinator
    is not elected) and its members: ``client_id/member_id`` -> the partitions assigned to it."""
    admin = AIOKafkaAdminClient(**settings.kafka_client_kwargs())
    await admin.start()
    try:
        described = await admin.describe_consumer_groups([group])
    except KafkaError:  # coordinator not elected yet, offsets topic still being created
        return "Unknown", {}
    finally:
        await admin.close()
    for response in described:
        for g in response.groups:
            # (error_code, group_id, state, protocol_type, protocol, members, ...); a member is
            # (member_id, client_id, client_host, metadata, assignment) in DescribeGroups v0-v2
            if g[1] != group:
                continue
            members = {}
            for member_id, client_id, _host, _meta, assignment in g[5]:
                tps = []
                if assignment:  # empty while the group rebalances
                    decoded = ConsumerProtocolMemberAssignment.decode(assignment)
                    tps = sorted(TopicPartition(t, p) for t, ps in decoded.assignment for p in ps)
                members[f"{client_id}/{member_id}"] = tps
            return g[2], members
    return "Unknown", {}


def members(settings: Settings, group: str) -> dict[str, list[TopicPartition]]:
    """The members of ``group`` (``client_id/member_id``) and their partitions; {} unless it is stable."""
    state, found = asyncio.run(describe_group_async(settings, group))
    return found if state == "Stable" else {}


async def group_ready_async(settings: Settings, group: str, size: int | None = None) -> bool:
    """True when ``group`` is a stable consumer group with at least one member (exactly ``size`` if given)."""
    state, found = await describe_group_async(settings, group)
    return state == "Stable" and (len(found) > 0 if size is None else len(found) == size)


def wait_groups_ready(settings: Settings, groups: tuple[str, ...], pipeline: Pipeline | None = None,
                      timeout: float = 120.0, size: int | None = None) -> None:
    """Wait until every group is stable (with exactly ``size`` members, if given)."""
    deadline = time.monotonic() + timeout
    pending = list(groups)
    while pending:
        if pipeline is not None:
            pipeline.check_alive()
        pending = [g for g in pending if not asyncio.run(group_ready_async(settings, g, size))]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"consumer groups not ready after {timeout:.0f}s: {', '.join(pending)}"
                               + (f" (waiting for {size} members)" if size is not None else ""))
        time.sleep(0.5)
