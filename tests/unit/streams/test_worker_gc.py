"""The streams worker's process collects cycles less often, and never over what it loaded at start."""

from __future__ import annotations

import gc

import pytest

from rlpulse.streams.app import GC_THRESHOLDS, tune_gc

pytestmark = pytest.mark.full


def test_tune_gc_freezes_the_start_up_heap_and_raises_the_thresholds() -> None:
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == GC_THRESHOLDS and GC_THRESHOLDS[0] > before[0]
        assert gc.get_freeze_count() > 1000  # the modules and objects loaded so far
        assert gc.isenabled()  # cycles made later are still collected

        class Cycle:
            pass

        a, b = Cycle(), Cycle()
        a.other, b.other = b, a
        del a, b
        assert gc.collect() >= 2
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
