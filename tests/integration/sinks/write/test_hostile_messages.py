"""Hostile messages on the raw topics against the real ``rlpulse sink`` and ``rlpulse streams``.

Between two good training runs published by the SDK, anyone who can write to a raw topic sends (in
parentheses, what each did before these bounds):

* an endless array: a 2.7 KB Span container whose writer schema ends in an extra array of nulls, one
  block claiming 2**62 items (chDB skipped items for centuries, the sink never committed);
* a huge string: a Step container holding a 20 MiB string, gzip-compressed on the wire (its dead
  letter was over the producer's 1 MiB and the sink crash-looped);
* a deflate bomb: a deflate container that inflates to 200 MiB (the streams inflated it whole);
* too many records: 500,000 Span records in one gzip message (the streams applied them all).

Each is refused by both processes with a reason naming the bound (``rlpulse.schemas.limits``): the sink
dead-letters it (the 20 MiB one kept truncated, with its original size and sha256), the streams
count and log it; the good runs before and after land whole, no figure holds a hostile record,
no process restarted, and SIGTERM stops the sink within 10 s.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import signal
import time
from collections.abc import Iterator

import pytest
from aiokafka import AIOKafkaProducer

from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.producers import TrainingTelemetry
from rlpulse.schemas.catalogue import DLQ_TOPIC
from rlpulse.schemas.limits import Limits
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics, read_topic
from rlpulse.sinks.write.dlq import ORIGINAL_SHA256, ORIGINAL_SIZE, REASON, SOURCE_TOPIC, TRUNCATED
from tests.integration import until
from tests.unit.sinks.write.test_bounded_decoder import STEP, container, deflate_bomb, endless_span, many_records, record_bytes

# ~17 s of hostile input (security): make test-all, so make test keeps its 6 minutes (test_sink_avro's dead letters stay there)
pytestmark = [pytest.mark.integration, pytest.mark.full]

GOOD = "hostile-good"
LIMITS = Limits()


def huge_string_step() -> bytes:
    """Finding 2: one Step whose ``stage`` is a 20 MiB string."""
    record = dict(project="p", run_id="r", attempt=1, stage="x" * (20 << 20), time_ns=1, type="STEP", trainer="rl",
                  step=1, step_count=1, tokens=1, duration_s=1.0, throughput=1.0, mfu=None, dropped_events=0,
                  writer_id="w", sequence_id=1)
    return container(STEP, [(1, record_bytes(STEP, record))])


HOSTILE = [  # topic, value, the reason its dead letter and the streams' log line carry
    ("spans", endless_span(), "array of items that take no bytes"),
    ("steps", huge_string_step(), f"over the sink's limit of {LIMITS.max_message_bytes} a message"),
    ("steps", deflate_bomb(), f"over the sink's limit of {LIMITS.max_message_bytes} a message"),
    ("spans", many_records(), f"500000 records, over the sink's limit of {LIMITS.max_message_records} a message"),
]


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


async def _produce_hostile(settings: Settings) -> None:
    # gzip on the wire: the broker checks only the compressed batch (1 MiB), as in the report
    producer = AIOKafkaProducer(compression_type="gzip", max_request_size=128 << 20, max_batch_size=128 << 20,
                                **settings.kafka_client_kwargs())
    await producer.start()
    try:
        for short, value, _ in HOSTILE:
            await producer.send_and_wait(settings.topic(short), key=b"p/r", value=value)
    finally:
        await producer.stop()


@pytest.fixture(scope="module")
def ran(module_settings: Settings) -> Iterator[tuple[Settings, Pipeline, float]]:
    settings = module_settings
    ensure_topics(settings)
    pipeline = Pipeline(settings)
    try:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        publish_run(settings, "before")
        asyncio.run(_produce_hostile(settings))
        publish_run(settings, "after")
        pipeline.wait_caught_up(until=until.counts(settings, {
            f"SELECT count() FROM $db.spans FINAL WHERE project = '{GOOD}'": 8,
            f"SELECT count() FROM $db.steps FINAL WHERE project = '{GOOD}'": 6,
            f"SELECT sum(graded) FROM $db.grader_failures FINAL WHERE project = '{GOOD}' AND cause = 'timeout'": 4}))
        pipeline.check_alive()  # neither process exited on the way
        answers = {sql: until.query(settings, sql) for sql in QUERIES.values()}
        answers["hostile rows"] = {t: until.query(settings, f"SELECT count() FROM $db.{t} WHERE project = 'p'")[0][0]
                                   for (t,) in answers[QUERIES["hostile"]]}
        sink = pipeline.procs["sink"]
        started = time.monotonic()
        pipeline.stop(("sink",), sig=signal.SIGTERM, timeout=30)
        took = time.monotonic() - started
        assert sink.returncode == 0, sink.returncode
        pipeline.stop()
        yield settings, answers, took
    finally:
        pipeline.stop()


QUERIES = {
    "good": f"SELECT run_id, count() FROM $db.spans FINAL WHERE project = '{GOOD}' GROUP BY run_id ORDER BY run_id",
    "good_steps": f"SELECT run_id, count() FROM $db.steps FINAL WHERE project = '{GOOD}' GROUP BY run_id ORDER BY run_id",
    "failures": f"SELECT run_id, sum(failures), sum(graded) FROM $db.grader_failures FINAL WHERE project = '{GOOD}' "
                "AND cause = 'timeout' GROUP BY run_id ORDER BY run_id",
    # every table with a project column: no row of the hostile messages' project 'p', raw or figure
    "hostile": "SELECT table FROM system.columns WHERE database = '$db' AND name = 'project' ORDER BY table",
}


def test_the_good_runs_before_and_after_land_whole(ran) -> None:
    _, answers, _ = ran
    assert answers[QUERIES["good"]] == [("after", 4), ("before", 4)]  # 2 graders + 2 rollouts each
    assert answers[QUERIES["good_steps"]] == [("after", 3), ("before", 3)]  # RUN_START, the step, RUN_END
    assert answers[QUERIES["failures"]] == [("after", 1, 2), ("before", 1, 2)]


def test_no_table_or_figure_holds_a_hostile_record(ran) -> None:
    _, answers, _ = ran
    tables = answers[QUERIES["hostile"]]
    assert len(tables) >= 5  # the raw tables and the figures'
    assert answers["hostile rows"] == {t: 0 for (t,) in tables}


def test_each_hostile_message_is_one_dead_letter_with_its_reason(ran) -> None:
    settings, _, _ = ran
    letters = asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic(DLQ_TOPIC)))
    assert len(letters) == len(HOSTILE)
    by_topic: dict[str, list] = {}
    for letter in letters:
        headers = {k: v.decode() for k, v in letter.headers}
        by_topic.setdefault(headers[SOURCE_TOPIC], []).append((letter, headers))
    for short, _, reason in HOSTILE:
        matching = [(m, h) for m, h in by_topic[settings.topic(short)] if reason in h[REASON]]
        assert matching, (short, reason, [h[REASON] for _, h in by_topic[settings.topic(short)]])
    # Finding 2 (and the 500,000 records): too big for the broker, kept truncated with the original's size and digest.
    truncated = {int(h[ORIGINAL_SIZE]): (m, h) for ms in by_topic.values() for m, h in ms if TRUNCATED in h}
    for _, value, _ in (HOSTILE[1], HOSTILE[3]):
        letter, headers = truncated[len(value)]
        assert headers[ORIGINAL_SHA256] == hashlib.sha256(value).hexdigest()
        assert letter.value == value[:len(letter.value)] and len(letter.value) < 1 << 20


def test_a_replay_skips_the_truncated_letters(ran) -> None:
    """Only the first bytes of a truncated letter were kept: republishing them would send garbage.
    The two kept whole (the endless-array Span and the bomb) are still refused by the bounded
    container decoder, so a replay leaves them in place too: the sink would only refuse them again."""
    from rlpulse.sinks.write.dlq import replay_dead_letters

    settings, _, _ = ran
    report = asyncio.run(replay_dead_letters(settings, dry_run=True))
    assert (report.truncated, report.refused, report.replayed) == (2, 2, [])


def test_the_streams_refused_each_with_its_reason_and_nothing_restarted(ran) -> None:
    settings, _, took = ran
    logs = settings.home / "logs"
    streams = (logs / "streams.log").read_text()
    skipped = [line for line in streams.splitlines() if "skipping undecodable message" in line]
    assert len(skipped) == len(HOSTILE), skipped
    for _, _, reason in HOSTILE:
        assert any(reason in line for line in skipped), reason
    assert re.search(r"\(4 skipped so far", streams)
    sink = (logs / "sink.log").read_text()
    assert sink.count("sink consuming") == 1  # started once: it never exited on a hostile message
    assert sink.count("dead letter from") == len(HOSTILE)
    assert took < 10.0, took


# -- no insert is unbounded in time ---------------------------------------------------------------
@pytest.mark.full  # an insert past the default 30 s limit, twice: ~80 s
def test_an_insert_past_its_limit_is_dead_lettered_and_sigterm_mid_insert_exits_within_10s(settings: Settings,
                                                                                              tmp_path) -> None:
    """``RLPULSE_FAULTS=slow_insert=600``: an insert of a container carrying the fault's mark hangs
    10 minutes in the real insert path (an engine stuck on it). The sink stops it at its 30 s limit,
    inserts the checkpoint's messages one at a time and dead-letters the slow one with the reason;
    the good ones land. Then SIGTERM during such an insert: exit 0 within 10 s, nothing of that
    checkpoint committed or written; a sink without the fault then lands all of it."""
    from rlpulse.base.faults import Faults
    from rlpulse.sinks.write.dlq import read_dead_letters
    from rlpulse.sinks.write.writer import SLOW_INSERT_MARK
    from tests.integration.sinks.write.test_sink_avro import CODEC, publish, span
    from tests.integration.sinks.write.test_sink_faults import (dead_letter_count, offsets, plain_counts, start_sink,
                                                          stop_sink, wait_committed)

    ensure_topics(settings)
    slow = span(100, name=SLOW_INSERT_MARK.decode())
    publish(settings, [("spans", CODEC.encode("Span", [span(i) for i in range(10)])), ("spans", CODEC.encode("Span", [slow])),
                       ("spans", CODEC.encode("Span", [span(i) for i in range(10, 20)]))])
    log = tmp_path / "sink.log"
    fault = Faults(slow_insert=600).env()
    proc = start_sink(settings, log, env=fault)
    try:
        waited = wait_committed(settings, proc, log, timeout=150)
        [letter] = asyncio.run(read_dead_letters(settings.kafka_client_kwargs(), settings.topic(DLQ_TOPIC)))
        assert "spans insert stopped: insert ran past its limit of 30s" in letter["reason"], letter
        assert letter["source"].endswith("@1") and waited >= 30
        assert until.query(settings, "SELECT count() FROM $db.spans") == [(20,)]  # through the sink's endpoint
        # SIGTERM while the next such insert hangs
        before_end, before = offsets(settings)
        publish(settings, [("spans", CODEC.encode("Span", [span(i) for i in range(20, 25)])),
                           ("spans", CODEC.encode("Span", [dict(slow, sequence_id=101)]))])
        deadline = time.monotonic() + 60
        while log.read_text().count("this insert hangs") < 3:  # alone twice (whole group, then alone) before
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)  # well inside the insert
        code, took = stop_sink(proc, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 0 and took < 10.0, (code, took, text[-2000:])
    assert "checkpoint abandoned uncommitted" in text
    assert offsets(settings)[1] == before  # nothing committed past what was written
    assert plain_counts(settings)["spans"] == 20 and dead_letter_count(settings) == 1

    proc = start_sink(settings, log)  # no fault: the rest, once (the slow mark is an ordinary span now)
    try:
        wait_committed(settings, proc, log)
        assert stop_sink(proc)[0] == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert plain_counts(settings)["spans"] == 26 and dead_letter_count(settings) == 1
    print(f"insert past its limit: dead-lettered after {waited:.1f}s; SIGTERM mid-insert: exit {code} in {took:.2f}s")
