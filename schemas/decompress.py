"""Kafka's record batch codecs decompressed within a bound: :func:`decompress` stops as soon as it
knows a batch's output passes :class:`Bound`'s limit, without ever holding that output (how each
codec is judged: ``rlpulse.schemas.compression``'s docstring). aiokafka-free; the glue that puts it
in front of aiokafka's fetcher is ``rlpulse.schemas.compression``."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

from rlpulse.base.errors import Error

CODECS = ("gzip", "snappy", "lz4", "zstd")  # Kafka's record batch codecs, by their producer names
CODEC_IDS = {1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}  # the batch attributes' codec bits
FLOOR = 1 << 20  # below this much output a batch is never refused for its ratio
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_MAX_RATIO = 2000.0

_STEP = 1 << 20  # the most gzip output one zlib call makes
_INPUT = 64 << 10  # compressed bytes handed to zlib at a time (its unconsumed tail is a copy)
_ZSTD_BLOCK = 128 << 10  # the most a zstd compressed block regenerates (the format's Block_Maximum_Size)
_LZ4_BLOCKS = {4: 64 << 10, 5: 256 << 10, 6: 1 << 20, 7: 4 << 20}  # lz4 frame BD byte -> block maximum size
_XERIAL = b"\x82SNAPPY\x00\x00\x00\x00\x01\x00\x00\x00\x01"  # aiokafka's xerial header: version 1, compatible 1


class BatchRefused(Error, ValueError):
    """A compressed batch is over the bound, of a codec not accepted, or does not decompress."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n % (1 << 18) == 0 else f"{n:,} bytes"


@dataclass(frozen=True)
class Bound:
    """What one compressed batch may inflate to, and the codecs accepted."""

    max_bytes: int = DEFAULT_MAX_BYTES
    max_ratio: float = DEFAULT_MAX_RATIO
    codecs: tuple[str, ...] = CODECS

    def __post_init__(self) -> None:
        if not FLOOR <= self.max_bytes <= 1 << 31:
            raise ValueError(f"the decompression bound must be from {FLOOR} to {1 << 31} bytes, got {self.max_bytes}")
        if not 1 <= self.max_ratio < float("inf"):
            raise ValueError(f"the decompression ratio bound must be a number of at least 1, got {self.max_ratio}")
        unknown = [c for c in self.codecs if c not in CODECS]
        if unknown:
            raise ValueError(f"unknown codec {', '.join(unknown)}: the codecs are {', '.join(CODECS)}")

    def limit(self, compressed: int) -> int:
        """The most bytes a batch of ``compressed`` bytes may inflate to."""
        return min(self.max_bytes, max(FLOOR, int(self.max_ratio * compressed)))

    def describe(self) -> str:
        return (f"bounds: {mib(self.max_bytes)} a batch, and {self.max_ratio:g}x its compressed size "
                f"above {mib(FLOOR)}")


# -- the decoders --------------------------------------------------------------------------------
def _over(codec: str, compressed: int, limit: int, bound: Bound, headers: bool) -> BatchRefused:
    return BatchRefused(f"compressed batch over the decompression bound: {codec}, {compressed:,} bytes would inflate "
                        f"past {mib(limit)}{' (by its block headers)' if headers else ''} ({bound.describe()})")


def _corrupt(codec: str, why: str) -> BatchRefused:
    return BatchRefused(f"compressed batch refused: undecodable {codec} batch ({why})")


def _inflate(view: memoryview, limit: int, keep: int) -> tuple[int, bytearray | None]:
    """Gzip members one after another (zero padding between them skipped, as Python's gzip does):
    the output's size, stopping one step past ``limit``, and the output while it is within ``keep``."""
    out: bytearray | None = bytearray()
    size = pos = 0
    n = len(view)
    member = zlib.decompressobj(16 + zlib.MAX_WBITS)
    while True:
        fed = view[pos:pos + _INPUT]
        data: bytes | memoryview = fed
        while True:
            step = min(_STEP, limit - size + 1)
            piece = member.decompress(data, step)
            size += len(piece)
            if size > limit:
                return size, None
            if out is not None:
                if size > keep:
                    out = None
                else:
                    out += piece
            if member.eof:
                break
            data = member.unconsumed_tail
            if not data and len(piece) < step:  # input used up and nothing more pending inside zlib
                break
        if member.eof:
            pos = pos + len(fed) - len(member.unused_data)
            pos = _skip_zeros(view, pos)
            if pos >= n:
                return size, out
            member = zlib.decompressobj(16 + zlib.MAX_WBITS)
        else:
            pos += len(fed)
            if pos >= n:
                raise zlib.error("the gzip stream ends before its end")


def _skip_zeros(view: memoryview, pos: int) -> int:
    """The position of the first non-zero byte from ``pos`` (gzip members may be padded with zeros)."""
    while pos < len(view) and view[pos] == 0:
        chunk = bytes(view[pos:pos + _INPUT])
        pos += len(chunk) - len(chunk.lstrip(b"\0"))
    return pos


def _gzip(view: memoryview, limit: int) -> bytearray:
    size, out = _inflate(view, limit, FLOOR)
    if size > limit:
        raise OverflowError(size)
    if out is None:  # over the floor: counted, not kept; now decoded for keeps, within the limit
        size, out = _inflate(view, limit, limit)
    assert out is not None
    return out


def _snappy(view: memoryview, limit: int) -> bytearray:
    import cramjam

    if len(view) > 16 and view[:16] == _XERIAL:
        blocks, pos = [], 16
        while pos < len(view):
            if pos + 4 > len(view):
                raise ValueError("a xerial block length runs past the end")
            size = int.from_bytes(view[pos:pos + 4], "big", signed=True)
            pos += 4
            if size < 0 or pos + size > len(view):
                raise ValueError(f"a xerial block of {size} bytes runs past the end")
            blocks.append(view[pos:pos + size])
            pos += size
    else:
        blocks = [view]
    total = 0
    sizes = []
    for block in blocks:
        sizes.append(cramjam.snappy.decompress_raw_len(block))
        total += sizes[-1]
        if total > limit:
            raise OverflowError(total)
    out = bytearray(total)
    at = 0
    for block, size in zip(blocks, sizes):
        if cramjam.snappy.decompress_raw_into(block, memoryview(out)[at:at + size]) != size:
            raise ValueError("a snappy block decompressed to other than its stated length")
        at += size
    return out


def _frame_magic(view: memoryview, pos: int, codec: str) -> tuple[int, int]:
    """The magic number of the frame at ``pos`` and, for a skippable frame (lz4's and zstd's share
    the range), where the next frame starts (else 0)."""
    if pos + 4 > len(view):
        raise ValueError(f"truncated {codec} frame")
    magic = int.from_bytes(view[pos:pos + 4], "little")
    if not 0x184D2A50 <= magic <= 0x184D2A5F:
        return magic, 0
    if pos + 8 > len(view):
        raise ValueError(f"truncated {codec} skippable frame")
    return magic, pos + 8 + int.from_bytes(view[pos + 4:pos + 8], "little")


def _lz4_frames(view: memoryview) -> list[tuple[bool, int, list[tuple[bool, memoryview]]]]:
    """Each frame's (independent blocks, block maximum size, [(compressed, block bytes)])."""
    frames = []
    pos, n = 0, len(view)
    while pos < n:
        magic, skipped = _frame_magic(view, pos, "lz4")
        if skipped:
            pos = skipped
            continue
        if magic != 0x184D2204 or pos + 7 > n:
            raise ValueError("not an lz4 frame")
        flg, bd = view[pos + 4], view[pos + 5]
        block_max = _LZ4_BLOCKS.get((bd >> 4) & 7)
        if flg >> 6 != 1 or block_max is None:
            raise ValueError("an lz4 frame header of an unknown version or block size")
        pos += 7 + (8 if flg & 0x08 else 0) + (4 if flg & 0x01 else 0)
        blocks = []
        while True:
            if pos + 4 > n:
                raise ValueError("truncated lz4 frame: no end mark")
            word = int.from_bytes(view[pos:pos + 4], "little")
            pos += 4
            if word == 0:
                break
            size = word & 0x7FFFFFFF
            if size > block_max or pos + size > n:
                raise ValueError(f"an lz4 block of {size} bytes, over its frame's {block_max} or past the end")
            blocks.append((not word & 0x80000000, view[pos:pos + size]))
            pos += size + (4 if flg & 0x10 else 0)
        pos += 4 if flg & 0x04 else 0
        frames.append((bool(flg & 0x20), block_max, blocks))
    if pos > n:
        raise ValueError("truncated lz4 frame")
    return frames


def _lz4(view: memoryview, limit: int) -> bytearray:
    import cramjam

    frames = _lz4_frames(view)
    total = sum(block_max if compressed else len(block) for _, block_max, blocks in frames
                for compressed, block in blocks)
    if total > limit:  # the headers allow more: count what the blocks really hold, one at a time
        if not all(independent for independent, _, _ in frames):
            raise OverflowError(total, True)  # dependent blocks cannot be counted alone (Kafka's clients never write them)
        scratch = bytearray(max(block_max for _, block_max, _ in frames))
        total = 0
        for _, _, blocks in frames:
            for compressed, block in blocks:
                total += cramjam.lz4.decompress_block_into(block, scratch) if compressed else len(block)
                if total > limit:
                    raise OverflowError(total)
    out = bytearray(total)
    n = cramjam.lz4.decompress_into(view, out)  # fails rather than write past the buffer
    del out[n:]
    return out


def _zstd_bound(view: memoryview, limit: int) -> int:
    """The most the zstd frames of ``view`` can regenerate, from their headers (stops past ``limit``)."""
    total = pos = 0
    n = len(view)
    while pos < n:
        magic, skipped = _frame_magic(view, pos, "zstd")
        if skipped:
            pos = skipped
            continue
        if magic != 0xFD2FB528 or pos + 5 > n:
            raise ValueError("not a zstd frame")
        fhd = view[pos + 4]
        single = fhd & 0x20
        pos += 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
        fcs_size = (1 if single else 0, 2, 4, 8)[fhd >> 6]
        content = int.from_bytes(view[pos:pos + fcs_size], "little") + (256 if fcs_size == 2 else 0) if fcs_size else None
        pos += fcs_size
        frame = 0  # the most this frame's blocks regenerate
        while True:
            if pos + 3 > n:
                raise ValueError("truncated zstd frame: a block header runs past the end")
            header = int.from_bytes(view[pos:pos + 3], "little")
            kind, size = (header >> 1) & 3, header >> 3
            pos += 3
            if kind == 0:  # raw: size bytes as they are
                frame, pos = frame + size, pos + size
            elif kind == 1:  # RLE: one byte, repeated size times
                frame, pos = frame + size, pos + 1
            elif kind == 2 and size <= _ZSTD_BLOCK:  # compressed: size bytes that regenerate at most 128 KiB
                frame, pos = frame + _ZSTD_BLOCK, pos + size
            else:
                raise ValueError("a zstd block of the reserved type, or compressed to over 128 KiB")
            most = frame if content is None else min(frame, content)
            if total + most > limit:
                return total + most
            if header & 1:  # the frame's last block
                break
        pos += 4 if fhd & 0x04 else 0  # the content checksum
        total += most
    if pos > n:
        raise ValueError("truncated zstd frame")
    return total


def _zstd(view: memoryview, limit: int) -> bytearray:
    import cramjam

    most = _zstd_bound(view, limit)
    if most > limit:
        raise OverflowError(most, True)
    out = bytearray(most)
    n = cramjam.zstd.decompress_into(view, out)  # fails rather than write past the buffer
    del out[n:]
    return out


DECODERS = {"gzip": _gzip, "snappy": _snappy, "lz4": _lz4, "zstd": _zstd}


def decompress(codec: str, payload: Any, bound: Bound) -> bytearray:
    """The records of a batch's compressed ``payload``, within ``bound``; BatchRefused saying why not."""
    if codec not in bound.codecs:
        raise BatchRefused(f"compressed batch refused: {codec} batches are not accepted here "
                           f"(accepted: {', '.join(bound.codecs) or 'none'})")
    view = memoryview(payload).cast("B")
    limit = bound.limit(len(view))
    try:
        return DECODERS[codec](view, limit)
    except OverflowError as exc:  # args: (bytes found, True where only the block headers said so)
        raise _over(codec, len(view), limit, bound, len(exc.args) > 1 and exc.args[1]) from None
    except BatchRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of a decoder on hostile bytes is a refusal
        raise _corrupt(codec, f"{type(exc).__name__}: {str(exc)[:200]}") from None
