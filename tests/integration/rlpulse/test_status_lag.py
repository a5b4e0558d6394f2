"""``rlpulse status`` prints each consumer group's lag per partition: ``topic[partition]  committed / end = lag``.

After a workload through the pipeline every partition of the streams and sink groups shows lag 0;
with the pipeline stopped and messages published to chosen partitions, each partition's lag is
exactly the number of messages published to it.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import pytest
from aiokafka import AIOKafkaProducer

from rlpulse.producers.simulators.simulator import SimConfig, simulate
from rlpulse.pipeline import STREAMS_TOPICS, Pipeline, settings_env, wait_groups_ready
from rlpulse.base.settings import Settings
from rlpulse.schemas.catalogue import SINK_TOPICS
from rlpulse.schemas.topics import ensure_topics
from tests.integration import until

# `rlpulse status` is an operator's command, one test of ~12 s: make test-all, keeping make test within 6 minutes
# (373 s of it in a fresh clone with this test in)
pytestmark = [pytest.mark.integration, pytest.mark.full]
LINE = re.compile(r"^  (\S+)\[(\d+)\]\s+(\d+) /\s+(\d+) = (\d+)$")


def status(settings: Settings) -> dict[str, dict[tuple[str, int], tuple[int, int, int]]]:
    """``rlpulse status`` parsed: group -> (topic, partition) -> (committed, end, lag)."""
    # the home whose broker runs (`rlpulse status` exits 3 when its home's broker is not running)
    env = {**settings_env(settings), "RLPULSE_HOME": str(Settings.load({}).home)}
    run = subprocess.run([sys.executable, "-m", "rlpulse.cli", "status"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    groups: dict[str, dict] = {}
    group = None
    for line in run.stdout.splitlines():
        if line.startswith("consumer group "):
            group = line.split()[2].rstrip(":")
            groups[group] = {}
        elif (m := LINE.match(line)) and group:
            groups[group][(m[1], int(m[2]))] = (int(m[3]), int(m[4]), int(m[5]))
        else:
            assert group is None, f"unexpected line after the groups: {line!r}"
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


def test_status_prints_each_groups_lag_per_partition(settings: Settings, backend: dict[str, str]) -> None:
    if backend["name"] != "local":
        pytest.skip("rlpulse status exits 3 unless its home's own broker serves the bootstrap address")
    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        simulate(settings, SimConfig(runs=3, steps=2, gpu=True))
        # the runs ended: every step's figures are emitted, and the sink has them, at lag 0
        pipeline.wait_caught_up(until=until.counts(settings, {"step_stats": 3 * 2}))
        caught_up = status(settings)
        pipeline.stop()

    expected_rows = {settings.app_id: STREAMS_TOPICS, settings.sink_group: SINK_TOPICS}
    assert set(caught_up) == set(expected_rows)  # no alerts or Kafka-engine group exists here
    for group, topics in expected_rows.items():
        rows = caught_up[group]
        assert list(rows) == [(settings.topic(t), p) for t in topics for p in (0, 1)], group  # topic order, then partition
        for (topic, partition), (committed, end, lag) in rows.items():
            assert committed == end and lag == 0, (group, topic, partition)
        assert all(rows[(settings.topic(t), p)][1] > 0 for t in ("spans", "steps") for p in (0, 1)), rows

    published = {("spans", 0): 3, ("spans", 1): 5, ("steps", 1): 2, ("hardware", 0): 1}
    asyncio.run(publish(settings, published))
    behind = status(settings)
    for group in (settings.app_id, settings.sink_group):
        for (topic, partition), (committed, end, lag) in behind[group].items():
            n = published.get((topic.removeprefix(settings.topic_prefix + "."), partition), 0)
            assert (committed, end, lag) == (caught_up[group][(topic, partition)][0],
                                             caught_up[group][(topic, partition)][1] + n, n), (group, topic, partition)
