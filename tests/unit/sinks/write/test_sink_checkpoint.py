"""When a checkpoint is due, what it commits, and in which order (no broker, no ClickHouse)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError

from rlpulse.schemas.codec import Codec, read_header
from rlpulse.base.faults import Faults
from rlpulse.sinks.write.checkpoint import Checkpoint, Policy
from rlpulse.sinks.write.writer import Backoff, Entry, InsertFault, classify, describe, token


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def message(offset: int, partition: int = 0, topic: str = "p.steps", size: int = 100) -> SimpleNamespace:
    return SimpleNamespace(topic=topic, partition=partition, offset=offset, key=None, value=b"x" * size)


def entry(offset: int, records: int = 10, **kw) -> Entry:
    return Entry(message(offset, **kw), None, records)  # type: ignore[arg-type]


class Consumer:
    """Records what is committed; plain Python, standing in for the consumer's two calls."""

    def __init__(self, assigned: set[TopicPartition], fail: bool = False):
        self.assigned, self.fail, self.commits = assigned, fail, []

    def assignment(self) -> set[TopicPartition]:
        return self.assigned

    async def commit(self, offsets: dict) -> None:
        if self.fail:
            raise CommitFailedError("rebalanced")
        self.commits.append(offsets)


def test_an_empty_checkpoint_is_never_due() -> None:
    clock = Clock()
    cp = Checkpoint(Policy(interval=1.0), clock)
    clock.now += 60
    assert cp.empty and not cp.due() and cp.remaining() == 1.0


def test_due_a_second_after_the_first_message_not_after_the_last_commit() -> None:
    clock = Clock()
    cp = Checkpoint(Policy(max_rows=1000, interval=1.0), clock)
    clock.now += 30  # idle time before the first message does not count
    cp.add("steps", entry(0))
    clock.now += 0.6
    cp.add("steps", entry(1))
    assert not cp.due() and cp.remaining() == pytest.approx(0.4)
    clock.now += 0.4
    assert cp.due()


def test_caught_up_a_checkpoint_is_due_at_the_live_interval_and_a_full_poll_restores_the_long_one() -> None:
    clock = Clock()
    cp = Checkpoint(Policy(max_rows=1000, interval=1.0, live_interval=0.4), clock)
    cp.add("steps", entry(0))
    cp.polled(256, 256)  # a full poll: a backlog, large inserts
    clock.now += 0.5
    assert not cp.due() and cp.remaining() == pytest.approx(0.5)
    cp.polled(3, 256)  # the poll took all there was: caught up
    assert cp.due() and cp.remaining() == 0.0
    cp.polled(256, 256)
    assert not cp.due()
    # a live interval longer than the interval never delays a checkpoint
    slow = Checkpoint(Policy(interval=0.2, live_interval=0.4), clock)
    slow.add("steps", entry(1))
    slow.polled(0, 256)
    clock.now += 0.2
    assert slow.due()


def test_due_at_the_row_or_byte_limit() -> None:
    rows = Checkpoint(Policy(max_rows=25, interval=60), Clock())
    rows.add("steps", entry(0, records=20))
    assert not rows.due()
    rows.add("spans", entry(1, records=5))
    assert rows.due() and rows.rows == 25
    size = Checkpoint(Policy(max_bytes=250, interval=60), Clock())
    size.add("steps", entry(0))
    size.skip(message(1, size=200))  # a dead letter's bytes count too
    assert size.due()


def test_offsets_are_the_next_to_read_per_partition() -> None:
    cp = Checkpoint(Policy(), Clock())
    cp.add("steps", entry(5))
    cp.add("steps", entry(7))
    cp.skip(message(9))
    cp.add("steps", entry(3, partition=1))
    assert cp.offsets == {TopicPartition("p.steps", 0): 10, TopicPartition("p.steps", 1): 4}


def test_commit_writes_every_table_then_awaits_dead_letters_then_commits_owned_partitions() -> None:
    order: list[str] = []

    async def scenario() -> dict:
        cp = Checkpoint(Policy(), Clock())
        loop = asyncio.get_running_loop()
        delivery = loop.create_future()
        cp.add("steps", entry(0))
        cp.add("spans", entry(0, topic="p.spans"))
        cp.skip(message(1, topic="p.spans"), delivery)
        cp.add("steps", entry(0, partition=1))  # a partition this consumer no longer owns

        async def write(table: str, entries: list) -> None:
            order.append(f"{table}:{len(entries)}")
            await asyncio.sleep(0)

        def deliver() -> None:
            order.append("dead letter delivered")
            delivery.set_result(None)

        loop.call_later(0.01, deliver)
        consumer = Consumer({TopicPartition("p.steps", 0), TopicPartition("p.spans", 0)})
        committed = await cp.commit(write, consumer)
        order.append("committed")
        return committed

    committed = asyncio.run(scenario())
    assert order == ["steps:2", "spans:1", "dead letter delivered", "committed"]
    assert committed == {TopicPartition("p.steps", 0): 1, TopicPartition("p.spans", 0): 2}


def test_a_refused_commit_is_reported_not_raised() -> None:
    async def scenario() -> dict:
        cp = Checkpoint(Policy(), Clock())
        cp.add("steps", entry(0))

        async def write(table: str, entries: list) -> None:
            pass

        return await cp.commit(write, Consumer({TopicPartition("p.steps", 0)}, fail=True))

    assert asyncio.run(scenario()) == {}


def test_a_failed_write_commits_nothing() -> None:
    consumer = Consumer({TopicPartition("p.steps", 0)})

    async def scenario() -> None:
        cp = Checkpoint(Policy(), Clock())
        cp.add("steps", entry(0))

        async def write(table: str, entries: list) -> None:
            raise RuntimeError("boom")

        await cp.commit(write, consumer)

    with pytest.raises(RuntimeError):
        asyncio.run(scenario())
    assert consumer.commits == []


def test_token_names_table_schema_and_offset_ranges_whatever_the_order() -> None:
    value = Codec().encode("Step", [dict(project="p", run_id="r", attempt=1, time_ns=1, type="STEP", trainer="rl",
                                         step_count=0)])
    header = read_header(value)
    entries = [Entry(message(o, partition=p), header, 1) for o, p in ((7, 0), (5, 0), (2, 1), (6, 0))]
    t = token("steps", header.schema_json, entries)
    assert t.startswith("steps;") and t.endswith(";p.steps:0:5-7;p.steps:1:2-2")
    assert t == token("steps", header.schema_json, list(reversed(entries)))
    assert t != token("steps", header.schema_json + b" ", entries)


@pytest.mark.parametrize("text, kind", [
    ("Code: 70. DB::Exception: Value in column Int32 cannot be safely converted into type UInt32", "rejected"),
    ("Code: 27. DB::Exception: Cannot parse input", "rejected"),
    ("Code: 748. DB::Exception: avro::Exception: Invalid Avro varint. (AVRO_EXCEPTION)", "rejected"),
    ("Code: 117. DB::Exception: Incorrect data. (INCORRECT_DATA)", "rejected"),
    ("Code: 252. DB::Exception: Too many parts", "outage"),
    ("Code: 241. DB::Exception: Memory limit (total) exceeded", "outage"),
    ("Code: 242. DB::Exception: Table is in readonly mode", "outage"),
    ("Code: 164. DB::Exception: Cannot execute query in readonly mode", "outage"),
    ("Code: 60. DB::Exception: Unknown table rlpulse.steps", "outage"),
    ("Code: 1000. DB::Exception: Poco exception", "unknown"),
    ("something unexpected", "unknown"),
])
def test_errors_are_classified_as_outage_rejection_or_unknown(text: str, kind: str) -> None:
    from clickhouse_connect.driver.exceptions import DatabaseError

    assert classify(DatabaseError(text)) == kind


def test_the_structured_code_wins_and_transport_errors_are_outages() -> None:
    from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError

    # clickhouse-connect sets .code from the X-ClickHouse-Exception-Code header (text may be scrubbed)
    assert classify(DatabaseError("The ClickHouse server returned an error", code=252)) == "outage"
    assert classify(DatabaseError("The ClickHouse server returned an error", code=6)) == "rejected"
    assert classify(OperationalError("connection refused")) == "outage"
    assert classify(ConnectionRefusedError(111, "refused")) == "outage"
    assert classify(RuntimeError("a bug")) == "unknown" and classify(KeyError("x")) == "unknown"


def test_the_injected_insert_fault_raises_clickhouse_errors_then_stops() -> None:
    from clickhouse_connect.driver.exceptions import DatabaseError

    fault = InsertFault.from_faults(Faults.parse("insert_error=252:2"))
    assert fault is not None
    for _ in range(2):
        with pytest.raises(DatabaseError) as raised:
            fault.maybe_raise()
        assert raised.value.code == 252 and classify(raised.value) == "outage"
        assert describe(raised.value).startswith("DatabaseError TOO_MANY_PARTS (code 252): Code: 252.")
        assert "fault injected on purpose (RLPULSE_FAULTS insert_error)" in str(raised.value)
    fault.maybe_raise()  # the third insert goes through
    persistent = InsertFault.from_faults(Faults(insert_error="164"))
    assert persistent is not None
    for _ in range(50):
        with pytest.raises(DatabaseError):
            persistent.maybe_raise()
    assert InsertFault.from_faults(Faults()) is None and InsertFault.from_faults(Faults(kill_after_inserts=3)) is None
    with pytest.raises(ValueError, match="insert_error"):
        Faults.parse("insert_error=many")


def test_backoff_doubles_up_to_its_cap() -> None:
    b = Backoff(first=0.2, cap=10.0)
    assert [b.delay(n) for n in range(1, 8)] == [0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0]
    assert b.delay(10_000) == 10.0
