"""``rlpulse status`` prints one line per consumer group: its total lag, partitions, topics and
members, naming the topics it is behind on; ``--detail`` (or ``-v``) adds a line per partition,
``topic[partition]  committed / end = lag``.

After a workload through the pipeline both groups (streams, sink) are at lag 0 with their members;
with the pipeline stopped and messages published to chosen partitions, each group's line names
exactly the topics behind and their lag, and each partition's line exactly the messages published
to it.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import pytest
from aiokafka import AIOKafkaProducer

from rlpulse.base.settings import Settings
from rlpulse.pipeline import STREAMS_TOPICS, Pipeline, describe_group_async, settings_env, wait_groups_ready
from rlpulse.producers.simulators.simulator import SimConfig, simulate
from rlpulse.schemas.catalogue import SINK_TOPICS
from rlpulse.schemas.topics import ensure_topics
from tests.integration import until

# `rlpulse status` is an operator's command, one test of ~15 s: make test-all, keeping make test within 6 minutes
pytestmark = [pytest.mark.integration, pytest.mark.full]
LINE = re.compile(r"^  (\S+)\[(\d+)\]\s+(\d+) /\s+(\d+) = (\d+)$")


def status(settings: Settings, *flags: str) -> list[str]:
    """``rlpulse status``'s lines after the services' (from the first consumer group line on)."""
    # the home whose broker runs (`rlpulse status` exits 3 when its home's broker is not running)
    env = {**settings_env(settings), "RLPULSE_HOME": str(Settings.load({}).home)}
    run = subprocess.run([sys.executable, "-m", "rlpulse.cli", "status", *flags], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("consumer group "))
    return lines[first:]


def partitions(lines: list[str]) -> dict[str, dict[tuple[str, int], tuple[int, int, int]]]:
    """--detail's lines parsed: group -> (topic, partition) -> (committed, end, lag); every line is one or the other."""
    groups: dict[str, dict] = {}
    group = ""
    for line in lines:
        if line.startswith("consumer group "):
            group = line.split()[2].rstrip(":")
            groups[group] = {}
        else:
            m = LINE.match(line)
            assert m and group, f"not a partition line: {line!r}"
            groups[group][(m[1], int(m[2]))] = (int(m[3]), int(m[4]), int(m[5]))
    return groups


async def publish(settings: Settings, counts: dict[tuple[str, int], int]) -> None:
    producer = AIOKafkaProducer(**settings.kafka_client_kwargs())
    await producer.start()
    try:
        for (short, partition), n in counts.items():
            for _ in range(n):
                await producer.send_and_wait(settings.topic(short), b"offsets only", partition=partition)
    finally:
        await producer.stop()


def wait_empty(settings: Settings, groups: tuple[str, ...], timeout: float = 60.0) -> None:
    """Until the stopped members have left the groups (state Empty), so the member count is settled."""
    deadline = time.monotonic() + timeout
    while any(asyncio.run(describe_group_async(settings, g))[0] != "Empty" for g in groups):
        assert time.monotonic() < deadline, f"groups not empty after {timeout:.0f}s: {groups}"
        time.sleep(0.5)


def test_status_sums_up_each_group_and_detail_lists_its_partitions(settings: Settings, backend: dict[str, str]) -> None:
    if backend["name"] != "local":
        pytest.skip("rlpulse status exits 3 unless its home's own broker serves the bootstrap address")
    streams, sink, t = settings.app_id, settings.sink_group, settings.topic
    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (streams, sink), pipeline)
        simulate(settings, SimConfig(runs=3, steps=2, gpu=True))
        # the runs ended: every step's figures are emitted, and the sink has them, at lag 0
        pipeline.wait_caught_up(until=until.counts(settings, {"step_stats": 3 * 2}))
        summary = status(settings)
        detail = status(settings, "--detail")
        verbose = status(settings, "-v")
        pipeline.stop()

    # one line per group (no alerts or Kafka-engine group exists here): 2 lines where a line per
    # partition made 2 + 26
    assert summary == [f"consumer group {streams}: lag 0, 6 partitions (3 topics), 1 member",
                       f"consumer group {sink}: lag 0, 20 partitions (10 topics), 1 member"]
    assert verbose == detail
    assert [line for line in detail if line.startswith("consumer group ")] == summary
    caught_up = partitions(detail)
    expected_rows = {streams: STREAMS_TOPICS, sink: SINK_TOPICS}
    assert list(caught_up) == list(expected_rows)
    for group, topics in expected_rows.items():
        rows = caught_up[group]
        assert list(rows) == [(t(short), p) for short in topics for p in (0, 1)], group  # topic order, then partition
        for (topic, partition), (committed, end, lag) in rows.items():
            assert committed == end and lag == 0, (group, topic, partition)
        assert all(rows[(t(short), p)][1] > 0 for short in ("spans", "steps") for p in (0, 1)), rows

    wait_empty(settings, (streams, sink))
    published = {("spans", 0): 3, ("spans", 1): 5, ("steps", 1): 2, ("hardware", 0): 1}
    asyncio.run(publish(settings, published))
    behind = f"behind on {t('spans')} 8, {t('steps')} 2, {t('hardware')} 1"
    assert status(settings) == [f"consumer group {streams}: lag 11, 6 partitions (3 topics), 0 members; {behind}",
                                f"consumer group {sink}: lag 11, 20 partitions (10 topics), 0 members; {behind}"]
    for group, rows in partitions(status(settings, "--detail")).items():
        for (topic, partition), (committed, end, lag) in rows.items():
            n = published.get((topic.removeprefix(settings.topic_prefix + "."), partition), 0)
            before = caught_up[group][(topic, partition)]
            assert (committed, end, lag) == (before[0], before[1] + n, n), (group, topic, partition)
