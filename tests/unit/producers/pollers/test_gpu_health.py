"""GPU health through the real GPU poller over the fake NVML: every throttle bit by name, XID classes,
memory from NVML v2, and the optional figures (energy, NVLink, remapped rows, GPM) filled or null
per GPU capability; then the alert rules reading those records."""

from __future__ import annotations

import logging
import time

import pytest

from rlpulse.base.settings import AlertThresholds, Settings
from rlpulse.producers.pollers.gpu_poller import GpuPoller, Placement
from rlpulse.producers.sdk.sender import Outgoing
from rlpulse.schemas.codec import Codec
from rlpulse.schemas.gpu_health import THROTTLE_REASONS, throttle_reason_names, xid_class
from rlpulse.streams.alerting import MEANING, AlertBook, hardware
from tests import fake_nvml
from tests.fake_nvml import FakeNvml, NVMLError_GpuIsLost

pytestmark = pytest.mark.full

GiB = 2**30
SETTINGS = Settings(topic_prefix="t")
OPTIONAL = {"nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetRemappedRows", "nvmlGpmSampleGet", 138, 139}
HEALTH = ("energy_mj", "nvlink_tx_bytes_per_s", "nvlink_rx_bytes_per_s", "remapped_rows_correctable",
          "remapped_rows_uncorrectable", "remap_pending", "remap_failure", "tensor_activity", "dram_activity")


def make(fake: FakeNvml) -> tuple[GpuPoller, list[Outgoing]]:
    out: list[Outgoing] = []
    poller = GpuPoller(fake, out.append, SETTINGS, host="h1", clock=lambda: 1_000,
                       placement=Placement(run_id="r1", project="p"), xid_wait_ms=2)
    assert poller.open()
    return poller, out


def exported(poller: GpuPoller, samples: int = 1) -> list[dict]:
    for _ in range(samples):
        poller.sample()
    records = poller.export()
    Codec().encode("GpuSample", records)  # every record is valid Avro
    return records


def health(record: dict) -> tuple:
    return tuple(record[k] for k in HEALTH)


def test_every_bit_has_a_name_and_nvml_agrees():
    pynvml = pytest.importorskip("pynvml")
    for reason in THROTTLE_REASONS:  # the binding's own constants, the new name or the deprecated one
        value = getattr(pynvml, f"nvmlClocksEventReason{reason.nvml}", None)
        assert (value if value is not None else getattr(pynvml, f"nvmlClocksThrottleReason{reason.nvml}")) == reason.bit
    assert sum(r.bit for r in THROTTLE_REASONS) == pynvml.nvmlClocksThrottleReasonAll
    assert throttle_reason_names(0x1 | 0x800) == ["gpu_idle", "bit_0x800"]  # a bit NVML adds later still shows


def test_hw_slowdown_and_hw_thermal_named_on_the_sample_and_in_the_alert():
    fake = FakeNvml(["GPU-a"])
    fake.push(0, throttle=0x8)
    fake.push(0, throttle=0x40 | 0x1)
    poller, _ = make(fake)
    [record] = exported(poller, samples=2)  # the export ORs the two readings' masks
    assert record["throttle_reasons"] == 0x49
    assert record["throttle_reason_names"] == ["gpu_idle", "hw_slowdown", "hw_thermal"]
    book, state = AlertBook({}), {}
    [alert] = hardware(book, state, record, AlertThresholds(), now_ns=5)
    assert (alert["rule"], alert["state"], alert["threshold"]) == ("hw_slowdown", "FIRING", 8.0)
    assert alert["summary"] == "GPU GPU-a clocks held down by the hardware: gpu_idle, hw_slowdown, hw_thermal " \
                               "(throttle reasons 0x49)"
    fake.push(0, throttle=0x20)
    [resolved] = hardware(book, state, exported(poller)[0], AlertThresholds(), now_ns=6)
    assert (resolved["state"], resolved["summary"]) == (
        "RESOLVED", "GPU GPU-a no longer slowed down by the hardware: sw_thermal (throttle reasons 0x20)")
    assert "0x40 hw_thermal" in MEANING["hw_slowdown"] and "0x400 reliability" in MEANING["hw_slowdown"]


@pytest.mark.parametrize("code, klass, words", [
    (31, "application", "GPU memory page fault"),
    (79, "hardware", "GPU has fallen off the bus"),
    (9999, "unknown", ""),
])
def test_xid_class_on_the_record_and_in_the_alert(code, klass, words):
    fake = FakeNvml(["GPU-a"])
    poller, out = make(fake)
    assert poller.start_xid_watch(wait_ms=2)
    fake.xid(0, code)
    deadline = time.monotonic() + 2
    while not out and time.monotonic() < deadline:
        time.sleep(0.001)
    poller.stop()
    [xid] = [o.record for o in out]
    assert (xid["xid_last"], xid["xid_class"]) == (code, klass)
    Codec().encode("GpuSample", [xid])
    [alert] = hardware(AlertBook({}), {}, xid, AlertThresholds(), now_ns=1)
    described = f": {words}" if words else ""
    assert alert["summary"].startswith(f"XID {code} ({klass}{described}")
    assert f"{klass}:" in MEANING["xid"]
    # a poller older than the field: the stream classifies the code itself
    [old] = hardware(AlertBook({}), {}, {**xid, "xid_class": None}, AlertThresholds(), now_ns=1)
    assert old["summary"] == alert["summary"]
    assert xid_class(None) is None and exported(poller, samples=1)[0]["xid_class"] == klass  # kept on later exports


def test_memory_v2_used_excludes_the_reserved_memory():
    fake = FakeNvml(["GPU-a"])
    fake.push(0, mem_used=30 * GiB, mem_reserved=2 * GiB, mem_total=80 * GiB)
    poller, _ = make(fake)
    [record] = exported(poller)
    assert (record["memory_used_bytes"], record["memory_reserved_bytes"]) == (30 * GiB, 2 * GiB)
    assert record["memory_utilization"] == 30 / 80
    assert fake.calls.get(("nvmlDeviceGetMemoryInfo", 0)) is None  # v1 never asked


def test_driver_without_memory_v2_falls_back_to_v1_once(caplog):
    fake = FakeNvml(["GPU-a"], driver_lacks={"nvmlDeviceGetMemoryInfo_v2"})
    fake.push(0, mem_used=30 * GiB, mem_reserved=2 * GiB, mem_total=80 * GiB)
    poller, _ = make(fake)
    with caplog.at_level(logging.INFO):
        [record] = exported(poller, samples=3)
    assert (record["memory_used_bytes"], record["memory_reserved_bytes"]) == (32 * GiB, None)  # v1: reserved in used
    assert fake.calls[("nvmlDeviceGetMemoryInfo_v2", 0)] == 1 and fake.calls[("nvmlDeviceGetMemoryInfo", 0)] == 3
    lines = [r for r in caplog.records if "memory v2" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO


def test_any_nvml_error_of_memory_v2_falls_back_to_v1(monkeypatch):
    """A driver between versions answers the v2 call with another NVML error (pynvml's
    NVMLError_ArgumentVersionMismatch, say): v1 still gives every sample of that GPU."""
    fake = FakeNvml(["GPU-a"])
    fake.push(0, mem_used=30 * GiB, mem_reserved=2 * GiB, mem_total=80 * GiB)
    v1 = fake.nvmlDeviceGetMemoryInfo

    def mismatched(handle, version=None):
        if version:
            raise fake_nvml.NVMLError(25)  # NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        return v1(handle)

    monkeypatch.setattr(fake, "nvmlDeviceGetMemoryInfo", mismatched)
    poller, _ = make(fake)
    [record] = exported(poller, samples=2)
    assert (record["memory_used_bytes"], record["memory_reserved_bytes"]) == (32 * GiB, None)


def test_optional_figures_filled_or_null_per_gpu_capability(caplog):
    # GPU 0 has everything (an H100); GPU 1 none of it (no NVLink, no GPM, no energy or remapping);
    # GPU 2 all but the energy counter: one figure missing takes nothing else with it.
    fake = FakeNvml(["GPU-a", "GPU-b", "GPU-c"],
                    unsupported={1: OPTIONAL, 2: {"nvmlDeviceGetTotalEnergyConsumption"}})
    for gpu in (0, 1, 2):
        for i in range(4):
            fake.push(gpu, energy_mj=1_000 * (i + 1), nvlink_tx_kib=100 * i, nvlink_rx_kib=300 * i,
                      field_time_us=2_000_000 * i, remapped_rows=(3, 1, 0, 1), tensor_pct=10.0 * i, dram_pct=50.0)
    poller, _ = make(fake)
    with caplog.at_level(logging.INFO):
        first = exported(poller, samples=2)
        second = exported(poller, samples=2)
    a, b, c = first
    # GPM: the second reading's interval only; NVLink: 100 KiB in 2 s; the energy counter's latest
    assert health(a) == (2_000, 100 * 1024 / 2, 300 * 1024 / 2, 3, 1, False, True, 0.1, 0.5)
    assert health(b) == (None,) * len(HEALTH)
    assert health(c) == (None, *health(a)[1:])
    a2 = second[0]  # NVLink from the previous export's last reading: 200 KiB in 4 s; GPM the mean of 0.2 and 0.3
    assert a2["nvlink_tx_bytes_per_s"] == 200 * 1024 / 4 and a2["tensor_activity"] == pytest.approx(0.25)
    assert a2["energy_mj"] == 4_000
    # one INFO line per GPU and figure it lacks, however many samples; no warning at all
    lacks = sorted((r.getMessage().split(")")[0], r.getMessage().split("NVML has no ")[1].split(" here")[0])
                   for r in caplog.records if "NVML has no" in r.getMessage())
    assert lacks == sorted([("GPU 1 (GPU-b", f) for f in ("energy", "NVLink throughput", "remapped rows",
                                                            "tensor/DRAM activity (GPM)")] + [("GPU 2 (GPU-c", "energy")])
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert fake.calls[("nvmlDeviceGetTotalEnergyConsumption", 1)] == 1  # not asked again
    poller.close()
    assert len(fake.gpm_samples) == 4 and all(s.freed for s in fake.gpm_samples)  # two per GPU with GPM


def test_a_passing_error_nulls_one_figure_once_and_is_asked_again(caplog):
    fake = FakeNvml(["GPU-a"])
    fake.push(0, energy_mj=10, fail={"nvmlDeviceGetTotalEnergyConsumption": NVMLError_GpuIsLost()})
    fake.push(0, energy_mj=20, fail={"nvmlDeviceGetTotalEnergyConsumption": NVMLError_GpuIsLost()})
    fake.push(0, energy_mj=30)
    poller, _ = make(fake)
    with caplog.at_level(logging.WARNING):
        records = [exported(poller)[0] for _ in range(3)]
    assert [r["energy_mj"] for r in records] == [None, None, 30]
    assert [r["power_w"] for r in records] == [100.0] * 3  # the sample itself stands
    assert len(caplog.records) == 1 and "cannot read energy" in caplog.text


def test_nvlink_counter_that_went_back_gives_no_rate():
    fake = FakeNvml(["GPU-a"])
    for tx in (5_000, 6_000, 10):  # the driver reloaded before the third reading
        fake.push(0, nvlink_tx_kib=tx, nvlink_rx_kib=tx)
    poller, _ = make(fake)
    assert exported(poller)[0]["nvlink_tx_bytes_per_s"] is None  # one reading: no interval yet
    assert exported(poller)[0]["nvlink_tx_bytes_per_s"] == 1_000 * 1024 / 5  # the fake's 5 s a call
    assert exported(poller)[0]["nvlink_tx_bytes_per_s"] is None
