"""One NVML reading of one GPU, and the summary of an export's readings (the GPU poller's figures).

Core figures (power, temperature, utilization, memory, SM clock, throttle reasons): a reading
needs all of them; one that fails skips that sample (logged once per GPU and figure).

Optional figures, DCGM's defaults where NVML has them: the energy counter, NVLink throughput,
remapped rows and GPM's tensor-pipe and DRAM activity. Each is read on its own: one that fails
leaves that figure null and the others as they are. A GPU or driver that does not have one
(``NVMLError_NotSupported``, ``NVMLError_FunctionNotFound``, a field or metric answered
NOT_SUPPORTED, GPM on a GPU older than Hopper) is logged once at INFO and never asked again;
any other error is logged once per GPU and figure and asked again at the next sample.

Memory is read as NVML memory v2 where the driver has it (``used`` without the memory the
driver reserves, as nvidia-smi and DCGM show it; ``reserved`` recorded), else as v1.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any
from collections.abc import Callable

from rlpulse.base.errors import Error
from rlpulse.schemas.gpu_health import throttle_reason_names

log = logging.getLogger(__name__)

ALL_LINKS = 0xFFFFFFFF  # scopeId UINT_MAX: NVLink throughput summed over every link (nvml.h)
KIB = 1024


@dataclass(frozen=True)
class Reading:
    power_w: float
    temperature_c: float
    gpu_utilization: float
    memory_activity: float
    memory_used_bytes: int
    memory_total_bytes: int
    sm_clock_mhz: float
    throttle_reasons: int
    memory_reserved_bytes: int | None = None
    energy_mj: int | None = None
    nvlink: tuple[int, int, int] | None = None  # NVML's (timestamp us, TX KiB, RX KiB) counters
    remapped_rows: tuple[int, int, int, int] | None = None  # correctable, uncorrectable, pending, failure
    tensor_activity: float | None = None  # fraction, over the interval since the previous reading
    dram_activity: float | None = None
    # set by ``summarize`` only: bytes/s over the export interval, from the counters
    nvlink_tx_bytes_per_s: float | None = None
    nvlink_rx_bytes_per_s: float | None = None


ZERO = Reading(0.0, 0.0, 0.0, 0.0, 0, 0, 0.0, 0)


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def summarize(readings: list[Reading], before: Reading | None) -> Reading:
    """Seed 001: mean of power, utilization, memory activity and clock (and GPM's activities); OR of
    the masks; latest of the rest. NVLink: bytes/s from the counters' difference between the last
    reading before this export's (``before``; else its own first) and its last."""
    n, mask = len(readings), 0
    for r in readings:
        mask |= r.throttle_reasons
    last = readings[-1]
    tx = rx = None
    first = next((r.nvlink for r in ([before] if before else []) + readings if r.nvlink is not None), None)
    if first is not None and last.nvlink is not None and first is not last.nvlink:
        (t0, tx0, rx0), (t1, tx1, rx1) = first, last.nvlink
        # A counter that went back (driver reload) or no time between them: no rate, not a wrong one.
        if t1 > t0 and tx1 >= tx0 and rx1 >= rx0:
            seconds = (t1 - t0) / 1e6
            tx, rx = (tx1 - tx0) * KIB / seconds, (rx1 - rx0) * KIB / seconds
    return replace(last, power_w=sum(r.power_w for r in readings) / n,
                   gpu_utilization=sum(r.gpu_utilization for r in readings) / n,
                   memory_activity=sum(r.memory_activity for r in readings) / n,
                   sm_clock_mhz=sum(r.sm_clock_mhz for r in readings) / n, throttle_reasons=mask,
                   tensor_activity=_mean([r.tensor_activity for r in readings]),
                   dram_activity=_mean([r.dram_activity for r in readings]),
                   nvlink_tx_bytes_per_s=tx, nvlink_rx_bytes_per_s=rx)


def signed64(mask: int) -> int:
    """An NVML 64-bit mask as an Avro long (signed): every bit kept, two's complement."""
    mask &= 0xFFFF_FFFF_FFFF_FFFF
    return mask - (1 << 64) if mask >= 1 << 63 else mask


def figures(r: Reading) -> dict[str, Any]:
    """A reading's fields of the ``GpuSample`` record."""
    total, remap = r.memory_total_bytes, r.remapped_rows
    return {
        "power_w": r.power_w,
        "temperature_c": r.temperature_c,
        "gpu_utilization": r.gpu_utilization,
        "memory_used_bytes": r.memory_used_bytes,
        "memory_total_bytes": total,
        "memory_utilization": r.memory_used_bytes / total if total > 0 else 0.0,
        "memory_activity": r.memory_activity,
        "sm_clock_mhz": r.sm_clock_mhz,
        "throttle_reasons": signed64(r.throttle_reasons),
        "throttle_reason_names": throttle_reason_names(r.throttle_reasons),
        "memory_reserved_bytes": r.memory_reserved_bytes,
        "energy_mj": r.energy_mj,
        "nvlink_tx_bytes_per_s": r.nvlink_tx_bytes_per_s,
        "nvlink_rx_bytes_per_s": r.nvlink_rx_bytes_per_s,
        "remapped_rows_correctable": remap[0] if remap else None,
        "remapped_rows_uncorrectable": remap[1] if remap else None,
        "remap_pending": bool(remap[2]) if remap else None,
        "remap_failure": bool(remap[3]) if remap else None,
        "tensor_activity": r.tensor_activity,
        "dram_activity": r.dram_activity,
    }


class Absent(Error, LookupError):
    """NVML answered that this GPU or driver does not have the figure: do not ask again."""


class NvmlReader:
    """Reads GPUs through one NVML module (pynvml, or the tests' fake); keeps what each GPU lacks."""

    def __init__(self, nvml: Any):
        self._nv = nvml
        self._error: type[BaseException] = getattr(nvml, "NVMLError", Exception)
        # The errors that mean "not here" rather than "not now".
        self._absent = tuple(c for c in (getattr(nvml, "NVMLError_NotSupported", None),
                                         getattr(nvml, "NVMLError_FunctionNotFound", None)) if c is not None)
        self._not_supported = getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3)
        self._success = getattr(nvml, "NVML_SUCCESS", 0)
        self._logged: set[tuple[int, str]] = set()  # (GPU index, figure): an error already logged
        self._lacks: set[tuple[int, str]] = set()  # (GPU index, figure): not asked again
        self._old_driver = False  # no nvmlDeviceGetCurrentClocksEventReasons: the deprecated name
        self._gpm: dict[int, list[Any]] = {}  # GPU index -> [previous sample, spare sample, previous is filled]

    def read(self, index: int, uuid: str | None, handle: Any) -> Reading | None:
        """One reading; None when a core figure cannot be read (that sample is skipped)."""
        nv, h = self._nv, handle
        reads: dict[str, Callable[[], Any]] = {
            "power": lambda: nv.nvmlDeviceGetPowerUsage(h),
            "temperature": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
            "utilization": lambda: nv.nvmlDeviceGetUtilizationRates(h),
            "memory": lambda: self._memory(index, uuid, h),
            "sm_clock": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
            "throttle_reasons": lambda: self._throttle_reasons(h),
        }
        # Read every figure even after one fails, so each failing figure is named (once) in the log.
        values: dict[str, Any] = {}
        for figure, read in reads.items():
            try:
                values[figure] = read()
            except self._error as exc:
                self._log_once(index, figure, logging.WARNING, "GPU %d (%s): cannot read %s (%s); skipping its "
                               "samples while this lasts", index, uuid, figure, exc)
        if len(values) < len(reads):
            return None
        util, (total, used, reserved) = values["utilization"], values["memory"]
        gpm = self._optional(index, uuid, "tensor/DRAM activity (GPM)", lambda: self._gpm_read(index, h))
        # NVML reports milliwatts and percent.
        return Reading(
            values["power"] / 1000.0, float(values["temperature"]), util.gpu / 100.0, util.memory / 100.0,
            used, total, float(values["sm_clock"]), int(values["throttle_reasons"]),
            memory_reserved_bytes=reserved,
            energy_mj=self._optional(index, uuid, "energy", lambda: int(nv.nvmlDeviceGetTotalEnergyConsumption(h))),
            nvlink=self._optional(index, uuid, "NVLink throughput", lambda: self._nvlink(h)),
            remapped_rows=self._optional(index, uuid, "remapped rows",
                                         lambda: tuple(int(v) for v in nv.nvmlDeviceGetRemappedRows(h))),
            tensor_activity=gpm[0] if gpm else None, dram_activity=gpm[1] if gpm else None,
        )

    def close(self) -> None:
        """Free the GPM samples (before NVML shuts down)."""
        for previous, spare, _ in self._gpm.values():
            for sample in (previous, spare):
                try:
                    self._nv.nvmlGpmSampleFree(sample)
                except Exception:  # best effort: NVML may already be down
                    pass
        self._gpm.clear()

    # -- core ------------------------------------------------------------------------------
    def _memory(self, index: int, uuid: str | None, handle: Any) -> tuple[int, int, int | None]:
        nv = self._nv
        version = getattr(nv, "nvmlMemory_v2", None)  # bindings older than v2 lack it
        if version is not None and (index, "memory v2") not in self._lacks:
            try:
                m = nv.nvmlDeviceGetMemoryInfo(handle, version=version)
                return int(m.total), int(m.used), int(m.reserved)
            except self._error as exc:  # any NVML error of the v2 call (NotSupported, a version mismatch):
                # v1 still answers, and one v2 error must not cost every sample of the GPU
                self._lacks.add((index, "memory v2"))
                log.info("GPU %d (%s): no NVML memory v2 (%s); memory from v1, whose used includes the "
                         "driver's reserved memory", index, uuid, exc)
        m = nv.nvmlDeviceGetMemoryInfo(handle)
        return int(m.total), int(m.used), None

    def _throttle_reasons(self, handle: Any) -> int:
        nv = self._nv
        # The newer name; bindings or drivers older than it only have the deprecated one.
        event_reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if event_reasons is not None and not self._old_driver:
            try:
                return event_reasons(handle)
            except getattr(nv, "NVMLError_FunctionNotFound", ()):
                self._old_driver = True
        return nv.nvmlDeviceGetCurrentClocksThrottleReasons(handle)

    # -- optional --------------------------------------------------------------------------
    def _optional(self, index: int, uuid: str | None, figure: str, read: Callable[[], Any]) -> Any:
        if (index, figure) in self._lacks:
            return None
        try:
            return read()
        except (Absent, *self._absent) as exc:
            self._lacks.add((index, figure))
            log.info("GPU %d (%s): NVML has no %s here (%s: %s); it stays null", index, uuid, figure,
                     type(exc).__name__, exc)
        except self._error as exc:
            self._log_once(index, figure, logging.WARNING, "GPU %d (%s): cannot read %s (%s); null while this lasts",
                           index, uuid, figure, exc)
        return None

    def _nvlink(self, handle: Any) -> tuple[int, int, int]:
        nv = self._nv
        tx, rx = nv.nvmlDeviceGetFieldValues(handle, [(nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
                                                      (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS)])
        for field in (tx, rx):
            if field.nvmlReturn == self._not_supported:
                raise Absent("field answered NOT_SUPPORTED")  # no NVLink on this GPU
            if field.nvmlReturn != self._success:
                raise self._error(field.nvmlReturn)  # pynvml's NVMLError(value) is that error's class
        return int(tx.timestamp), int(tx.value.ullVal), int(rx.value.ullVal)

    def _gpm_read(self, index: int, handle: Any) -> tuple[float | None, float | None] | None:
        """GPM's metrics over the interval since the previous reading; None at the first."""
        nv = self._nv
        state = self._gpm.get(index)
        if state is None:
            if not nv.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                raise Absent("GPM needs a Hopper or newer GPU")
            state = self._gpm[index] = [nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc(), False]
        previous, current, filled = state
        try:
            nv.nvmlGpmSampleGet(handle, current)
        except Exception:
            state[2] = False  # the spare's content is undefined now: start the pair over
            raise
        state[0], state[1], state[2] = current, previous, True
        if not filled:
            return None
        metrics = nv.c_nvmlGpmMetricsGet_t()
        metrics.version = nv.NVML_GPM_METRICS_GET_VERSION
        metrics.numMetrics = 2
        metrics.sample1, metrics.sample2 = previous, current
        metrics.metrics[0].metricId = nv.NVML_GPM_METRIC_ANY_TENSOR_UTIL
        metrics.metrics[1].metricId = nv.NVML_GPM_METRIC_DRAM_BW_UTIL
        nv.nvmlGpmMetricsGet(metrics)
        tensor, dram = (m.value / 100.0 if m.nvmlReturn == self._success else None for m in metrics.metrics[:2])
        return tensor, dram

    def _log_once(self, index: int, figure: str, level: int, message: str, *args: Any) -> None:
        if (index, figure) not in self._logged:
            self._logged.add((index, figure))
            log.log(level, message, *args)
