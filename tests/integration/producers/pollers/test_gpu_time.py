"""GPU time per run, end to end: the GPU poller's real code over the fake NVML, through the broker and
`rlpulse sink` into ClickHouse, read back with `rlpulse query --saved gpu-time`.

The scenario (seconds from T0) moves GPU-x between runs: run A attempt 1 holds GPU-x and GPU-y
(0..45, then an XID on GPU-x at 50), run B takes GPU-x (60..105, its energy counter reset by a
driver reload), a poller without a placement samples GPU-x (110, 115: no run's), A attempt 2 holds
it (130..160), then A attempt 1 again (200..230). GPU-y has no energy counter. The truth below is
worked out by hand from that timeline, not by the query's method.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.producers.pollers.gpu_poller import GpuPoller, Placement
from rlpulse.producers.sdk.sender import Outgoing, Sender
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.store.clickhouse import open_store
from tests.fake_nvml import FakeNvml
from tests.integration import until

pytestmark = [pytest.mark.integration, pytest.mark.full]

S = 1_000_000_000
T0 = (time.time_ns() // S - 3600) * S  # an hour ago on a whole second: inside the tables' TTL
NO_ENERGY = {"nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetRemappedRows", "nvmlGpmSampleGet", 138, 139}


def hold(settings: Settings, publish, fake: FakeNvml, placement: Placement | None, times: list[int],
         xid_at: int | None = None) -> None:
    """One poller: an export at ``times[0]`` (placements only), then a sample and an export at each
    later time; with ``xid_at``, an XID 31 on GPU 0 published at once at that time."""
    now, sent = [times[0]], []

    def out(item: Outgoing) -> None:
        sent.append(item)
        publish(item)

    poller = GpuPoller(fake, out, settings, host="h1", placement=placement, clock=lambda: T0 + now[0] * S, xid_wait_ms=5)
    assert poller.open()
    poller.export()
    for t in times[1:]:
        poller.sample()
        now[0] = t
        poller.export()
    if xid_at is not None:
        now[0], before = xid_at, len(sent)
        assert poller.start_xid_watch(wait_ms=5)
        fake.xid(0, 31)
        deadline = time.monotonic() + 10
        while len(sent) == before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(sent) == before + 1, "the XID was not published"
    poller.close()


def scenario(settings: Settings, publish) -> None:
    a1, b1 = Placement("gt-A", 1, project="gt"), Placement("gt-B", 1, project="gt")
    fake = FakeNvml(["GPU-x", "GPU-y"], unsupported={1: NO_ENERGY})
    for i, (energy, tx, mask) in enumerate([(1_000_000, 0, 0x1), (1_600_000, 1024, 0x48), (2_500_000, 3072, 0x8)]):
        fake.push(0, energy_mj=energy, nvlink_tx_kib=tx, nvlink_rx_kib=2 * tx, field_time_us=(15 + 15 * i) * 1_000_000,
                  throttle=mask, mem_used=30 << 30, mem_reserved=1 << 30, remapped_rows=(2, 0, 1, 0),
                  tensor_pct=40.0, dram_pct=20.0 + 10 * i)
    hold(settings, publish, fake, a1, [0, 15, 30, 45], xid_at=50)
    fake = FakeNvml(["GPU-x"])
    for energy in (3_000_000, 500_000, 800_000):  # the driver reloaded between 75 and 90
        fake.push(0, energy_mj=energy)
    hold(settings, publish, fake, b1, [60, 75, 90, 105])
    fake = FakeNvml(["GPU-x"])
    fake.push(0, energy_mj=900_000)
    hold(settings, publish, fake, None, [105, 110, 115])  # no placement: samples of no run
    fake = FakeNvml(["GPU-x"])
    for energy in (900_000, 1_000_000):
        fake.push(0, energy_mj=energy)
    hold(settings, publish, fake, Placement("gt-A", 2, project="gt"), [130, 145, 160])
    fake = FakeNvml(["GPU-x"])
    for energy in (1_100_000, 1_250_000):
        fake.push(0, energy_mj=energy)
    hold(settings, publish, fake, a1, [200, 215, 230])


@pytest.fixture(scope="module")
def stored(module_settings: Settings) -> Settings:
    settings = module_settings
    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start(("sink",))
        wait_groups_ready(settings, (settings.sink_group,), pipeline)
        sender = Sender(settings)
        sender.start()
        scenario(settings, sender.offer)
        assert sender.close(30) == 0
        # placements: A1 2 GPUs x 4 exports + 3, B 4, A2 3; samples: A1 2 x 3 + the XID's + 2, B 3, none 2, A2 2
        pipeline.wait_caught_up(until=until.counts(settings, {"placements": 18, "gpu_samples": 16}))
        pipeline.stop()
    return settings


def gpu_time(settings: Settings) -> list[dict[str, Any]]:
    run = subprocess.run([sys.executable, "-m", "rlpulse.cli", "query", "--saved", "gpu-time", "--format", "json"],
                         env=settings_env(settings), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def iso(t: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(T0 // S + t))


def test_gpu_time_per_run_matches_the_timeline(stored: Settings) -> None:
    kwh = 3.6e9  # millijoules in a kWh
    assert gpu_time(stored) == [
        # GPU-x 0..50 (its last sample is the XID's, before B's placement at 60) + GPU-y 0..45 + GPU-x
        # 200..230; energy: GPU-x 1.0 -> 2.5 MJ (the XID's sample repeats 2.5) and 1.10 -> 1.25 MJ
        {"project": "gt", "run_id": "gt-A", "attempt": 1, "gpus": 2, "gpu_seconds": 125.0,
         "gpu_hours": round(125 / 3600, 4), "held_from": iso(0), "held_to": iso(230), "energy_gpus": 1,
         "energy_kwh": round(1_650_000 / kwh, 9)},
        {"project": "gt", "run_id": "gt-A", "attempt": 2, "gpus": 1, "gpu_seconds": 30.0,
         "gpu_hours": round(30 / 3600, 4), "held_from": iso(130), "held_to": iso(160), "energy_gpus": 1,
         "energy_kwh": round(100_000 / kwh, 9)},
        # 60..105 (the samples at 110 and 115 are no run's); energy 3.0 -> 0.5 (a reset: nothing) -> 0.8 MJ
        {"project": "gt", "run_id": "gt-B", "attempt": 1, "gpus": 1, "gpu_seconds": 45.0,
         "gpu_hours": round(45 / 3600, 4), "held_from": iso(60), "held_to": iso(105), "energy_gpus": 1,
         "energy_kwh": round(300_000 / kwh, 9)},
    ]


def test_gpu_health_columns_land_in_clickhouse(stored: Settings) -> None:
    with open_store(stored.clickhouse_dsn, owner="test") as store:
        rows = store.client.query(
            "SELECT hw_id, intDiv(time_ns - {t0:Int64}, 1000000000) AS t, throttle_reasons, throttle_reason_names, "
            "xid_last, xid_class, memory_used_bytes, memory_reserved_bytes, energy_mj, nvlink_tx_bytes_per_s, "
            "nvlink_rx_bytes_per_s, remapped_rows_correctable, remap_pending, remap_failure, tensor_activity, "
            f"dram_activity FROM {store.database}.gpu_samples FINAL WHERE run_id = 'gt-A' AND attempt = 1 AND t <= 50 "
            "ORDER BY hw_id, t", parameters={"t0": T0}).result_rows
    rate = 1024 * 1024 / 15  # 1024 KiB more in 15 s
    assert [tuple(r) for r in rows] == [
        ("GPU-x", 15, 0x1, ["gpu_idle"], None, None, 30 << 30, 1 << 30, 1_000_000, None, None, 2, True, False,
         None, None),  # GPM needs two samples; NVLink a counter before this one
        ("GPU-x", 30, 0x48, ["hw_slowdown", "hw_thermal"], None, None, 30 << 30, 1 << 30, 1_600_000, rate, 2 * rate,
         2, True, False, 0.4, 0.3),
        ("GPU-x", 45, 0x8, ["hw_slowdown"], None, None, 30 << 30, 1 << 30, 2_500_000, 2 * rate, 4 * rate, 2, True,
         False, 0.4, 0.4),
        ("GPU-x", 50, 0x8, ["hw_slowdown"], 31, "application", 30 << 30, 1 << 30, 2_500_000, None, None, 2, True,
         False, 0.4, 0.4),  # the XID's record: the latest reading, no interval of its own
        ("GPU-y", 15, 0x0, [], None, None, 0, 0, None, None, None, None, None, None, None, None),
        ("GPU-y", 30, 0x0, [], None, None, 0, 0, None, None, None, None, None, None, None, None),
        ("GPU-y", 45, 0x0, [], None, None, 0, 0, None, None, None, None, None, None, None, None),
    ]


def test_the_report_shows_each_runs_gpu_time(stored: Settings) -> None:
    run = subprocess.run([sys.executable, "-m", "rlpulse.cli", "report"],  # a project of GPUs only: no --project
                         env={**settings_env(stored), "COLUMNS": "200"}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.split("== GPU time per run: GPUs held, GPU hours, energy (all projects) ==\n")[1].splitlines()
    assert lines[0].split() == ["project", "run_id", "attempt", "gpus", "gpu_hours", "energy_kwh"]
    kwh = 3.6e9
    assert [line.split() for line in lines[2:5]] == [
        ["gt", "gt-A", "1", "2", str(round(125 / 3600, 4)), str(round(1_650_000 / kwh, 4))],
        ["gt", "gt-A", "2", "1", str(round(30 / 3600, 4)), str(round(100_000 / kwh, 4))],
        ["gt", "gt-B", "1", "1", str(round(45 / 3600, 4)), str(round(300_000 / kwh, 4))]]
