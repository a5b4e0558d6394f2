"""A process holding four GPUs: the GPU poller's real code over a fake NVML, through the real
broker and sink, leaves four placement rows (one per GPU, even after dedup) and the saved query
``gpu-utilization-by-run`` shows all four GPUs with their own utilisation."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from rlpulse.producers.gpu_poller import GpuPoller, Placement
from rlpulse.producers.sender import Sender
from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.schemas.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.clickhouse import open_store
from tests.fake_nvml import FakeNvml

pytestmark = pytest.mark.integration
GPUS = ["GPU-4a", "GPU-4b", "GPU-4c", "GPU-4d"]
UTIL = {"GPU-4a": 10, "GPU-4b": 35, "GPU-4c": 60, "GPU-4d": 95}  # percent, as NVML reports it
POWER_W = {"GPU-4a": 110, "GPU-4b": 220, "GPU-4c": 330, "GPU-4d": 440}


def test_four_gpus_of_one_process_are_four_placements_and_four_utilisation_rows(settings: Settings) -> None:
    ensure_topics(settings)
    fake = FakeNvml(list(GPUS))
    for i, hw_id in enumerate(GPUS):
        fake.push(i, util_gpu=UTIL[hw_id], power_mw=POWER_W[hw_id] * 1000)
    with Pipeline(settings) as pipeline:
        pipeline.start(("sink",))
        wait_groups_ready(settings, (settings.sink_group,), pipeline)
        sender = Sender(settings)
        sender.start()
        poller = GpuPoller(fake, sender.offer, settings, host="h4", placement=Placement(run_id="four-gpus", project="g", rank=0))
        assert poller.open()
        for _ in range(2):  # two exports: each GPU's placement and sample share one time_ns per export
            poller.sample()
            poller.export()
        poller.close()
        assert sender.close(30) == 0
        assert sender.delivered == 16  # 2 exports x 4 GPUs x (sample + placement)
        pipeline.wait_caught_up(time.time_ns())
        pipeline.stop()
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        q, db = store.client.query, store.database
        store.client.command(f"OPTIMIZE TABLE {db}.placements FINAL")  # what a background merge would do
        placements = q(f"SELECT hw_id, `index`, role, rank, count() FROM {db}.placements FINAL WHERE run_id = 'four-gpus' "
                       "GROUP BY hw_id, `index`, role, rank ORDER BY hw_id").result_rows
        times = q(f"SELECT uniqExact(time_ns), count() FROM {db}.placements FINAL WHERE run_id = 'four-gpus'").result_rows
    assert placements == [(hw_id, i, "trainer", 0, 2) for i, hw_id in enumerate(GPUS)]
    assert times == [(2, 8)]

    run = subprocess.run([sys.executable, "-m", "rlpulse.cli", "query", "--saved", "gpu-utilization-by-run",
                          "--param", "run_id=four-gpus", "--format", "json"],
                         env=settings_env(settings), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = [(r["hw_id"], r["role"], r["rank"], r["samples"], r["mean_gpu_utilization"], r["mean_power_w"])
           for r in json.loads(run.stdout)]
    assert got == [(hw_id, "trainer", 0, 2, UTIL[hw_id] / 100, float(POWER_W[hw_id])) for hw_id in GPUS]
