"""The streams worker's process tuning: fewer cyclic collections, and a partitioner that remembers its keys' hashes."""

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


def test_the_cached_partitioner_picks_aiokafkas_partition_for_every_key() -> None:
    import random

    from aiokafka.partitioner import DefaultPartitioner

    from rlpulse.streams.app import CachedPartitioner

    rng = random.Random(7)
    ours, theirs = CachedPartitioner(), DefaultPartitioner()
    keys = [f"project/run{i}".encode() for i in range(300)] + [rng.randbytes(rng.randrange(0, 40)) for _ in range(300)]
    for n in (1, 2, 3, 12):
        partitions = list(range(n))
        for key in keys + keys:  # the second time from the cache
            assert ours(key, partitions, partitions) == theirs(key, partitions, partitions)
    assert ours(None, [0, 1, 2], [2]) == 2  # no key: one of the available, as aiokafka picks
    ours = CachedPartitioner()
    ours.MAX_KEYS = 10
    for key in keys:
        ours(key, [0, 1], [0, 1])
    assert len(ours._hashes) <= 10
