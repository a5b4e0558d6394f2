"""The real GPU poller driven by a fake NVML and a list-collecting ``publish``."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from rlpulse.producers.pollers import gpu_poller
from rlpulse.producers.pollers.gpu_poller import GpuPoller, Placement
from rlpulse.producers.sdk.sender import Outgoing
from rlpulse.base.settings import Settings
from rlpulse.schemas.codec import Codec
from tests.fake_nvml import (FakeNvml, NVMLError_FunctionNotFound, NVMLError_GpuIsLost, NVMLError_LibraryNotFound,
                             NVMLError_NotSupported)

GiB = 2**30
SETTINGS = Settings(topic_prefix="t")
PLACEMENT = Placement(run_id="r1", attempt=2, role="actor", rank=3, project="p", stage="rl")


def make(fake: FakeNvml, **kwargs) -> tuple[GpuPoller, list[Outgoing]]:
    out: list[Outgoing] = []
    kwargs.setdefault("host", "h1")
    poller = GpuPoller(fake, out.append, SETTINGS, clock=lambda: 1_000, node="n1", pod="pod-1", **kwargs)
    return poller, out


def of(out: list[Outgoing], schema: str) -> list[Outgoing]:
    return [o for o in out if o.schema == schema]


def wait_for(cond, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.001)


def warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_export_means_or_and_latest():
    fake = FakeNvml(["GPU-a"])
    for power, temp, ug, um, used, clock, mask in [(100_000, 40, 10, 5, 10, 1000, 0x1),
                                                     (200_000, 50, 20, 15, 20, 1500, 0x8),
                                                     (300_000, 60, 30, 40, 30, 2000, 0x4)]:
        fake.push(0, power_mw=power, temp_c=temp, util_gpu=ug, util_memory=um, mem_used=used * GiB,
                  mem_total=80 * GiB, sm_clock=clock, throttle=mask)
    poller, out = make(fake)
    assert poller.open()
    for _ in range(3):
        assert poller.sample() == 1
    [rec] = poller.export()
    assert rec["power_w"] == 200.0
    assert rec["throttle_reasons"] == 0xD
    assert rec["temperature_c"] == 60.0
    assert rec["memory_used_bytes"] == 30 * GiB and rec["memory_total_bytes"] == 80 * GiB
    assert rec["memory_utilization"] == 30 / 80
    assert rec["gpu_utilization"] == pytest.approx(0.2) and rec["memory_activity"] == pytest.approx(0.2)
    assert rec["sm_clock_mhz"] == 1500.0
    assert rec["xid_errors"] == 0 and rec["xid_last"] is None
    assert (rec["hw_id"], rec["index"], rec["host"], rec["node"], rec["pod"], rec["time_ns"]) == (
        "GPU-a",
        0,
        "h1",
        "n1",
        "pod-1",
        1_000,
    )
    assert rec["run_id"] == "" and rec["rank"] is None and rec["role"] is None  # no placement given
    Codec().encode("GpuSample", [rec])
    assert out == [Outgoing("t.hardware", "GPU-a", "GpuSample", rec)]  # no placement -> none published

    # Nothing sampled since: no record. Then the accumulators start over.
    assert poller.export() == []
    fake.push(0, power_mw=50_000, throttle=0x2)
    poller.sample()
    [rec] = poller.export()
    assert rec["power_w"] == 50.0 and rec["throttle_reasons"] == 0x2


def test_placement_and_identity_with_hw_id_keys():
    fake = FakeNvml([b"GPU-a", "GPU-b"])  # real pynvml versions return bytes or str
    poller, out = make(fake, placement=PLACEMENT)
    assert poller.open()
    poller.sample()
    records = poller.export()
    assert [r["hw_id"] for r in records] == ["GPU-a", "GPU-b"]
    assert all((r["project"], r["run_id"], r["attempt"], r["role"], r["rank"]) == ("p", "r1", 2, "actor", 3) for r in records)
    placements = of(out, "Placement")
    assert [(o.key, o.record["hw_id"], o.record["index"]) for o in placements] == [("GPU-a", "GPU-a", 0), ("GPU-b", "GPU-b", 1)]
    assert {o.topic for o in out} == {"t.hardware"}
    codec = Codec()
    for o in out:
        codec.encode(o.schema, [o.record])
    p = placements[0].record
    assert (p["stage"], p["role"], p["rank"], p["pod"], p["node"], p["host"]) == ("rl", "actor", 3, "pod-1", "n1", "h1")
    # Placements go out at every export, with or without new samples.
    out.clear()
    poller.export()
    assert len(of(out, "Placement")) == 2 and of(out, "GpuSample") == []


def test_nvml_init_failure_degrades_with_one_warning(caplog):
    fake = FakeNvml(["GPU-a", "GPU-b"], init_error=NVMLError_LibraryNotFound())
    poller, out = make(fake, placement=PLACEMENT, indices=[0, 1])
    with caplog.at_level(logging.WARNING):
        assert poller.open() is False
        for _ in range(3):
            assert poller.sample() == 0
            poller.export()
        assert poller.start_xid_watch() is False
    assert len(warnings(caplog)) == 1 and "NVML unavailable" in warnings(caplog)[0].getMessage()
    assert of(out, "GpuSample") == []
    first = of(out, "Placement")[:2]
    assert [(o.key, o.record["hw_id"], o.record["index"]) for o in first] == [("h1/0", None, 0), ("h1/1", None, 1)]
    Codec().encode("Placement", [first[0].record])


def test_without_pynvml_and_without_indices_one_placement_keyed_by_host(caplog):
    out: list[Outgoing] = []
    poller = GpuPoller(None, out.append, SETTINGS, host="h1", placement=PLACEMENT, unavailable_reason="pynvml is not installed")
    with caplog.at_level(logging.WARNING):
        assert poller.open() is False
        poller.export()
    assert len(warnings(caplog)) == 1 and "pynvml is not installed" in caplog.text
    [o] = out
    assert (o.schema, o.key, o.record["index"], o.record["hw_id"]) == ("Placement", "h1", None, None)


def test_gpu_whose_uuid_cannot_be_read_gets_no_figures(caplog):
    fake = FakeNvml(["GPU-a", NVMLError_GpuIsLost()])
    poller, out = make(fake, placement=PLACEMENT)
    with caplog.at_level(logging.WARNING):
        assert poller.open()
        poller.sample()
        poller.sample()
        records = poller.export()
    assert len(warnings(caplog)) == 1 and "GPU 1" in caplog.text
    assert [r["hw_id"] for r in records] == ["GPU-a"]
    assert [(o.key, o.record["hw_id"]) for o in of(out, "Placement")] == [("GPU-a", "GPU-a"), ("h1/1", None)]


def test_figure_read_error_skips_that_sample_and_logs_once(caplog):
    fake = FakeNvml(["GPU-a", "GPU-b"])
    not_supported = {"nvmlDeviceGetTemperature": NVMLError_NotSupported()}
    fake.push(0, power_mw=100_000)
    fake.push(0, power_mw=999_000, fail=not_supported)
    fake.push(0, power_mw=999_000, fail=not_supported)
    fake.push(0, power_mw=300_000)
    fake.push(1, power_mw=10_000)
    poller, _ = make(fake)
    poller.open()
    with caplog.at_level(logging.WARNING):
        assert [poller.sample() for _ in range(4)] == [2, 1, 1, 2]
    assert len(warnings(caplog)) == 1 and "temperature" in caplog.text
    a, b = poller.export()
    assert a["power_w"] == 200.0 and b["power_w"] == 10.0


def test_older_binding_falls_back_to_throttle_reasons():
    fake = FakeNvml(["GPU-a"], event_reasons_api=False)
    fake.push(0, throttle=0x8)
    poller, _ = make(fake)
    poller.open()
    poller.sample()
    assert poller.export()[0]["throttle_reasons"] == 0x8


def test_driver_without_clock_event_reasons_falls_back_to_throttle_reasons(caplog):
    fake = FakeNvml(["GPU-a"])
    fake.push(0, throttle=0x4, fail={"nvmlDeviceGetCurrentClocksEventReasons": NVMLError_FunctionNotFound()})
    poller, _ = make(fake)
    poller.open()
    with caplog.at_level(logging.WARNING):
        poller.sample()
        poller.sample()
    assert warnings(caplog) == [] and poller.export()[0]["throttle_reasons"] == 0x4
    assert fake.cursors[("nvmlDeviceGetCurrentClocksEventReasons", 0)] == 1  # tried once only


def test_real_pynvml_module_never_raises(caplog):
    pynvml = pytest.importorskip("pynvml")
    out: list[Outgoing] = []
    poller = GpuPoller(pynvml, out.append, SETTINGS, placement=PLACEMENT, xid_wait_ms=10)
    with caplog.at_level(logging.WARNING):
        opened = poller.open()  # False on a machine without the NVIDIA driver
        poller.start_xid_watch()
        poller.sample()
        records = poller.export()
        poller.close()
    codec = Codec()
    for o in out:
        codec.encode(o.schema, [o.record])
    if not opened:
        assert len(warnings(caplog)) == 1 and records == [] and of(out, "Placement")[0].record["hw_id"] is None
    else:
        assert all(r["hw_id"] and r["memory_total_bytes"] > 0 for r in records)


def test_xids_counted_from_zero_and_published_at_once(caplog):
    fake = FakeNvml(["GPU-a", "GPU-b"])
    fake.push(0, power_mw=100_000, temp_c=70)
    poller, out = make(fake, placement=PLACEMENT)
    poller.open()
    with caplog.at_level(logging.WARNING):
        assert poller.start_xid_watch(wait_ms=2)
        fake.xid(1, 48)  # before any sample of GPU b: zeros
        wait_for(lambda: len(out) == 1)
        poller.sample()
        fake.xid(0, 79)
        wait_for(lambda: len(out) == 2)
        fake.xid(0, 31)
        wait_for(lambda: len(out) == 3)
        poller.stop()
    assert poller._xid_thread is None
    b, a1, a2 = (o.record for o in out)
    assert (b["hw_id"], b["xid_errors"], b["xid_last"], b["power_w"], b["memory_total_bytes"]) == ("GPU-b", 1, 48, 0.0, 0)
    assert (a1["xid_errors"], a1["xid_last"], a2["xid_errors"], a2["xid_last"]) == (1, 79, 2, 31)
    assert a2["power_w"] == 100.0 and a2["temperature_c"] == 70.0  # the latest figures it has
    assert [o.key for o in out] == ["GPU-b", "GPU-a", "GPU-a"]
    assert "XID 79 (hardware: GPU has fallen off the bus (PCIe)) on GPU GPU-a (index 0)" in caplog.text
    codec = Codec()
    for rec in (b, a1, a2):
        codec.encode("GpuSample", [rec])
    # The next export carries the counts.
    poller.sample()
    a, b = poller.export()
    assert (a["xid_errors"], a["xid_last"], b["xid_errors"], b["xid_last"]) == (2, 31, 1, 48)


def test_xid_registration_not_supported_on_one_gpu(caplog):
    fake = FakeNvml(["GPU-a", "GPU-b"], register_error={1: NVMLError_NotSupported()})
    poller, out = make(fake)
    poller.open()
    with caplog.at_level(logging.WARNING):
        assert poller.start_xid_watch(wait_ms=2)
        fake.xid(0, 13)
        wait_for(lambda: len(out) == 1)
        poller.stop()
    assert fake.registered == [0]
    assert len(warnings(caplog)) == 2  # the registration failure, then the XID itself
    assert "GPU 1" in warnings(caplog)[0].getMessage()


def test_xid_wait_error_stops_watching_after_one_line(caplog):
    fake = FakeNvml(["GPU-a"])
    poller, out = make(fake)
    poller.open()
    with caplog.at_level(logging.WARNING):
        poller.start_xid_watch(wait_ms=2)
        fake.push_event(NVMLError_GpuIsLost())
        thread = poller._xid_thread
        thread.join(2.0)
        assert not thread.is_alive()
        fake.xid(0, 79)  # nobody watches any more
        time.sleep(0.005)
    assert out == [] and len(warnings(caplog)) == 1 and "no longer watching XIDs" in caplog.text
    poller.stop()


def test_run_samples_and_exports_until_stopped():
    fake = FakeNvml(["GPU-a"])
    poller, out = make(fake, placement=PLACEMENT, sample_interval_s=0.001, export_interval_s=0.004)
    stop = threading.Event()
    thread = threading.Thread(target=poller.run, args=(stop,))
    thread.start()
    wait_for(lambda: len(of(out, "GpuSample")) >= 2)
    stop.set()
    thread.join(2.0)
    assert not thread.is_alive() and poller._xid_thread is None
    assert of(out, "Placement")[0].record["hw_id"] == "GPU-a"


def test_run_with_stop_already_set_exports_the_partial_interval():
    fake = FakeNvml(["GPU-a"])
    fake.push(0, power_mw=123_000)
    poller, out = make(fake, placement=PLACEMENT)
    stop = threading.Event()
    stop.set()
    poller.run(stop)
    # Placements at once, one sample, then the final export with that sample.
    assert [o.schema for o in out] == ["Placement", "GpuSample", "Placement"]
    assert out[1].record["power_w"] == 123.0


def test_main_wires_a_sender_and_returns_zero(monkeypatch):
    class FakeSender:
        def __init__(self, settings):
            self.offered: list[Outgoing] = []
            self.closed = False
            created.append(self)

        def start(self):
            pass

        def offer(self, item):
            self.offered.append(item)
            return True

        def close(self, timeout=30.0):
            self.closed = True
            return 0

    created: list[FakeSender] = []
    monkeypatch.setattr(gpu_poller, "Sender", FakeSender)
    stop = threading.Event()
    stop.set()
    fake = FakeNvml(["GPU-a"])
    rc = gpu_poller.main(
        SETTINGS, indices=[0], run_id="r1", attempt=1, role="trainer", rank=0, project="p", nvml_module=fake, stop=stop
    )
    [sender] = created
    assert rc == 0 and sender.closed and not fake.initialised  # NVML shut down
    assert {o.schema for o in sender.offered} == {"Placement", "GpuSample"}


def test_throttle_mask_with_the_top_bit_still_encodes():
    fake = FakeNvml(["GPU-a"])
    fake.push(0, throttle=(1 << 63) | 0x8)
    poller, _ = make(fake)
    poller.open()
    poller.sample()
    [rec] = poller.export()
    Codec().encode("GpuSample", [rec])
    assert rec["throttle_reasons"] & 0x8 and rec["throttle_reasons"] < 0
