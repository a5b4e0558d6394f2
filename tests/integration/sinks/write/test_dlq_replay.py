"""``rlpulse dlq replay`` puts dead letters back once their cause is fixed (real broker, real chDB).

The cause here is a sink limit set too low (50 records a message): two containers over it are
dead-lettered beside a piece of garbage. With the limit back at its default, a replay filtered
by reason republishes the two (original bytes and key, to their source topics), the sink writes
them, and the garbage stays where it is; a second replay sends nothing. A replay with no filter
leaves the garbage too: the container decoder refuses it, so the sink would only refuse it again.

Anyone can write to the dead-letter topic: a letter naming a topic that is not one the sink reads
(here one under the pipeline's own prefix) is never sent there: a replay publishes only to the
topics the sink reads, never where a letter's header says.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from rlpulse.pipeline import settings_env
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics, read_topic
from rlpulse.sinks.write.dlq import REASON as REASON_HEADER
from rlpulse.sinks.write.dlq import REPLAY_OF, SOURCE_TOPIC, replay_group
from rlpulse.sinks.write.sink import Limits
# Siblings by their own names: pytest puts tests/integration on sys.path (no __init__.py there).
from tests.integration.sinks.write.test_sink_avro import CODEC, PROJECT, RUN, publish, run_sink, span, step
from tests.integration.sinks.write.test_sink_faults import offsets, plain_counts

pytestmark = pytest.mark.integration
REASON = "over the sink's limit"


def rlpulse(settings: Settings, *args: str) -> str:
    run = subprocess.run([sys.executable, "-m", "rlpulse.cli", *args], env=settings_env(settings),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout


def end_offsets(settings: Settings, short: str) -> int:
    return sum(offsets(settings, shorts=(short,))[0].values())


@pytest.mark.full  # a sink run of ~8 s: make test-all (make test keeps the replay's refusal of foreign topics)
def test_replay_republishes_what_matches_once_and_the_sink_writes_it(settings: Settings) -> None:
    ensure_topics(settings)
    big_spans = CODEC.encode("Span", [span(100 + i) for i in range(60)])
    big_steps = CODEC.encode("Step", [step(100 + i) for i in range(60)])
    publish(settings, [("spans", CODEC.encode("Span", [span(i) for i in range(10)])), ("spans", big_spans),
                       ("spans", b"garbage, not Avro"), ("steps", big_steps),
                       ("steps", CODEC.encode("Step", [step(i) for i in range(5)]))])
    stats = run_sink(settings, limits=Limits(max_message_records=50))
    assert stats.dead_letters == 3 and stats.rows == {"spans": 10, "steps": 5}
    letters = asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic("dlq")))
    garbage_at = next(m.offset for m in letters if m.value == b"garbage, not Avro")

    # The limit is back at its default (the cause is fixed); replay what it refused, spans first.
    out = rlpulse(settings, "dlq", "replay", "--reason", REASON, "--topic", "spans", "--dry-run")
    assert "would replay 1 dead letters" in out and end_offsets(settings, "spans") == 3
    out = rlpulse(settings, "dlq", "replay", "--reason", REASON, "--topic", "spans")
    assert "replayed 1 dead letters; skipped 0 replayed before, 2 not matching the filters" in out
    out = rlpulse(settings, "dlq", "replay", "--reason", REASON.upper())
    assert "replayed 1 dead letters; skipped 1 replayed before, 1 not matching the filters" in out
    out = rlpulse(settings, "dlq", "replay", "--reason", REASON)  # again: nothing twice
    assert "replayed 0 dead letters; skipped 2 replayed before, 1 not matching the filters" in out
    assert end_offsets(settings, "spans") == 4 and end_offsets(settings, "steps") == 3

    # The original bytes and key, marked with the letter they came from.
    [again] = [m for m in asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic("spans")))
               if m.offset == 3]
    assert again.value == big_spans and again.key == f"{PROJECT}/{RUN}".encode()
    assert dict(again.headers)[REPLAY_OF].startswith(settings.topic("dlq").encode() + b"[0]@")
    # The replayer's group waits at the first letter not replayed: the garbage.
    _, committed = offsets(settings, replay_group(settings), ("dlq",))
    assert list(committed.values()) == [garbage_at]
    listing = rlpulse(settings, "dlq")
    assert listing.count(f"{settings.topic('spans')}[") >= 2 and listing.count(f"{settings.topic('steps')}[") >= 2

    stats = run_sink(settings)  # default limits
    assert stats.dead_letters == 0 and stats.rows == {"spans": 60, "steps": 60}
    found = plain_counts(settings)
    assert (found["spans"], found["steps"]) == (70, 65)  # events sent, once each
    assert end_offsets(settings, "dlq") == 3

    out = rlpulse(settings, "dlq", "replay")  # no filters: the garbage stays (the decoder refuses it)
    assert "replayed 0 dead letters; skipped 2 replayed before, 0 not matching the filters" in out
    assert "1 the container decoder still refuses" in out
    _, committed = offsets(settings, replay_group(settings), ("dlq",))
    assert list(committed.values()) == [garbage_at]


async def forge_letter(settings: Settings, source: str, value: bytes) -> None:
    """What a hostile writer can do: a dead letter of its own, naming any topic."""
    admin = AIOKafkaAdminClient(**settings.kafka_client_kwargs())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(source, 1, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(**settings.kafka_client_kwargs())
    await producer.start()
    try:
        await producer.send_and_wait(settings.topic("dlq"), value=value,
                                     headers=[(SOURCE_TOPIC, source.encode()), (REASON_HEADER, b"forged")])
    finally:
        await producer.stop()


def test_replay_sends_only_to_the_pipelines_own_topics(settings: Settings) -> None:
    ensure_topics(settings)
    victim = settings.topic("victim")  # the pipeline's prefix, but no topic the sink reads
    valid = CODEC.encode("Span", [span(i) for i in range(3)])  # a letter the decoder accepts
    asyncio.run(forge_letter(settings, victim, valid))
    out = rlpulse(settings, "dlq", "replay")
    assert "replayed 0 dead letters" in out and "1 naming a topic that is not the pipeline's" in out
    assert end_offsets(settings, "victim") == 0 and end_offsets(settings, "spans") == 0
