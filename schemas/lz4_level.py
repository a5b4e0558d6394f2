"""The level at which this process's aiokafka producers compress lz4 record batches.

aiokafka 0.14 compresses every lz4 batch at level 9 (``aiokafka.codec.lz4_encode``'s default,
"used by default by broker itself"), which is LZ4's high-compression mode, and offers no setting
for it. Measured here on a derived-topic batch: 53 MB/s at level 9, 625 MB/s at level 1, for a
batch about 15% larger; in ``make bench``'s drain lz4 at level 9 was 4.5% of the streams' CPU
(py-spy), for the changelog and the derived topics it writes. Every rlpulse producer (the SDK's,
the streams', the OTLP receiver's and ingest's, the sink's dead letters) compresses at
:data:`LEVEL` instead: lz4's fast mode, which the broker and every consumer read the same way
(the level is the writer's choice; the frame format does not change).

:func:`install` sets the encoder aiokafka's v2 record batch builders call (the module global
``lz4_encode`` of ``aiokafka.record.default_records`` and of its Cython twin in ``_crecords``,
the same kind of module global that ``rlpulse.schemas.compression`` sets for the decoders).
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

LEVEL = 1  # lz4's fast mode (0 and 1 are the same in lz4frame; 3 and up are its high-compression mode)

_ATTR = "lz4_encode"  # the name both modules call (mypy sees no such attribute on a module)
_MODULES = ("aiokafka.record.default_records", "aiokafka.record._crecords.default_records")
_lock = threading.Lock()
_installed: dict[str, Any] = {}  # module name -> the encoder it had


def lz4_encode(payload: Any, level: int = LEVEL) -> bytes:
    """aiokafka's own ``lz4_encode`` (an independent-block frame, no content checksum, as KIP-57
    asks), at ``level``."""
    import cramjam  # aiokafka's own lz4 library

    compressor = cramjam.lz4.Compressor(level=level, content_checksum=False, block_linked=False)
    compressor.compress(payload)
    return bytes(compressor.finish())


def install() -> None:
    """Have this process's aiokafka producers compress lz4 at :data:`LEVEL` (idempotent)."""
    with _lock:
        for name in _MODULES:
            if name in _installed:
                continue
            try:
                module = importlib.import_module(name)
            except ImportError:  # aiokafka built without its extensions
                continue
            if hasattr(module, _ATTR):
                _installed[name] = getattr(module, _ATTR)
                setattr(module, _ATTR, lz4_encode)


def uninstall() -> None:
    """aiokafka's own encoder back (tests)."""
    with _lock:
        for name, original in _installed.items():
            setattr(importlib.import_module(name), _ATTR, original)
        _installed.clear()


def installed() -> bool:
    return bool(_installed)
