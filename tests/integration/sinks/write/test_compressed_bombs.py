"""Compression bombs in every Kafka codec against the real ``rlpulse sink`` and ``rlpulse streams`` (issue 33).

Between two good training runs published by the SDK, a raw aiokafka producer (``max_request_size``
128 MiB, so it sends what the broker takes) writes record batches whose one value is 96 MiB of
zeros, compressed with gzip (98 KB on the wire), snappy (4.7 MB: the steps and spans topics here
take 16 MiB a message, as a topic whose ``max.message.bytes`` was raised does; 1 MiB would hold no
snappy batch over the bound, snappy inflating 21-fold at most), lz4 (420 KB) and zstd (3 KB), and
one zstd batch of three 32 MiB values. Before the bound, aiokafka inflated each whole in the sink
and in the streams before any check of ours (each process peaked 192 MiB higher per 96 MiB value).

Now each batch is one dead letter (its topic, partition and last offset, the reason naming its codec
and its offsets), the streams skip and log each, the good runs before and after are counted exactly
in ClickHouse and in the figures, neither process restarted, and the peak RSS of each (VmHWM, reset
before the bombs) grew by less than 32 MiB while they read the bombs: less than one third of one
bomb's value, which a process that had inflated any of them would have held at least once.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from rlpulse.base.settings import Settings
from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.producers import TrainingTelemetry
from rlpulse.schemas.catalogue import DLQ_TOPIC
from rlpulse.schemas.topics import ensure_topics, read_topic
from rlpulse.sinks.write.dlq import REASON, SOURCE_OFFSET, SOURCE_PARTITION, SOURCE_TOPIC
from tests.integration import until

pytestmark = [pytest.mark.integration, pytest.mark.full]  # ~1 min of bombs: make test-all

GOOD = "bomb-good"
BOMB = 96 << 20
CODECS = ("gzip", "snappy", "lz4", "zstd")
GROWTH_BOUND = 32 << 20  # see the module's docstring


def publish_run(settings: Settings, run: str) -> None:
    """One good run: one step, two rollouts graded by the judge (one ok, one timeout)."""
    with TrainingTelemetry(project=GOOD, run_id=run, attempt=1, trainer="rl", settings=settings) as tel:
        for rollout, outcome in (("g0", "ok"), ("g1", "timeout")):
            tel.grader(step=0, rollout_id=rollout, term="judge", outcome=outcome, duration_s=0.5,
                       score=0.9 if outcome == "ok" else None)
            tel.rollout(step=0, rollout_id=rollout, reward=0.5, term_shares={"judge": 1.0}, completion_tokens=10,
                        max_tokens=100)
        tel.step_completed(step=0, tokens=100, duration_s=1.0)
        assert tel.flush(30) == 0


def landed(settings: Settings, runs: int) -> dict[str, int]:
    return {f"SELECT count() FROM $db.spans FINAL WHERE project = '{GOOD}'": 4 * runs,
            f"SELECT count() FROM $db.steps FINAL WHERE project = '{GOOD}'": 3 * runs,
            f"SELECT sum(graded) FROM $db.grader_failures FINAL WHERE project = '{GOOD}' AND cause = 'timeout'": 2 * runs}


async def _raise_message_cap(settings: Settings, shorts: tuple[str, ...], cap: int) -> None:
    admin = AIOKafkaAdminClient(**settings.kafka_client_kwargs())
    await admin.start()
    try:
        await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, settings.topic(s),
                                                  configs={"max.message.bytes": str(cap)}) for s in shorts])
    finally:
        await admin.close()


async def _produce_bombs(settings: Settings) -> list[dict]:
    """Each bomb batch: codec, topic, partition, its offsets."""
    sent = []
    for codec in (*CODECS, "zstd x3"):
        name, _, many = codec.partition(" ")
        producer = AIOKafkaProducer(compression_type=name, max_request_size=128 << 20, max_batch_size=128 << 20,
                                    linger_ms=200, **settings.kafka_client_kwargs())
        await producer.start()
        try:
            if many:  # three values sent together, one batch
                topic, values = settings.topic("spans"), [bytes(32 << 20)] * 3
            else:
                topic, values = settings.topic("steps"), [bytes(BOMB)]
            futures = [await producer.send(topic, key=b"p/r", value=v) for v in values]
            metas = [await f for f in futures]
        finally:
            await producer.stop()
        assert len({m.partition for m in metas}) == 1
        sent.append({"codec": name, "topic": topic, "partition": metas[0].partition,
                     "offsets": [m.offset for m in metas]})
    return sent


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _skips(settings: Settings) -> list[str]:
    text = (settings.home / "logs" / "streams.log").read_text()
    return [line for line in text.splitlines() if "skipping undecodable message" in line]


@pytest.fixture(scope="module")
def ran(module_settings: Settings) -> Iterator[dict]:
    settings = module_settings
    ensure_topics(settings)
    asyncio.run(_raise_message_cap(settings, ("spans", "steps"), 16 << 20))
    pipeline = Pipeline(settings)
    try:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        publish_run(settings, "before")
        pipeline.wait_caught_up(until=until.counts(settings, landed(settings, 1)))
        pids = {name: pipeline.procs[name].pid for name in ("sink", "streams")}
        resident = {}
        for name, pid in pids.items():  # from here, VmHWM is the peak since this moment
            Path(f"/proc/{pid}/clear_refs").write_text("5")
            resident[name] = _status(pid, "VmRSS:")
        bombs = asyncio.run(_produce_bombs(settings))
        deadline = time.monotonic() + 120
        while True:
            pipeline.check_alive()
            letters = asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic(DLQ_TOPIC)))
            if len(letters) >= len(bombs) and len(_skips(settings)) >= len(bombs) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        grown = {name: _status(pid, "VmHWM:") - resident[name] for name, pid in pids.items()}
        publish_run(settings, "after")
        pipeline.wait_caught_up(until=until.counts(settings, landed(settings, 2)))
        pipeline.check_alive()  # neither process exited on the way
        answers = {sql: until.query(settings, sql) for sql in QUERIES.values()}
        pipeline.stop()
        letters = asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic(DLQ_TOPIC)))
        yield {"settings": settings, "bombs": bombs, "letters": letters, "grown": grown, "answers": answers}
    finally:
        pipeline.stop()


QUERIES = {
    "spans": f"SELECT run_id, count() FROM $db.spans FINAL WHERE project = '{GOOD}' GROUP BY run_id ORDER BY run_id",
    "steps": f"SELECT run_id, count() FROM $db.steps FINAL WHERE project = '{GOOD}' GROUP BY run_id ORDER BY run_id",
    "failures": f"SELECT run_id, sum(failures), sum(graded) FROM $db.grader_failures FINAL WHERE project = '{GOOD}' "
                "AND cause = 'timeout' GROUP BY run_id ORDER BY run_id",
    "step_stats": f"SELECT run_id, count() FROM $db.step_stats FINAL WHERE project = '{GOOD}' GROUP BY run_id ORDER BY run_id",
}


def _where(bomb: dict) -> str:
    first, last = bomb["offsets"][0], bomb["offsets"][-1]
    return f"offset {last}, 1 record" if first == last else f"offsets {first}-{last}, {len(bomb['offsets'])} records"


def test_each_bomb_batch_is_one_dead_letter_at_its_offset_with_its_codec(ran) -> None:
    letters = [{k: v.decode() for k, v in m.headers} | {"size": len(m.value or b"")} for m in ran["letters"]]
    assert len(letters) == len(ran["bombs"]), [h[REASON] for h in letters]
    by_place = {(h[SOURCE_TOPIC], int(h[SOURCE_PARTITION]), int(h[SOURCE_OFFSET])): h for h in letters}
    for bomb in ran["bombs"]:
        letter = by_place[(bomb["topic"], bomb["partition"], bomb["offsets"][-1])]  # the batch's last offset
        reason = letter[REASON]
        assert reason.startswith(f"compressed batch over the decompression bound: {bomb['codec']}, "), reason
        assert reason.endswith(_where(bomb)), reason
        assert letter["size"] < 4096  # the stand-in, never the bomb


def test_every_good_event_is_counted_exactly(ran) -> None:
    answers = ran["answers"]
    assert answers[QUERIES["spans"]] == [("after", 4), ("before", 4)]  # 2 graders + 2 rollouts each
    assert answers[QUERIES["steps"]] == [("after", 3), ("before", 3)]  # RUN_START, the step, RUN_END
    assert answers[QUERIES["failures"]] == [("after", 1, 2), ("before", 1, 2)]
    assert answers[QUERIES["step_stats"]] == [("after", 1), ("before", 1)]


def test_the_streams_skip_each_bomb_with_its_reason_and_nothing_restarted(ran) -> None:
    settings = ran["settings"]
    skips = _skips(settings)
    assert len(skips) == len(ran["bombs"]), skips
    for bomb in ran["bombs"]:
        place = re.escape(f"{bomb['topic']}[{bomb['partition']}]@{bomb['offsets'][-1]}: compressed batch over the "
                          f"decompression bound: {bomb['codec']}, ")
        assert any(re.search(place, line) for line in skips), (bomb, skips)
    logs = settings.home / "logs"
    sink = (logs / "sink.log").read_text()
    assert sink.count("sink consuming") == 1 and sink.count("dead letter from") == len(ran["bombs"])
    assert "Traceback" not in sink + (logs / "streams.log").read_text()


def test_the_peak_rss_of_the_sink_and_the_streams_stays_bounded(ran) -> None:
    grown = ran["grown"]
    print({name: f"{n / (1 << 20):.1f} MiB" for name, n in grown.items()})
    assert all(n < GROWTH_BOUND for n in grown.values()), grown


def test_a_replay_leaves_the_bombs_letters_in_place(ran) -> None:
    """A letter's value is the stand-in, which no other process takes for a refusal: the container
    decoder refuses it as it refuses any bytes that are not a container, so nothing is replayed."""
    from rlpulse.sinks.write.dlq import replay_dead_letters

    report = asyncio.run(replay_dead_letters(ran["settings"], dry_run=True))
    assert (report.refused, report.replayed) == (len(ran["bombs"]), [])
