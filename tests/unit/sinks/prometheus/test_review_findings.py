"""Review of issue 31's Prometheus endpoint: a stored completion-length histogram whose steps lie far
apart cost memory in proportion to the gap between them, before the buckets were narrowed."""

from __future__ import annotations

import tracemalloc

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlpulse.sinks.prometheus import names
from rlpulse.sinks.prometheus.collector import render
from rlpulse.sinks.prometheus.figures import CAPPED, QUERIES, Rows

pytestmark = pytest.mark.full


def test_length_buckets_far_apart_are_narrowed_before_they_are_made_dense() -> None:
    # two steps of one run at scale 20, buckets 0 and 10,000,000 (lengths 1 and ~750 tokens; any writer of
    # completion-length records can store such a pair; at scale 0 offsets -2^31 and 2^31-1 asked for a
    # 2^32-long list and the endpoint died)
    rows = Rows(now_ns=0, tables={name: [] for name in QUERIES}, dropped={name: 0 for name in CAPPED})
    rows.tables["lengths"] = [("p", "r", 1, 20, 0, 3, 30.0, [(0, 1), (10_000_000, 2)])]
    tracemalloc.start()
    try:
        body = render(rows)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 * 1024  # the dense list alone was 80 MB
    samples = {(s.name, s.labels.get("le")): s.value for f in text_string_to_metric_families(body.decode())
               for s in f.samples if s.name.startswith(names.COMPLETION_LENGTH)}
    buckets = sorted((float(le), v) for (name, le), v in samples.items() if name.endswith("_bucket"))
    assert len(buckets) <= 160 + 2 and buckets[-1] == (float("inf"), 3.0)
    assert [v for _, v in buckets][:2] == [0.0, 1.0] and buckets[-2][1] == 3.0  # 1 in the first bucket, 2 in the last
    assert samples[(names.COMPLETION_LENGTH + "_count", None)] == 3.0
