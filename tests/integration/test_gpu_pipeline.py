"""The GPU poller's real code, over a fake NVML, through the real broker, streams and sink:
the figures land in ``gpu_samples``, the placement joins them to the run by ``hw_id``, and the
XID and the hardware slowdown raise their alerts (the XID at once, not at an export)."""

from __future__ import annotations

import time

import pytest

from rlpulse.producers.gpu_poller import GpuPoller, Placement
from rlpulse.producers.sender import Sender
from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.schemas.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.clickhouse import open_store
from tests.fake_nvml import FakeNvml
from tests.integration import until

pytestmark = pytest.mark.integration
GiB = 1 << 30


def test_poller_figures_placement_and_alerts_reach_clickhouse(settings: Settings) -> None:
    ensure_topics(settings)
    fake = FakeNvml(["GPU-int-1"])
    for power_w, mask in ((100, 0x1), (200, 0x9), (300, 0x1)):  # one export: mean 200 W, mask 0x9
        fake.push(0, power_mw=power_w * 1000, temp_c=55, util_gpu=80, util_memory=30, mem_used=40 * GiB,
                  mem_total=80 * GiB, sm_clock=1400, throttle=mask)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        sender = Sender(settings)
        sender.start()
        poller = GpuPoller(fake, sender.offer, settings, host="h1", placement=Placement(run_id="gpu-run", project="g"),
                           xid_wait_ms=20)
        assert poller.open()
        for _ in range(3):
            poller.sample()
        poller.export()
        assert poller.start_xid_watch()
        fake.xid(0, 79)  # published at once by the watch thread
        deadline = time.monotonic() + 10
        while sender.delivered < 3 and time.monotonic() < deadline:  # sample, placement, XID sample
            time.sleep(0.05)
        fake.push(0, power_mw=100_000, throttle=0x0)  # the slowdown is over
        poller.sample()
        poller.export()
        poller.close()
        assert sender.close(30) == 0
        pipeline.wait_caught_up(until=until.counts(settings, {  # the GPU's alerts come as its samples are read
            "SELECT count() FROM $db.gpu_samples FINAL WHERE hw_id = 'GPU-int-1'": 3, "placements": 1,
            "SELECT count() FROM $db.alerts FINAL WHERE key = 'GPU-int-1'": 3}))
        pipeline.stop()
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        q, db = store.client.query, store.database
        samples = q(f"SELECT power_w, throttle_reasons, xid_errors, xid_last, memory_utilization FROM {db}.gpu_samples FINAL "
                    f"WHERE hw_id = 'GPU-int-1' ORDER BY time_ns").result_rows
        runs = q(f"SELECT DISTINCT p.run_id FROM {db}.gpu_samples AS s FINAL INNER JOIN {db}.placements AS p FINAL "
                 f"ON s.hw_id = p.hw_id").result_rows
        alerts = q(f"SELECT rule, state FROM {db}.alerts FINAL WHERE key = 'GPU-int-1' ORDER BY rule, state").result_rows
    assert samples[0] == (200.0, 0x9, 0, None, 0.5)  # the export: means, OR of masks, latest
    assert samples[1][2:4] == (1, 79)  # the XID, counted from zero
    assert samples[-1][1:4] == (0x0, 1, 79)
    assert runs == [("gpu-run",)]
    assert alerts == [("hw_slowdown", "FIRING"), ("hw_slowdown", "RESOLVED"), ("xid", "FIRING")]
