"""A three-broker Kafka cluster: one broker SIGKILLed while training jobs publish, then
brought back, and ClickHouse still exactly the truth.

The cluster is the test's own (``own_cluster``: three KRaft nodes of ``rlpulse services up
--brokers 3`` on free ports, never the shared broker). Its topics have three copies and
``min.insync.replicas=2``, so with one broker down the SDK's ``acks=all`` sends still succeed:
nothing is dropped, nothing is lost, nothing is counted twice. The broker killed is the one that
coordinates the most of the pipeline's consumer groups (ties: the one leading the most partitions):
the streams and the sink lose their group coordinator, and the SDK, the streams and the sink all
see partition leaders move.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import KafkaError

from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from tests.integration.workload import (JUDGE_FAILURE, Job, assert_figures_equal, check_delivery,
                                        emitted_more_than_once, end_offsets, expected, figures_in, read_figures,
                                        run_for, stop_jobs, wait_committed_past)

pytestmark = [pytest.mark.integration, pytest.mark.full]  # a three-broker cluster of its own: make test-all


async def _partitions_async(settings: Settings) -> dict[tuple[str, int], tuple[int, list[int], list[int]]]:
    """(topic, partition) -> (leader, replicas, in-sync replicas) for every topic of the test."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap, request_timeout_ms=5000)
    await admin.start()
    try:
        topics = [t for t in await admin.list_topics() if t.startswith((settings.topic_prefix, settings.app_id))]
        return {(t["topic"], p["partition"]): (p["leader"], sorted(p["replicas"]), sorted(p["isr"]))
                for t in await admin.describe_topics(topics) for p in t["partitions"]}
    finally:
        await admin.close()


def partitions(settings: Settings) -> dict[tuple[str, int], tuple[int, list[int], list[int]]]:
    for _ in range(20):
        try:
            return asyncio.run(_partitions_async(settings))
        except KafkaError:  # the admin client asked the dead broker, still in the metadata it had
            time.sleep(0.2)
    return asyncio.run(_partitions_async(settings))


async def _min_isr_async(settings: Settings, topics: list[str]) -> dict[str, str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        [response] = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, t, {"min.insync.replicas": None}) for t in topics])
        # a broker that has not yet applied a new topic answers it with an error and no entries: asked again
        return {r["resource_name"]: r["config_entries"][0]["config_value"] for r in response.to_object()["resources"]
                if r["error_code"] == 0 and r["config_entries"]}
    finally:
        await admin.close()


async def _coordinators_async(settings: Settings, groups: tuple[str, ...]) -> dict[str, int]:
    client = AIOKafkaClient(bootstrap_servers=settings.kafka_bootstrap)
    await client.bootstrap()
    try:
        return {g: await client.coordinator_lookup(0, g) for g in groups}  # 0: a consumer group
    finally:
        await client.close()


def pick_victim(settings: Settings, groups: tuple[str, ...]) -> tuple[int, Counter, dict[str, int]]:
    """The broker coordinating the most groups (ties: leading the most partitions), the leader
    counts and the groups' coordinators."""
    leaders = Counter(leader for leader, _, _ in partitions(settings).values())
    coordinators = asyncio.run(_coordinators_async(settings, groups))
    coordinating = Counter(coordinators.values())
    victim = max(leaders, key=lambda b: (coordinating[b], leaders[b], -b))
    return victim, leaders, coordinators


def test_one_broker_of_three_sigkilled_and_back_while_jobs_publish(own_cluster, tmp_path) -> None:
    settings = dataclasses.replace(own_cluster.settings, topic_prefix="cluster", home=tmp_path,
                                   clickhouse_url=f"chdb://{tmp_path / 'clickhouse'}", partitions=2, window=10.0,
                                   heartbeat_interval=3600.0)
    created = ensure_topics(settings)
    deadline = time.monotonic() + 30
    while (layout := partitions(settings)).keys() and ({t for t, _ in layout} != set(created)
                                                       or any(leader < 0 for leader, _, _ in layout.values())):
        assert time.monotonic() < deadline, f"topics not all in the metadata with leaders: {sorted(created)}"
        time.sleep(0.5)  # a new topic reaches every broker's metadata a moment after it is created
    assert {(tuple(r), tuple(isr)) for _, r, isr in layout.values()} == {((1, 2, 3), (1, 2, 3))}, \
        "every partition of every topic (Faust's changelogs and the dead letters too) on all three brokers"
    while len(min_isr := asyncio.run(_min_isr_async(settings, created))) < len(created):
        assert time.monotonic() < deadline, f"topic configs not all described: {sorted(set(created) - set(min_isr))}"
        time.sleep(0.5)
    assert set(min_isr.values()) == {"2"}

    jobs = [Job(settings, i) for i in range(len(JUDGE_FAILURE))]
    groups = (settings.app_id, settings.sink_group)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, groups, pipeline)
        for job in jobs:
            job.start()
        run_for(15, pipeline, jobs)

        victim, leaders, coordinators = pick_victim(settings, groups)
        accepted = [j.truth.accepted for j in jobs]  # what the SDKs had taken when the broker died
        own_cluster.kill(victim)
        killed = time.monotonic()
        moved = sdk = None
        while time.monotonic() - killed < 20:  # publishing on, with one broker of three dead
            if moved is None and all(leader not in (victim, -1) for leader, _, _ in partitions(settings).values()):
                moved = round(time.monotonic() - killed, 1)
            if sdk is None and all(j.tel.delivered >= n for j, n in zip(jobs, accepted)):
                sdk = round(time.monotonic() - killed, 1)
            run_for(0.3, pipeline, jobs)
        during = {"dropped": sum(j.tel.dropped for j in jobs), "accepted": sum(j.truth.accepted for j in jobs)}
        isr_during = Counter(len(isr) for _, _, isr in partitions(settings).values())

        restarted = time.monotonic()
        rejoined = round(own_cluster.start(victim), 1)
        in_sync = None
        while in_sync is None or time.monotonic() - restarted < 10:
            if in_sync is None and all(isr == [1, 2, 3] for _, _, isr in partitions(settings).values()):
                in_sync = round(time.monotonic() - restarted, 1)
            assert time.monotonic() - restarted < 120, "the restarted broker was not back in every ISR within 120 s"
            run_for(0.5, pipeline, jobs)
        stop_jobs(jobs)
        caught_up = time.monotonic()
        committed = wait_committed_past(settings, groups, end_offsets(settings), pipeline, caught_up)
        pipeline.wait_caught_up(until=figures_in(settings, expected(jobs, settings)), timeout=240)
        drained = round(time.monotonic() - caught_up, 1)
        pipeline.stop()

    got = read_figures(settings)
    counts = check_delivery(jobs, got)
    print(f"\nkilled broker {victim} (led {leaders[victim]} of {sum(leaders.values())} partitions; leaders "
          f"{dict(sorted(leaders.items()))}; group coordinators {coordinators})")
    print(f"after SIGKILL: every partition led by a live broker in {moved} s; the SDKs had delivered what they held at "
          f"the kill in {sdk} s; during the outage {during}, in-sync replica counts {dict(isr_during)}")
    print(f"after the restart: broker {victim} in the metadata in {rejoined} s, back in every ISR in {in_sync} s")
    print(f"after the jobs stopped: both groups committed to the end in {committed}, windows closed in {drained} s")
    print(f"delivery: {counts}; windows {len(expected(jobs, settings)['windows'])}")
    again = emitted_more_than_once(settings)
    print(f"emitted more than once: {again}")
    assert counts["dropped"] == 0, "with two of three brokers in sync, acks=all sends succeed: nothing dropped"
    assert moved is not None and sdk is not None, f"leaders moved in {moved} s, SDK delivered in {sdk} s (None: not within 20 s)"
    assert isr_during == Counter({2: len(layout)}), "during the outage every partition had two in-sync replicas"
    assert_figures_equal(expected(jobs, settings), got)
    assert again == {"step-stats": [], "grader-windows": []}
