"""The bound on Kafka record batch decompression (``rlpulse.schemas.compression``, issue 33).

Each codec's bounded decoder gives back exactly what aiokafka's own decoder gives for every
legitimate payload (multi-member gzip, xerial and raw snappy, lz4 frames of independent or linked
blocks, zstd frames with and without their content size, skippable frames), refuses a bomb in
each codec with a reason naming it while its memory stays within a few MiB (measured as VmHWM in
a child process; aiokafka's own decoder, the control, peaks a whole bomb higher), and refuses
corrupt bytes with a reason, never another exception. Installed, aiokafka's fetcher (its Cython
record classes and its pure-Python ones, v2 batches and legacy v0/v1 messages) hands over each
refused batch as one stand-in record at the batch's last offset, whose value only this process
recognises, and moves past it; the batches around it come through whole, decompressed once.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import cramjam
import pytest
from aiokafka import codec as aiokafka_codec

from rlpulse.base.settings import Settings
from rlpulse.schemas import compression
from rlpulse.schemas.codec import DecodeError
from rlpulse.schemas.compression import FLOOR, BatchRefused, Bound, decompress
from rlpulse.schemas.limits import Limits, check_container

pytestmark = pytest.mark.full  # the fast tier is at its time limit

ROOT = Path(__file__).resolve().parents[3]
BOUND = Bound()
BOMB = 96 << 20  # the finding's 96 MiB value
ENCODE = {"gzip": aiokafka_codec.gzip_encode, "snappy": aiokafka_codec.snappy_encode,
          "lz4": aiokafka_codec.lz4_encode, "zstd": aiokafka_codec.zstd_encode}
DECODE = {"gzip": aiokafka_codec.gzip_decode, "snappy": aiokafka_codec.snappy_decode,
          "lz4": aiokafka_codec.lz4_decode, "zstd": aiokafka_codec.zstd_decode}


def _data(seed: int = 1, size: int = 300_000) -> bytes:
    """Telemetry-like bytes: random runs between repetitive ones."""
    rng = random.Random(seed)
    parts = []
    while sum(map(len, parts)) < size:
        if rng.random() < 0.5:
            parts.append(rng.randbytes(rng.randint(1, 400)))
        else:
            parts.append(bytes([rng.randint(0, 255)]) * rng.randint(1, 3000))
    return b"".join(parts)[:size]


def _lz4_frame(data: bytes, linked: bool = False, checksum: bool = False) -> bytes:
    compressor = cramjam.lz4.Compressor(level=4, content_checksum=checksum, block_linked=linked)
    compressor.compress(data)
    return bytes(compressor.finish())


def _xxh32(data: bytes, seed: int = 0) -> int:
    """xxHash32, for an lz4 frame descriptor's checksum byte (short inputs only: no 16-byte stripes)."""
    p1, p2, p3, p4, p5, m = 2654435761, 2246822519, 3266489917, 668265263, 374761393, 0xFFFFFFFF
    assert len(data) < 16
    h = (seed + p5 + len(data)) & m
    i = 0
    while i + 4 <= len(data):
        h = (h + int.from_bytes(data[i:i + 4], "little") * p3) & m
        h = (((h << 17) | (h >> 15)) & m) * p4 & m
        i += 4
    for b in data[i:]:
        h = (h + b * p5) & m
        h = (((h << 11) | (h >> 21)) & m) * p1 & m
    h ^= h >> 15
    h = h * p2 & m
    h ^= h >> 13
    h = h * p3 & m
    return h ^ (h >> 16)


def _lz4_block_size(frame: bytes, bd: int) -> bytes:
    """``frame`` (one without content size or dictionary) with another block maximum size, its header checksum made again."""
    out = bytearray(frame)
    out[5] = bd
    out[6] = (_xxh32(bytes(out[4:6])) >> 8) & 0xFF
    return bytes(out)


def _zstd_streamed(data: bytes) -> bytes:
    """A zstd frame without its content size, as a streaming writer (the Java client's) makes it."""
    compressor = cramjam.zstd.Compressor(level=3)
    for i in range(0, len(data), 50_000):
        compressor.compress(data[i:i + 50_000])
    return bytes(compressor.finish())


SKIPPABLE = (0x184D2A53).to_bytes(4, "little") + (6).to_bytes(4, "little") + b"rlpuls"
DATA = _data()
LEGIT = {  # name: (codec, payload, what it holds)
    "gzip": ("gzip", aiokafka_codec.gzip_encode(DATA), DATA),
    "gzip multi-member, zero-padded": ("gzip", gzip.compress(DATA[:1000]) + b"\0" * 70_000 + gzip.compress(DATA[1000:])
                                       + gzip.compress(b""), DATA),
    "gzip empty member": ("gzip", gzip.compress(b""), b""),
    "snappy xerial": ("snappy", aiokafka_codec.snappy_encode(DATA), DATA),
    "snappy xerial of 32 KiB blocks, 1 byte": ("snappy", aiokafka_codec.snappy_encode(b"x"), b"x"),
    "snappy raw": ("snappy", aiokafka_codec.snappy_encode(DATA, xerial_compatible=False), DATA),
    "lz4 (aiokafka's frame)": ("lz4", aiokafka_codec.lz4_encode(DATA), DATA),
    "lz4 linked blocks, checksums": ("lz4", _lz4_frame(DATA, linked=True, checksum=True), DATA),
    "lz4 two frames and a skippable one": ("lz4", _lz4_frame(DATA[:5]) + SKIPPABLE + _lz4_frame(DATA[5:]), DATA),
    "zstd (aiokafka's, with its content size)": ("zstd", aiokafka_codec.zstd_encode(DATA), DATA),
    "zstd streamed (no content size)": ("zstd", _zstd_streamed(DATA), DATA),
    "zstd two frames and a skippable one": ("zstd", aiokafka_codec.zstd_encode(DATA[:7]) + SKIPPABLE
                                            + _zstd_streamed(DATA[7:]), DATA),
    "zstd of zeros, below the floor": ("zstd", aiokafka_codec.zstd_encode(bytes(FLOOR)), bytes(FLOOR)),
}


@pytest.mark.parametrize("name", list(LEGIT))
def test_a_legitimate_payload_round_trips_exactly(name: str) -> None:
    codec, payload, data = LEGIT[name]
    out = decompress(codec, payload, BOUND)
    assert bytes(out) == data
    assert bytes(out) == bytes(DECODE[codec](payload))  # what aiokafka's own decoder gives


def test_a_big_batch_with_a_ratio_within_the_bound_passes() -> None:
    """Up to 64 MiB and 2000x: the 500,000-record container of the hostile-messages test (45 MiB, 291x
    gzip) still reaches the container decoder, which refuses it naming the record bound it breaks.
    In zstd the same identical records compress 8,000-fold: refused here already, by the ratio."""
    from tests.unit.sinks.write.test_bounded_decoder import many_records

    data = many_records()
    for codec in ("gzip", "snappy", "lz4"):
        payload = ENCODE[codec](data)
        assert len(data) / len(payload) < BOUND.max_ratio
        assert bytes(decompress(codec, payload, BOUND)) == data
    with pytest.raises(BatchRefused, match="zstd"):
        decompress("zstd", ENCODE["zstd"](data), BOUND)


@pytest.mark.parametrize("codec", list(ENCODE))
def test_a_bomb_in_each_codec_is_refused_naming_the_codec(codec: str) -> None:
    bomb = ENCODE[codec](bytes(BOMB))
    with pytest.raises(BatchRefused) as refused:
        decompress(codec, bomb, BOUND)
    reason = refused.value.reason
    assert reason.startswith(f"compressed batch over the decompression bound: {codec}, {len(bomb):,} bytes "
                             f"would inflate past {compression.mib(BOUND.limit(len(bomb)))}"), reason
    assert "64 MiB a batch, and 2000x its compressed size above 1 MiB" in reason


def test_the_ratio_applies_above_the_floor_only() -> None:
    tiny = aiokafka_codec.zstd_encode(bytes(FLOOR))  # ~40 bytes inflating 26,000-fold: under the floor, accepted
    assert len(tiny) * BOUND.max_ratio < FLOOR and len(decompress("zstd", tiny, BOUND)) == FLOOR
    over = aiokafka_codec.zstd_encode(bytes(4 * FLOOR))  # 4 MiB from ~150 bytes: refused by the ratio
    with pytest.raises(BatchRefused, match="zstd"):
        decompress("zstd", over, BOUND)
    assert len(decompress("zstd", over, Bound(max_ratio=1e9))) == 4 * FLOOR
    assert Bound(max_bytes=8 << 20, max_ratio=10).limit(10) == FLOOR  # the floor
    assert Bound(max_bytes=8 << 20, max_ratio=10).limit(500_000) == 5_000_000
    assert Bound(max_bytes=8 << 20, max_ratio=10).limit(10 << 20) == 8 << 20  # the byte bound


def test_lz4_counts_blocks_when_their_headers_allow_more_than_the_bound() -> None:
    """4 MiB blocks (BD 7): one block of 100 bytes allows 4 MiB, past the 1 MiB floor; counted, it passes.
    Linked blocks over the bound cannot be counted one at a time: refused."""
    assert _lz4_block_size(_lz4_frame(b"abc"), 0x40) == _lz4_frame(b"abc")  # the checksum as the library makes it
    small = _lz4_block_size(_lz4_frame(b"abc" * 30), 0x70)  # block maximum size 4 MiB
    assert bytes(decompress("lz4", small, BOUND)) == b"abc" * 30 == bytes(aiokafka_codec.lz4_decode(small))
    linked = _lz4_frame(bytes(80 << 20), linked=True)
    with pytest.raises(BatchRefused, match=r"lz4, .* \(by its block headers\)"):
        decompress("lz4", linked, BOUND)


def test_a_codec_not_accepted_is_refused() -> None:
    with pytest.raises(BatchRefused, match=r"gzip batches are not accepted here \(accepted: lz4, zstd\)"):
        decompress("gzip", LEGIT["gzip"][1], Bound(codecs=("lz4", "zstd")))
    with pytest.raises(ValueError, match="brotli"):
        Bound(codecs=("brotli",))


@pytest.mark.parametrize("codec", list(ENCODE))
def test_corrupt_bytes_are_refused_with_a_reason_never_another_exception(codec: str) -> None:
    """Random damage (a flipped byte, a cut, random bytes): refused, or, where aiokafka's decoder
    reads the same bytes, the same output."""
    rng = random.Random(codec)
    payload = ENCODE[codec](_data(3, 20_000))
    for i in range(300):
        damaged = bytearray(payload)
        kind = i % 3
        if kind == 0:
            damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
        elif kind == 1:
            damaged = damaged[:rng.randrange(len(damaged))]
        else:
            damaged = bytearray(rng.randbytes(rng.randint(0, 200)))
        try:
            out = decompress(codec, bytes(damaged), BOUND)
        except BatchRefused as exc:
            assert codec in exc.reason
            continue
        assert bytes(out) == bytes(DECODE[codec](bytes(damaged)))


# -- memory: a bomb is never held ---------------------------------------------------------------
_MEASURE = textwrap.dedent("""
    import gc, json, sys
    from aiokafka import codec as ak
    from rlpulse.schemas.compression import BatchRefused, Bound, decompress

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    def peak(decode, payload):
        gc.collect()
        open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current RSS
        before = status("VmRSS:")
        try:
            out = decode(payload)
            del out
            why = None
        except BatchRefused as exc:
            why = exc.reason
        return status("VmHWM:") - before, why

    encode = {"gzip": ak.gzip_encode, "snappy": ak.snappy_encode, "lz4": ak.lz4_encode, "zstd": ak.zstd_encode}
    result = {}
    for codec, enc in encode.items():
        bomb = enc(bytes(%(bomb)d))
        result[codec] = peak(lambda p: decompress(codec, p, Bound()), bomb)
    result["control: aiokafka's zstd_decode"] = peak(ak.zstd_decode, ak.zstd_encode(bytes(%(bomb)d)))
    print(json.dumps(result))
""")


def test_refusing_a_bomb_holds_a_few_mib_at_most_in_every_codec() -> None:
    done = subprocess.run([sys.executable, "-c", _MEASURE % {"bomb": BOMB}], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for codec in ENCODE:
        grown, why = result[codec]
        assert why and codec in why, (codec, why)
        assert grown < 8 << 20, f"{codec}: the process grew {grown / (1 << 20):.1f} MiB refusing a 96 MiB bomb"
    grown, _ = result["control: aiokafka's zstd_decode"]
    assert grown > BOMB * 0.9  # the finding, for comparison: aiokafka's own decoder holds the whole value


# -- through aiokafka's fetcher ------------------------------------------------------------------
def _batch(codec: str, values: list[bytes], base: int) -> bytes:
    from aiokafka.record.default_records import DefaultRecordBatchBuilder

    ids = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=ids[codec], is_transactional=0, producer_id=-1,
                                        producer_epoch=-1, base_sequence=-1, batch_size=1 << 30)
    for i, value in enumerate(values):
        builder.append(i, timestamp=1000 + i, key=b"p/r", value=value, headers=[])
    out = bytearray(builder.build())
    out[0:8] = base.to_bytes(8, "big")  # the offset the broker gives the batch
    return bytes(out)


def _legacy(magic: int, codec: int, values: list[bytes], base: int) -> bytes:
    from aiokafka.record.legacy_records import LegacyRecordBatchBuilder

    builder = LegacyRecordBatchBuilder(magic=magic, compression_type=codec, batch_size=1 << 30)
    for i, value in enumerate(values):  # v1: inner offsets relative; v0: absolute
        builder.append(base + i if magic == 0 else i, timestamp=None if magic == 0 else 1000, key=None, value=value)
    out = bytearray(builder.build())
    out[0:8] = (base + len(values) - 1).to_bytes(8, "big")  # a wrapper carries its last inner offset
    return bytes(out)


def scenario(decoded: dict[str, int] | None = None) -> dict:
    """Good batches, then a bomb, in each codec and format, through aiokafka's fetcher as installed:
    each record's (offset, value hex or the refusal), and where the fetcher's position ends."""
    from aiokafka.consumer import fetcher
    from aiokafka.record.default_records import DefaultRecordBatch
    from aiokafka.structs import TopicPartition

    raw, offset = b"", 0
    for codec in ("none", *ENCODE):
        raw += _batch(codec, [b"good-%d" % offset, b"good-%d" % (offset + 1)], offset)
        offset += 2
        if codec != "none":
            raw += _batch(codec, [bytes(BOMB)], offset)
            offset += 1
            raw += _batch(codec, [b"a", bytes(70 << 20), b"b"], offset)  # one refusal for the batch's 3 records
            offset += 3
    for magic, codec in ((0, 1), (0, 2), (1, 1), (1, 2), (1, 3)):
        raw += _legacy(magic, codec, [b"good-%d" % offset], offset)
        offset += 1
        raw += _legacy(magic, codec, [bytes(BOMB)], offset)
        offset += 1
    raw += _batch("zstd", [b"good-%d" % offset], offset)
    offset += 1
    records = fetcher.PartitionRecords(TopicPartition("t", 0), fetcher.MemoryRecords(raw), [], 0, None, None, True,
                                       "read_uncommitted")
    got = [(r.offset, compression.refusal(r.value) or r.value.hex()) for r in records]
    return {"records": got, "position": records.next_fetch_offset, "end": offset,
            "batch_class": DefaultRecordBatch.__name__}


@pytest.fixture
def bounded() -> Iterator[Bound]:
    was = compression.installed()
    yield compression.install()
    if was is None:
        compression.uninstall()
    else:
        compression.install(was.max_bytes, was.max_ratio, was.codecs)


def _check_scenario(result: dict) -> None:
    got = dict(result["records"])
    assert result["position"] == result["end"]  # past the last batch: nothing is fetched again
    goods = {o: bytes.fromhex(v) for o, v in got.items() if not v.startswith("compressed batch")}
    assert all(v == b"good-%d" % o for o, v in goods.items()), goods
    refused = {o: v for o, v in got.items() if v.startswith("compressed batch")}
    # v2: per codec 2 good, the bomb at its offset, the 3-record batch once at its last offset
    expected_refused, offset = {}, 2  # after the uncompressed batch's 2
    for codec in ENCODE:
        expected_refused[offset + 2] = (codec, f"offset {offset + 2}, 1 record")
        expected_refused[offset + 5] = (codec, f"offsets {offset + 3}-{offset + 5}, 3 records")
        offset += 6
    for codec in ("gzip", "snappy", "gzip", "snappy", "lz4"):
        expected_refused[offset + 1] = (codec, f"offset {offset + 1}")
        offset += 2
    assert sorted(refused) == sorted(expected_refused)
    for o, (codec, where) in expected_refused.items():
        assert refused[o].startswith(f"compressed batch over the decompression bound: {codec}, "), refused[o]
        assert refused[o].endswith(where), refused[o]
    assert len(goods) == 2 + 4 * 2 + 5 + 1


def test_the_fetcher_hands_each_refused_batch_over_as_one_record_and_moves_past_it(bounded) -> None:
    result = scenario()
    assert result["batch_class"] == "DefaultRecordBatch"  # aiokafka's Cython batches
    _check_scenario(result)


def test_the_same_with_aiokafkas_pure_python_records(bounded) -> None:
    code = ("import json; from rlpulse.schemas import compression; compression.install(); "
            "from tests.unit.schemas.test_batch_decompression import scenario; print(json.dumps(scenario()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "AIOKAFKA_NO_EXTENSIONS": "1"})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["batch_class"] == "_DefaultRecordBatchPy"
    _check_scenario(result)


def test_a_batch_within_the_bound_is_decompressed_once(bounded, monkeypatch) -> None:
    from aiokafka.consumer import fetcher
    from aiokafka.structs import TopicPartition

    calls: list[str] = []
    for codec, decoder in list(compression.DECODERS.items()):
        monkeypatch.setitem(compression.DECODERS, codec, lambda v, limit, d=decoder, c=codec: calls.append(c) or d(v, limit))
    raw = b"".join(_batch(codec, [DATA[:50_000], DATA[50_000:]], 2 * i) for i, codec in enumerate(ENCODE))
    records = fetcher.PartitionRecords(TopicPartition("t", 0), fetcher.MemoryRecords(raw), [], 0, None, None, True,
                                       "read_uncommitted")
    assert [r.value for r in records] == [DATA[:50_000], DATA[50_000:]] * 4
    assert calls == list(ENCODE)  # aiokafka's decoder took the checked output: no second pass


def test_install_replaces_every_decoder_idempotently_and_uninstall_restores(bounded) -> None:
    import aiokafka.record._crecords.default_records as c_default
    import aiokafka.record._crecords.legacy_records as c_legacy
    import aiokafka.record.default_records as py_default
    import aiokafka.record.legacy_records as py_legacy
    from aiokafka.consumer import fetcher

    for module, codecs in ((c_default, ENCODE), (py_default, ENCODE), (c_legacy, ("gzip", "snappy", "lz4")),
                           (py_legacy, ("gzip", "snappy", "lz4"))):
        for codec in codecs:
            assert getattr(module, f"{codec}_decode").__qualname__ == f"bounded {codec}_decode", (module, codec)
    assert fetcher.MemoryRecords is compression.BoundedRecords
    again = compression.install(8 << 20, 10, "lz4")
    assert compression.installed() == again == Bound(8 << 20, 10.0, ("lz4",))
    with pytest.raises(BatchRefused, match="zstd batches are not accepted"):  # called outside the fetcher: raises
        c_default.zstd_decode(aiokafka_codec.zstd_encode(b"x"))
    compression.uninstall()
    assert c_default.zstd_decode is aiokafka_codec.zstd_decode and py_legacy.gzip_decode is aiokafka_codec.gzip_decode
    assert fetcher.MemoryRecords.__name__ == "MemoryRecords" and compression.installed() is None


# -- the stand-in record, read by the one container decoder ---------------------------------------
def test_the_container_decoder_refuses_the_stand_in_with_its_reason() -> None:
    value = compression.marker("compressed batch over the decompression bound: zstd, 3,166 bytes ...")
    with pytest.raises(DecodeError, match=r"^compressed batch over the decompression bound: zstd, 3,166 bytes"):
        check_container(value, Limits())


def test_a_forged_stand_in_is_just_bytes() -> None:
    """The prefix with a token this process never drew (another process's, or made up) is not a
    refusal: it reads as what it is, not an Avro container."""
    real = compression.marker("a reason")
    forged = real[:len(compression._PREFIX)] + os.urandom(16).hex().encode() + real[len(compression._PREFIX) + 32:]
    assert compression.refusal(real) == "a reason" and compression.refusal(forged) is None
    with pytest.raises(DecodeError, match="not an Avro container"):
        check_container(forged, Limits())


def test_the_bound_settings_and_their_variables() -> None:
    settings = Settings.load(env={"RLPULSE_KAFKA_BATCH_MAX_BYTES": str(8 << 20), "RLPULSE_KAFKA_BATCH_MAX_RATIO": "50",
                                  "RLPULSE_KAFKA_CODECS": "ZSTD, lz4"})
    assert (settings.kafka_batch_max_bytes, settings.kafka_batch_max_ratio, settings.kafka_batch_codecs) == \
        (8 << 20, 50.0, ("lz4", "zstd"))
    assert Settings.load(env=settings.env()).kafka_batch_codecs == ("lz4", "zstd")  # what a child process gets
    defaults = Settings()
    assert (defaults.kafka_batch_max_bytes, defaults.kafka_batch_max_ratio, defaults.kafka_batch_codecs) == \
        (BOUND.max_bytes, BOUND.max_ratio, BOUND.codecs)
    assert Settings.load(env={"RLPULSE_KAFKA_CODECS": "none"}).kafka_batch_codecs == ()
    for var, bad in (("RLPULSE_KAFKA_CODECS", "brotli"), ("RLPULSE_KAFKA_CODECS", "none,lz4"),
                     ("RLPULSE_KAFKA_BATCH_MAX_BYTES", "1000"), ("RLPULSE_KAFKA_BATCH_MAX_RATIO", "0.5")):
        with pytest.raises(ValueError, match=var):
            Settings.load(env={var: bad})
