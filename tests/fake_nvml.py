"""A FAKE of the ``pynvml`` module for tests: same function names and return shapes, scripted.

Each figure function has its own per-GPU cursor: its n-th call returns the n-th pushed sample
(the last one repeats). A sample's ``fail`` maps a function name to the error that call raises
instead. XIDs pushed with :meth:`FakeNvml.xid` come out of ``nvmlEventSetWait_v2``.

The fake mirrors the real module (nvidia-ml-py 13.615's ``pynvml``, a dev dependency): its errors ARE
pynvml's classes (``NVMLError(code)`` gives the code's subclass, as pynvml's ``NVMLError.__new__`` maps it;
a bad index raises ``NVMLError_InvalidArgument``), its constants are pynvml's values, its functions have
pynvml's names and parameters, and what they return has the fields of pynvml's ctypes structures (the
structures themselves where the fake can fill them). tests/unit/producers/pollers/test_fake_nvml.py checks
all of it against the installed pynvml.

What a GPU cannot do is scripted as the real library answers it:
``unsupported[index]`` names the C functions that GPU refuses (``NVMLError_NotSupported``, as an
Ampere GPU answers the GPM calls) and the field ids it refuses (the call succeeds, that field's
``nvmlReturn`` is ``NVML_ERROR_NOT_SUPPORTED``); ``driver_lacks`` names C functions the driver does
not export (``NVMLError_FunctionNotFound`` on every GPU, as pynvml's ``_nvmlGetFunctionPointer``
raises for a driver older than the binding). ``nvmlGpmQueryDeviceSupport`` answers
``isSupportedDevice`` 0 for a GPU with ``"nvmlGpmSampleGet"`` in its ``unsupported``.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

# pynvml's own classes: what the poller catches is what the real library raises
NVMLError = pynvml.NVMLError
NVMLError_Timeout = pynvml.NVMLError_Timeout
NVMLError_NotSupported = pynvml.NVMLError_NotSupported
NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
NVMLError_FunctionNotFound = pynvml.NVMLError_FunctionNotFound  # a binding newer than the driver
NVMLError_InvalidArgument = pynvml.NVMLError_InvalidArgument

NVML_SUCCESS = pynvml.NVML_SUCCESS
NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED


@dataclass
class FakeSample:
    power_mw: int = 100_000
    temp_c: int = 50
    util_gpu: int = 0  # percent, as NVML reports it
    util_memory: int = 0
    mem_used: int = 0  # as memory v2 reports it: without the driver's reserved memory
    mem_reserved: int = 0  # v2's ``reserved``; v1's ``used`` includes it
    mem_total: int = 80 * 2**30
    sm_clock: int = 1500
    throttle: int = 0
    energy_mj: int = 0  # nvmlDeviceGetTotalEnergyConsumption: a counter
    nvlink_tx_kib: int = 0  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, all links: a counter in KiB
    nvlink_rx_kib: int = 0
    field_time_us: int | None = None  # the field values' timestamp; None: 5 s per call
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)  # correctable, uncorrectable, pending, failure
    tensor_pct: float = 0.0  # GPM ANY_TENSOR_UTIL over the interval ending at this sample, percent
    dram_pct: float = 0.0  # GPM DRAM_BW_UTIL, percent
    fail: dict[str, Exception] = field(default_factory=dict)  # function name -> error


@dataclass(frozen=True)
class FakeHandle:
    index: int


@dataclass
class FakeGpmSample:  # c_nvmlGpmSample_t: an opaque handle NVML fills
    handle: FakeHandle | None = None
    sample: FakeSample | None = None
    freed: bool = False


@dataclass
class FakeGpmMetric:  # c_nvmlGpmMetric_t
    metricId: int = 0
    nvmlReturn: int = 0
    value: float = 0.0
    metricInfo: Any = None


class c_nvmlGpmMetricsGet_t:  # the caller builds it, as with the real structure
    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: FakeGpmSample | None = None
        self.sample2: FakeGpmSample | None = None
        self.metrics = [FakeGpmMetric() for _ in range(FakeNvml.NVML_GPM_METRIC_MAX)]


ERRORS = ("NVMLError", "NVMLError_Timeout", "NVMLError_NotSupported", "NVMLError_LibraryNotFound", "NVMLError_GpuIsLost",
          "NVMLError_FunctionNotFound", "NVMLError_InvalidArgument")
CONSTANTS = ("NVML_ERROR_TIMEOUT", "NVML_TEMPERATURE_GPU", "NVML_CLOCK_SM", "nvmlEventTypeXidCriticalError", "NVML_SUCCESS",
             "NVML_ERROR_NOT_SUPPORTED", "nvmlMemory_v2", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX",
             "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
             "NVML_GPM_METRIC_DRAM_BW_UTIL", "NVML_GPM_METRIC_MAX", "NVML_GPM_METRICS_GET_VERSION", "NVML_GPM_SUPPORT_VERSION")


class FakeNvml:
    NVMLError = NVMLError
    NVMLError_Timeout = NVMLError_Timeout
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVMLError_InvalidArgument = NVMLError_InvalidArgument
    NVML_ERROR_TIMEOUT = pynvml.NVML_ERROR_TIMEOUT
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError
    NVML_SUCCESS = NVML_SUCCESS
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    nvmlMemory_v2 = pynvml.nvmlMemory_v2
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
    NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    NVML_GPM_METRIC_ANY_TENSOR_UTIL = pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL
    NVML_GPM_METRIC_DRAM_BW_UTIL = pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL
    NVML_GPM_METRIC_MAX = pynvml.NVML_GPM_METRIC_MAX
    NVML_GPM_METRICS_GET_VERSION = pynvml.NVML_GPM_METRICS_GET_VERSION
    NVML_GPM_SUPPORT_VERSION = pynvml.NVML_GPM_SUPPORT_VERSION
    c_nvmlGpmMetricsGet_t = c_nvmlGpmMetricsGet_t

    def __init__(self, uuids: list[str | bytes | Exception], *, init_error: Exception | None = None,
                 register_error: dict[int, Exception] | None = None, event_reasons_api: bool = True,
                 unsupported: dict[int, set[str | int]] | None = None, driver_lacks: set[str] | None = None):
        self.uuids = uuids  # an Exception entry: that GPU's UUID read raises it
        self.unsupported = unsupported or {}
        self.driver_lacks = driver_lacks or set()
        self.calls: dict[tuple[str, int], int] = {}  # (C function, GPU index) -> calls, refused ones too
        self.gpm_samples: list[FakeGpmSample] = []
        self.init_error = init_error
        self.register_error = register_error or {}
        self.samples: dict[int, list[FakeSample]] = {i: [] for i in range(len(uuids))}
        self.cursors: dict[tuple[str, int], int] = {}
        self.events: deque[Any] = deque()  # scripted XID event data, or an Exception to raise
        self.event_ready = threading.Condition()
        self.registered: list[int] = []
        self.initialised = False
        if not event_reasons_api:  # an older driver/binding: only the deprecated name exists
            self.nvmlDeviceGetCurrentClocksEventReasons = None

    # -- scripting ---------------------------------------------------------------------------
    def push(self, index: int, **figures: Any) -> None:
        self.samples[index].append(FakeSample(**figures))

    def xid(self, index: int, code: int) -> None:
        self.push_event(SimpleNamespace(device=FakeHandle(index), eventType=self.nvmlEventTypeXidCriticalError,
                                        eventData=code, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF))

    def push_event(self, event: Any) -> None:
        with self.event_ready:
            self.events.append(event)
            self.event_ready.notify_all()

    def _check(self, fn: str, handle: FakeHandle | None) -> None:
        """Raise as the real library does for a function the driver lacks or the GPU refuses."""
        index = handle.index if handle is not None else -1
        self.calls[(fn, index)] = self.calls.get((fn, index), 0) + 1
        if fn in self.driver_lacks:
            raise NVMLError_FunctionNotFound()
        if handle is not None and fn in self.unsupported.get(handle.index, ()):
            raise NVMLError_NotSupported()

    def _sample(self, fn: str, handle: FakeHandle) -> FakeSample:
        self._check(fn, handle)
        queue = self.samples[handle.index] or [FakeSample()]
        n = self.cursors.get((fn, handle.index), 0)
        self.cursors[(fn, handle.index)] = n + 1
        sample = queue[min(n, len(queue) - 1)]
        if fn in sample.fail:
            raise sample.fail[fn]
        return sample

    # -- the pynvml API the poller uses --------------------------------------------------------
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        if not 0 <= index < len(self.uuids):
            raise NVMLError_InvalidArgument()  # NVML_ERROR_INVALID_ARGUMENT, as nvmlDeviceGetHandleByIndex_v2 answers
        return FakeHandle(index)

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str | bytes:
        uuid = self.uuids[handle.index]
        if isinstance(uuid, Exception):
            raise uuid
        return uuid

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        return self._sample("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._sample("nvmlDeviceGetTemperature", handle).temp_c

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> pynvml.c_nvmlUtilization_t:
        s = self._sample("nvmlDeviceGetUtilizationRates", handle)
        return pynvml.c_nvmlUtilization_t(gpu=s.util_gpu, memory=s.util_memory)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: int | None = None) -> Any:
        # As pynvml: no version -> c_nvmlMemory_t from nvmlDeviceGetMemoryInfo (used includes the
        # reserved memory); a version -> c_nvmlMemory_v2_t from nvmlDeviceGetMemoryInfo_v2.
        if not version:
            s = self._sample("nvmlDeviceGetMemoryInfo", handle)
            used = s.mem_used + s.mem_reserved
            return pynvml.c_nvmlMemory_t(total=s.mem_total, free=s.mem_total - used, used=used)
        s = self._sample("nvmlDeviceGetMemoryInfo_v2", handle)
        return pynvml.c_nvmlMemory_v2_t(version=version, total=s.mem_total, reserved=s.mem_reserved,
                                        free=s.mem_total - s.mem_reserved - s.mem_used, used=s.mem_used)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeHandle) -> int:  # millijoules
        return self._sample("nvmlDeviceGetTotalEnergyConsumption", handle).energy_mj

    def nvmlDeviceGetRemappedRows(self, device: FakeHandle) -> tuple[int, int, int, int]:
        return self._sample("nvmlDeviceGetRemappedRows", device).remapped_rows

    def nvmlDeviceGetFieldValues(self, handle: FakeHandle, fieldIds: list[Any]) -> list[pynvml.c_nvmlFieldValue_t]:
        n = self.cursors.get(("nvmlDeviceGetFieldValues", handle.index), 0)
        s = self._sample("nvmlDeviceGetFieldValues", handle)
        counters = {self.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: s.nvlink_tx_kib,
                    self.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: s.nvlink_rx_kib}
        out = []
        for item in fieldIds:  # an id, or (id, scopeId) as pynvml takes them
            field_id, scope = item if isinstance(item, tuple) else (item, 0)
            refused = field_id in self.unsupported.get(handle.index, ()) or field_id not in counters
            out.append(pynvml.c_nvmlFieldValue_t(
                fieldId=field_id, scopeId=scope, latencyUsec=0,
                timestamp=s.field_time_us if s.field_time_us is not None else n * 5_000_000,
                valueType=self.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
                nvmlReturn=NVML_ERROR_NOT_SUPPORTED if refused else NVML_SUCCESS,
                value=pynvml.c_nvmlValue_t(ullVal=0 if refused else counters[field_id])))
        return out

    # -- GPM (Hopper and newer) ----------------------------------------------------------------
    def nvmlGpmQueryDeviceSupport(self, device: FakeHandle) -> pynvml.c_nvmlGpmSupport_t:
        self._check("nvmlGpmQueryDeviceSupport", device)
        refused = "nvmlGpmSampleGet" in self.unsupported.get(device.index, ())
        return pynvml.c_nvmlGpmSupport_t(version=self.NVML_GPM_SUPPORT_VERSION, isSupportedDevice=0 if refused else 1)

    def nvmlGpmSampleAlloc(self) -> FakeGpmSample:
        self._check("nvmlGpmSampleAlloc", None)
        sample = FakeGpmSample()
        self.gpm_samples.append(sample)
        return sample

    def nvmlGpmSampleFree(self, gpmSample: FakeGpmSample) -> None:
        gpmSample.freed = True

    def nvmlGpmSampleGet(self, device: FakeHandle, gpmSample: FakeGpmSample) -> FakeGpmSample:
        assert not gpmSample.freed, "a freed GPM sample was used"
        gpmSample.handle, gpmSample.sample = device, self._sample("nvmlGpmSampleGet", device)
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: c_nvmlGpmMetricsGet_t) -> c_nvmlGpmMetricsGet_t:
        self._check("nvmlGpmMetricsGet", None)
        first, second = metricsGet.sample1, metricsGet.sample2
        assert metricsGet.version == self.NVML_GPM_METRICS_GET_VERSION
        assert first is not None and second is not None and first.sample is not None and second.sample is not None
        assert first.handle == second.handle and first is not second, "GPM metrics need two samples of one GPU"
        values = {self.NVML_GPM_METRIC_ANY_TENSOR_UTIL: second.sample.tensor_pct,
                  self.NVML_GPM_METRIC_DRAM_BW_UTIL: second.sample.dram_pct}
        for metric in metricsGet.metrics[:metricsGet.numMetrics]:
            if metric.metricId in values:
                metric.nvmlReturn, metric.value = NVML_SUCCESS, values[metric.metricId]
            else:
                metric.nvmlReturn, metric.value = NVML_ERROR_NOT_SUPPORTED, 0.0
        return metricsGet

    def nvmlDeviceGetClockInfo(self, handle: FakeHandle, type: int) -> int:  # noqa: A002 - pynvml's name
        assert type == self.NVML_CLOCK_SM
        return self._sample("nvmlDeviceGetClockInfo", handle).sm_clock

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        return self._sample("nvmlDeviceGetCurrentClocksEventReasons", handle).throttle

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeHandle) -> int:
        return self._sample("nvmlDeviceGetCurrentClocksThrottleReasons", handle).throttle

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, eventTypes: int, eventSet: object) -> None:
        if handle.index in self.register_error:
            raise self.register_error[handle.index]
        self.registered.append(handle.index)

    def nvmlEventSetWait_v2(self, eventSet: object, timeoutms: int) -> Any:
        with self.event_ready:
            if not self.events:  # capped: an early timeout is harmless and keeps stop() quick in tests
                self.event_ready.wait(min(timeoutms, 5) / 1000.0)
            if not self.events:
                raise NVMLError_Timeout()
            event = self.events.popleft()
        if isinstance(event, Exception):
            raise event
        return event

    def nvmlEventSetFree(self, eventSet: object) -> None:
        pass
