"""Bounded decompression of the Kafka record batches every rlpulse consumer fetches.

aiokafka decompresses a whole record batch (gzip, snappy, lz4, zstd) before any check of ours
runs, and everything that bounds a fetch counts compressed bytes: the sink's fetch caps, the
broker's ``message.max.bytes``. A 3,166-byte zstd batch decodes to one 96 MiB value (the process
peaks 192 MiB higher), a 1 MiB one to about 32 GiB: the sink or the streams would be killed, and,
never committed, killed again at the same offset on every restart.

:func:`install` puts a :class:`Bound` in front of aiokafka's decoders, in this process:

* ``aiokafka.consumer.fetcher.MemoryRecords`` becomes :class:`BoundedRecords`, which hands the
  fetcher each batch as aiokafka would, after checking a compressed one: its codec against the
  allowlist (``Bound.codecs``), then its output against ``Bound.limit(compressed size)`` (at most
  ``max_bytes``; above :data:`FLOOR`, at most ``max_ratio`` times the compressed size). Every
  decoder (``rlpulse.schemas.decompress``) stops as soon as it knows the output passes the limit, without ever holding it:

  - gzip: ``zlib`` in steps of at most 1 MiB of output, member after member; past :data:`FLOOR`
    only counted, and decoded again for keeps if the whole stays within the limit;
  - snappy (raw or xerial-framed): each raw block states its length up front, checked before
    anything is decompressed, then decompressed into a buffer of exactly that size;
  - lz4 (frames): block headers bound the output (a compressed block inflates to at most the
    frame's block size); over the limit, the independent blocks are counted one at a time in a
    block-sized scratch buffer; then decompressed into a buffer of the size found;
  - zstd (frames): block headers bound the output (a compressed block regenerates at most
    128 KiB, a raw or RLE block states its size; the frame's content size when it has one);
    a frame over the limit is refused without decompressing a byte, else decompressed into a
    buffer of that size, which no output can overrun.

  The batch within the bound is decompressed once: aiokafka's own decoders (the module globals of
  ``aiokafka.record.default_records``, ``legacy_records`` and their Cython twins in ``_crecords``,
  replaced by :func:`install`) take the output already made. Called any other way they decode
  with the same bound and raise :class:`BatchRefused`.

* A batch over the bound (or of a codec not accepted, or that does not decompress) is never
  raised into aiokafka's fetcher, which would raise it again at the same offset for ever: the
  fetcher gets one record in its place, at the batch's last offset (so the consumer's position,
  and what it commits, moves past the whole batch), whose value is a marker: a fixed prefix, a
  random token made for this refusal and kept in this process only, and the reason. Every reader
  of a container checks the bounds of ``rlpulse.schemas.limits.check_container`` first, which asks
  :func:`refusal`: the sink dead-letters the marker (topic, partition, offset, the reason in the
  ``rlpulse.reason`` header), the streams skip, count and log it; it counts in no figure. A
  producer cannot forge a marker: it would need a token this process drew at random for a refusal
  of its own (the last 4,096 are kept); a copy of a dead letter's value sent back reads as that
  refusal's own reason again, nothing of the sender's choosing, and in any other process as bytes
  that are not a container.
"""

from __future__ import annotations

import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from rlpulse.schemas.decompress import (CODEC_IDS, CODECS, DECODERS, DEFAULT_MAX_BYTES, DEFAULT_MAX_RATIO, FLOOR,
                                        BatchRefused, Bound, decompress, mib)

__all__ = ["CODECS", "DECODERS", "DEFAULT_MAX_BYTES", "DEFAULT_MAX_RATIO", "FLOOR", "BatchRefused", "Bound",
           "BoundedRecords", "decompress", "install", "installed", "marker", "mib", "refusal", "uninstall"]

# -- markers: a refused batch's one record -------------------------------------------------------
_PREFIX = b"\x00rlpulse: compressed batch refused before decompression\n"  # \x00: no Avro, protobuf or JSON
_TOKEN = 32  # hex characters of the random token after the prefix
_TOKENS: OrderedDict[bytes, None] = OrderedDict()  # this process's markers' tokens, the last _KEPT
_KEPT = 4096
_tokens_lock = threading.Lock()


def marker(reason: str) -> bytes:
    """The value of the record standing for a refused batch: recognised by :func:`refusal` in this process only."""
    token = os.urandom(_TOKEN // 2).hex().encode()
    with _tokens_lock:
        _TOKENS[token] = None
        while len(_TOKENS) > _KEPT:
            _TOKENS.popitem(last=False)
    return _PREFIX + token + b"\n" + reason.encode("utf-8", "replace")


def refusal(value: Any) -> str | None:
    """The reason a batch was refused, if ``value`` is the marker this process made for it; else None."""
    if not isinstance(value, bytes) or not value.startswith(_PREFIX):
        return None
    token = value[len(_PREFIX):len(_PREFIX) + _TOKEN]
    if token not in _TOKENS:
        return None
    return value[len(_PREFIX) + _TOKEN + 1:].decode("utf-8", "replace")


@dataclass(frozen=True)
class _MarkerRecord:
    """What aiokafka's fetcher reads of a record (``PartitionRecords._consumer_record``)."""

    offset: int
    timestamp: int | None
    timestamp_type: int | None
    value: bytes
    key: None = None
    headers: tuple = ()
    checksum: None = None


class _RefusedBatch:
    """A refused batch as the fetcher sees it: the batch's own header fields, one marker record."""

    def __init__(self, batch: Any, record: _MarkerRecord):
        self._batch = batch
        self._record = record

    def __getattr__(self, name: str) -> Any:  # offsets, CRC check, transaction fields: the batch's own
        return getattr(self._batch, name)

    def __iter__(self) -> Any:
        return iter((self._record,))


# -- installing ----------------------------------------------------------------------------------
_bound: Bound | None = None
_stash = threading.local()  # the output of the batch just checked, for aiokafka's decoder to take
_originals: dict[tuple[Any, str], Any] = {}
_install_lock = threading.Lock()
BoundedRecords: Any = None  # the class, made at the first install (it subclasses aiokafka's)


def _taken(codec: str) -> Any:
    """aiokafka's module-global decoder of ``codec``: the output checked a moment ago, else a bounded decode."""
    def decode(data: Any) -> Any:
        stashed = getattr(_stash, "out", None)
        if stashed is not None and stashed[0] == codec and stashed[1] == len(data):
            _stash.out = None
            return stashed[2]
        return decompress(codec, data, _bound or Bound())
    decode.__name__ = f"{codec}_decode"
    decode.__qualname__ = f"bounded {codec}_decode"
    return decode


def _span(batch_offset: int, last: int) -> str:
    return f"offset {last}" if batch_offset == last else f"offsets {batch_offset}-{last}"


def _check(batch: Any, view: memoryview) -> Any:
    """``batch`` as the fetcher should see it: itself (its output stashed when compressed), or refused."""
    _stash.out = None
    magic = view[16]
    timestamp: int | None
    timestamp_type: int | None
    if magic >= 2:
        attributes = struct.unpack_from(">h", view, 21)[0]
        codec_id = attributes & 7
        if not codec_id or attributes & 0x20:  # uncompressed; or a control batch, which only brokers write
            return batch
        first, last_delta = struct.unpack_from(">q", view, 0)[0], struct.unpack_from(">i", view, 23)[0]
        last = first + last_delta
        timestamp, timestamp_type = struct.unpack_from(">q", view, 27)[0], 1 if attributes & 0x08 else 0
        count = struct.unpack_from(">i", view, 57)[0]
        payload = view[61:]
        where = f"{_span(first, last)}, {count} record{'' if count == 1 else 's'}"
    else:  # a legacy wrapper message: its value is the compressed inner message set
        codec_id = view[17] & 7
        if not codec_id:
            return batch
        first = last = struct.unpack_from(">q", view, 0)[0]
        key_at = 18 if magic == 0 else 26
        timestamp = struct.unpack_from(">q", view, 18)[0] if magic else None
        timestamp_type = (1 if view[17] & 0x08 else 0) if magic else None
        key_size = struct.unpack_from(">i", view, key_at)[0]
        at = key_at + 4 + max(key_size, 0)
        value_size = struct.unpack_from(">i", view, at)[0]
        if value_size < 0:
            return batch  # aiokafka says what is wrong with it
        payload = view[at + 4:at + 4 + value_size]
        where = _span(first, last)
    codec = CODEC_IDS.get(codec_id)
    bound = _bound or Bound()
    try:
        if codec is None:
            raise BatchRefused(f"compressed batch refused: unknown codec id {codec_id}")
        out = decompress(codec, payload, bound)
    except BatchRefused as exc:
        reason = f"{exc.reason}; {where}"
        return _RefusedBatch(batch, _MarkerRecord(offset=last, timestamp=timestamp, timestamp_type=timestamp_type,
                                                  value=marker(reason)))
    _stash.out = (codec, len(payload), out)
    return batch


def _records_class() -> Any:
    from aiokafka.record.memory_records import _MemoryRecordsPy

    class _BoundedRecords(_MemoryRecordsPy):  # type: ignore[misc]  # aiokafka marks it final for its own use
        """aiokafka's MemoryRecords (its pure-Python framing, with whichever batch classes it
        uses), each compressed batch checked against the bound before the fetcher iterates it."""

        def next_batch(self, *args: Any) -> Any:
            view = self._next_slice
            batch = super().next_batch()
            return batch if batch is None else _check(batch, view)

    return _BoundedRecords


_DECODER_MODULES = (
    ("aiokafka.record.default_records", CODECS),
    ("aiokafka.record._crecords.default_records", CODECS),
    ("aiokafka.record.legacy_records", ("gzip", "snappy", "lz4")),
    ("aiokafka.record._crecords.legacy_records", ("gzip", "snappy", "lz4")),
)


def install(max_bytes: int = DEFAULT_MAX_BYTES, max_ratio: float = DEFAULT_MAX_RATIO,
            codecs: tuple[str, ...] | str = CODECS) -> Bound:
    """Bound every record batch this process's aiokafka consumers decompress (idempotent: a second
    call only changes the bound). Returns the bound in force."""
    global _bound, BoundedRecords
    import importlib

    if isinstance(codecs, str):
        codecs = tuple(c.strip().lower() for c in codecs.split(",") if c.strip())
    bound = Bound(int(max_bytes), float(max_ratio), tuple(codecs))
    with _install_lock:
        _bound = bound
        if _originals:
            return bound
        from aiokafka.consumer import fetcher

        BoundedRecords = BoundedRecords or _records_class()
        _originals[(fetcher, "MemoryRecords")] = fetcher.MemoryRecords
        fetcher.MemoryRecords = BoundedRecords  # type: ignore[misc]
        for name, names in _DECODER_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:  # aiokafka built without its extensions
                continue
            for codec in names:
                attr = f"{codec}_decode"
                if hasattr(module, attr):
                    _originals[(module, attr)] = getattr(module, attr)
                    setattr(module, attr, _taken(codec))
    return bound


def uninstall() -> None:
    """Put aiokafka's own decoders back (tests)."""
    global _bound
    with _install_lock:
        for (module, attr), original in _originals.items():
            setattr(module, attr, original)
        _originals.clear()
        _bound = None


def installed() -> Bound | None:
    """The bound in force in this process, or None."""
    return _bound if _originals else None
