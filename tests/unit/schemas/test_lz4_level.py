"""rlpulse.schemas.lz4_level: aiokafka's own record batch builder, the one its producer uses,
compresses lz4 at level 1 once installed, and what it builds reads back through aiokafka's reader."""

from __future__ import annotations

import random

import cramjam
import pytest
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.record.memory_records import MemoryRecords

from rlpulse.schemas import lz4_level

pytestmark = pytest.mark.full

HEADER = 61  # a v2 record batch's header, before its (compressed) records
LZ4, NONE = 3, 0  # the codec ids in a batch's attributes


def _values() -> list[bytes]:
    # JSON-ish, repetitive but not trivially so: lz4's fast and high-compression modes differ on it
    rng = random.Random(7)
    return [(f'{{"run":"run-{i % 40}","step":{i},"reward":{rng.random():.6f},"term":"{rng.choice("abcdef") * 12}",'
             f'"tokens":{rng.randrange(1024)}}}').encode() * 3 for i in range(400)]


def _batch(codec: int) -> bytes:
    builder = BatchBuilder(1 << 22, codec)
    for i, value in enumerate(_values()):
        builder.append(key=b"p/r", value=value, timestamp=1_700_000_000_000 + i)
    return bytes(builder._build())  # noqa: SLF001 - what the sender puts on the wire


@pytest.fixture
def fresh():
    lz4_level.uninstall()
    yield
    lz4_level.uninstall()


def test_the_producers_batches_are_compressed_at_level_1_and_read_back(fresh) -> None:
    raw = _batch(NONE)[HEADER:]  # the records, uncompressed
    level9, level1 = (len(lz4_level.lz4_encode(raw, level)) for level in (9, 1))
    assert level9 != level1, "the payload must tell the two levels apart"

    before = _batch(LZ4)
    lz4_level.install()
    lz4_level.install()  # idempotent
    assert lz4_level.installed()
    after = _batch(LZ4)

    assert len(before) - HEADER == level9  # aiokafka's own default: lz4's high-compression mode
    assert len(after) - HEADER == level1
    batch = MemoryRecords(after).next_batch()
    assert [r.value for r in batch] == _values()


def test_uninstall_puts_aiokafkas_encoder_back(fresh) -> None:
    lz4_level.install()
    lz4_level.uninstall()
    assert not lz4_level.installed()
    raw = _batch(NONE)[HEADER:]
    assert len(_batch(LZ4)) - HEADER == len(lz4_level.lz4_encode(raw, 9))


def test_the_encoder_is_aiokafkas_frame() -> None:
    # no linked blocks, no content checksum (KIP-57): the frame aiokafka and the broker read
    data = b"abc" * 10_000
    assert bytes(cramjam.lz4.decompress(lz4_level.lz4_encode(data))) == data
