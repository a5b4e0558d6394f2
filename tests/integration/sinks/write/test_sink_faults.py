"""At-least-once into ClickHouse, exactly once after dedup: a sink killed with SIGKILL in the
middle of a checkpoint (some of its tables inserted, the others not, no offset committed), and a
full replay of every offset, leave every saved query's answer unchanged and exactly one row per
event sent in a plain ``SELECT count()`` after ``OPTIMIZE TABLE … FINAL``; a row ClickHouse
rejects is isolated, dead-lettered with ClickHouse's reason, and the rest lands.

Containers are produced directly (codec + aiokafka) for every table the saved queries read,
and ``rlpulse sink`` runs as a child process, as a user runs it. The helpers here (start a sink,
read a group's offsets, count rows) serve the other sink fault tests too.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from rlpulse.pipeline import settings_env
from rlpulse.base.settings import Settings
from rlpulse.schemas.catalogue import SINK_TOPICS, TABLES
from rlpulse.base.faults import Faults
from rlpulse.schemas.topics import ensure_topics, topics_partitions
from rlpulse.sinks.store.clickhouse import open_store
from rlpulse.sinks.write.dlq import read_dead_letters
# The sibling module by its own name: pytest puts tests/integration on sys.path (no __init__.py there).
from tests.integration.sinks.write.test_sink_avro import (CODEC, NOW, PROJECT, RUN, TOPIC_OF, counts, ident, publish, rows,
                                                         run_sink, samples, span, step)

pytestmark = [pytest.mark.integration, pytest.mark.full]  # faults: make test-all


# -- helpers for tests that run `rlpulse sink` as a child process ------------------------------------
def start_sink(settings: Settings, log: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``rlpulse sink ARGS`` with these settings (plus ``env``: fault hooks), its output appended to ``log``."""
    out = open(log, "ab")
    try:
        return subprocess.Popen([sys.executable, "-m", "rlpulse.cli", "sink", *args],
                                env={**settings_env(settings), **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        out.close()


async def _offsets(settings: Settings, group: str, shorts: tuple[str, ...]) -> tuple[dict, dict]:
    kafka = settings.kafka_client_kwargs()
    consumer, admin = AIOKafkaConsumer(**kafka), AIOKafkaAdminClient(**kafka)
    await consumer.start()
    await admin.start()
    try:
        tps = await topics_partitions(consumer, [settings.topic(s) for s in shorts])
        end = await consumer.end_offsets(tps)
        committed = await admin.list_consumer_group_offsets(group)
        return dict(end), {tp: max(committed[tp].offset, 0) if tp in committed else 0 for tp in tps}
    finally:
        await admin.close()
        await consumer.stop()


def offsets(settings: Settings, group: str | None = None,
            shorts: tuple[str, ...] = SINK_TOPICS) -> tuple[dict[TopicPartition, int], dict[TopicPartition, int]]:
    """End offsets of the topics, and the group's committed offsets on them (0 where none): the sink's by default."""
    return asyncio.run(_offsets(settings, group or settings.sink_group, shorts))


def wait_committed(settings: Settings, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> float:
    """Wait until the sink group has committed every sink topic to its end; returns the seconds waited."""
    started = time.monotonic()
    while True:
        end, committed = offsets(settings)
        if committed == end:
            return time.monotonic() - started
        if proc.poll() is not None:
            raise AssertionError(f"rlpulse sink exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() - started > timeout:
            raise AssertionError(f"sink did not commit everything in {timeout:.0f}s:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)


def stop_sink(proc: subprocess.Popen, timeout: float = 60.0) -> tuple[int, float]:
    """SIGTERM; returns the exit code and the seconds the sink took to exit."""
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout)
    return code, time.monotonic() - started


def plain_counts(settings: Settings, optimize: bool = False) -> dict[str, int]:
    """``SELECT count()`` of every table, after ``OPTIMIZE TABLE … FINAL`` (the merge that dedups) when asked."""
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        if optimize:
            for table in TABLES.values():
                store.client.command(f"OPTIMIZE TABLE {store.database}.{table} FINAL")
        return counts(store, final=False)


def dead_letter_count(settings: Settings) -> int:
    end, _ = offsets(settings, shorts=("dlq",))
    return sum(end.values())


SAVED = {
    "stalled-runs": [],
    "failures-by-cause": ["since=2020-01-01 00:00:00", "until=2100-01-01 00:00:00"],
    "reward-percentiles": [f"run_id={RUN}", "attempt=1"],
    "clipped-ratio-trend": [f"run_id={RUN}", "attempt=1"],
    "gpu-utilization-by-run": [f"run_id={RUN}"],
    "span-tree": [f"run_id={RUN}", "attempt=1", "rollout_id=s1-r3"],
}


def workload() -> list[tuple[str, bytes]]:
    """Several messages per table, over two run keys, so a checkpoint holds many inserts."""
    data = samples()
    messages = [(TOPIC_OF[name], CODEC.encode(name, records)) for name, records in data.items()
                if name not in ("StepStats", "RewardHistogram")]  # those come per step below
    for s in range(1, 4):  # three steps of figures, histograms and a span tree of rollout s1-r3
        messages.append(("step-stats", CODEC.encode("StepStats", [dict(data["StepStats"][0], step=s, clipped=s,
                                                                       clipped_ratio=s / 4)])))
        messages.append(("reward-histograms", CODEC.encode("RewardHistogram", [dict(
            data["RewardHistogram"][0], step=s, bucket_counts=[s, 2, 1, 0], count=s + 3)])))
        messages.append(
            (
                "spans",
                CODEC.encode(
                    "Span", [span(10 * s + i, parent_span_id=(10 * s).to_bytes(8, "big") if i else None) for i in range(3)]
                ),
            )
        )
        messages.append(("steps", CODEC.encode("Step", [step(100 + s)])))
    for minute in range(3):
        messages.append(
            (
                "grader-failures",
                CODEC.encode(
                    "GraderFailureWindow",
                    [
                        ident(
                            term="judge",
                            cause=cause,
                            window_start_ns=NOW - (minute + 2) * 60 * 10**9,
                            window_end_ns=NOW - (minute + 1) * 60 * 10**9,
                            failures=minute + 1,
                            graded=10,
                            emitted_at_ns=NOW,
                        )
                        for cause in ("timeout", "unreadable")
                    ],
                ),
            )
        )
        messages.append(
            (
                "hardware",
                CODEC.encode(
                    "GpuSample",
                    [dict(data["GpuSample"][0], time_ns=NOW + (minute + 1) * 10**9, gpu_utilization=0.5 + minute / 10)],
                ),
            )
        )
    return messages


def saved_answers(settings: Settings) -> dict:
    answers = {}
    for name, params in SAVED.items():
        args = [a for p in params for a in ("--param", p)]
        run = subprocess.run(
            [sys.executable, "-m", "rlpulse.cli", "query", "--saved", name, "--format", "json", *args],
            env=settings_env(settings),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr
        answers[name] = json.loads(run.stdout)
    return answers


def killed_mid_checkpoint_then_restarted(settings: Settings, log: Path, expected: dict[str, int], fresh: bool) -> float:
    """``rlpulse sink`` dies by SIGKILL after the 3rd insert of its first checkpoint; a second one takes over.

    All messages are on the topics before the sink starts and a checkpoint is due 3 s after its
    first message, so the first checkpoint holds every message: one insert per table, ten tables.
    """
    proc = start_sink(settings, log, "--flush-interval", "3", env=Faults(kill_after_inserts=3).env())
    assert proc.wait(120) == -signal.SIGKILL, log.read_text()[-3000:]
    # Mid-batch: three tables hold rows, the other seven none, and not one offset is committed.
    end, committed = offsets(settings)
    assert set(committed.values()) == {0} and sum(end.values()) == len(workload())
    found = plain_counts(settings)
    if fresh:  # into an empty store (a replay's inserts carry the tokens of the first run: nothing changes)
        inserted = {t for t, n in found.items() if n}
        assert len(inserted) == 3 and all(found[t] == expected[t] for t in inserted), found
    else:
        assert found == expected
    proc = start_sink(settings, log, "--flush-interval", "3")
    took = wait_committed(settings, proc, log)  # start, migrations, a 3 s checkpoint, commit
    assert stop_sink(proc)[0] == 0
    return took


def test_sigkill_mid_checkpoint_and_a_replay_lose_and_double_nothing(settings: Settings, rewind_sink, tmp_path) -> None:
    ensure_topics(settings)
    messages = workload()
    publish(settings, messages[::2], key=f"{PROJECT}/{RUN}")
    publish(settings, messages[1::2], key=f"{PROJECT}/other-run")  # the other partition, most likely
    expected = {table: 0 for table in TABLES.values()}
    for _, value in messages:  # every event has its own natural key here
        decoded = CODEC.decode(value)
        expected[TABLES[decoded.name]] += len(decoded.records)
    sent = sum(expected.values())
    log = tmp_path / "sink.log"

    recovered = killed_mid_checkpoint_then_restarted(settings, log, expected, fresh=True)
    print(f"SIGKILL mid-checkpoint: {sent} events sent; the restarted sink committed everything in {recovered:.1f}s")
    # The restarted sink cut its checkpoint at the same offsets, so the three tables' second
    # inserts carried the same dedup tokens and were dropped: exact even before any merge.
    assert plain_counts(settings) == expected
    first = saved_answers(settings)
    assert plain_counts(settings, optimize=True) == expected and sum(plain_counts(settings).values()) == sent == 38
    assert len(first["reward-percentiles"]) == 3 and len(first["clipped-ratio-trend"]) == 3
    assert len(first["gpu-utilization-by-run"]) == 1 and len(first["span-tree"]) == 11
    assert [row["key"] for row in first["stalled-runs"]] == [f"{RUN}/1"]
    assert {(r["cause"], r["failures"], r["graded"]) for r in first["failures-by-cause"]} >= {
        ("timeout", 9, 40),
        ("unreadable", 6, 30),
    }

    rewind_sink()  # every offset again, and again killed in the middle of the checkpoint
    killed_mid_checkpoint_then_restarted(settings, log, expected, fresh=False)
    assert saved_answers(settings) == first
    assert plain_counts(settings, optimize=True) == expected  # one row per event sent, in a plain count()
    assert dead_letter_count(settings) == 0
    assert "dead letter from" not in log.read_text()


def test_a_row_clickhouse_rejects_is_dead_lettered_alone_and_the_rest_lands(settings: Settings) -> None:
    """A Step with attempt -1 is valid Avro but does not fit the UInt32 column: its message alone goes to the DLQ."""
    ensure_topics(settings)
    good = [("steps", CODEC.encode("Step", [step(10 * m + i) for i in range(5)])) for m in range(7)]
    bad = ("steps", CODEC.encode("Step", [step(100), dict(step(101), attempt=-1)]))
    publish(settings, good[:4] + [bad] + good[4:])
    stats = run_sink(settings)
    assert stats.dead_letters == 1 and stats.rows == {"steps": 35}
    letters = asyncio.run(read_dead_letters(settings.kafka_client_kwargs(), settings.topic("dlq")))
    assert len(letters) == 1 and letters[0]["source"].endswith("@4")
    assert "ClickHouse rejected the steps rows" in letters[0]["reason"] and "UInt32" in letters[0]["reason"]
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        got = [r["sequence_id"] for r in rows(store, "steps", "sequence_id")]
    assert got == [10 * m + i for m in range(7) for i in range(5)]
