"""A FAKE of the ``pynvml`` module for tests: same function names and return shapes, scripted.

Each figure function has its own per-GPU cursor: its n-th call returns the n-th pushed sample
(the last one repeats). A sample's ``fail`` maps a function name to the error that call raises
instead. XIDs pushed with :meth:`FakeNvml.xid` come out of ``nvmlEventSetWait_v2``.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


class NVMLError(Exception):
    value = 999  # NVML_ERROR_UNKNOWN


class NVMLError_Timeout(NVMLError):
    value = 10


class NVMLError_NotSupported(NVMLError):
    value = 3


class NVMLError_LibraryNotFound(NVMLError):
    value = 12


class NVMLError_GpuIsLost(NVMLError):
    value = 15


class NVMLError_FunctionNotFound(NVMLError):  # a binding newer than the driver
    value = 13


@dataclass
class FakeSample:
    power_mw: int = 100_000
    temp_c: int = 50
    util_gpu: int = 0  # percent, as NVML reports it
    util_memory: int = 0
    mem_used: int = 0
    mem_total: int = 80 * 2**30
    sm_clock: int = 1500
    throttle: int = 0
    fail: dict[str, Exception] = field(default_factory=dict)  # function name -> error


@dataclass(frozen=True)
class FakeHandle:
    index: int


class FakeNvml:
    NVMLError = NVMLError
    NVMLError_Timeout = NVMLError_Timeout
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVML_ERROR_TIMEOUT = 10
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    nvmlEventTypeXidCriticalError = 0x8

    def __init__(self, uuids: list[str | bytes | Exception], *, init_error: Exception | None = None,
                 register_error: dict[int, Exception] | None = None, event_reasons_api: bool = True):
        self.uuids = uuids  # an Exception entry: that GPU's UUID read raises it
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

    def _sample(self, fn: str, handle: FakeHandle) -> FakeSample:
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
            raise NVMLError()  # the real one raises NVMLError_InvalidArgument
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

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> SimpleNamespace:  # c_nvmlUtilization_t
        s = self._sample("nvmlDeviceGetUtilizationRates", handle)
        return SimpleNamespace(gpu=s.util_gpu, memory=s.util_memory)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle) -> SimpleNamespace:  # c_nvmlMemory_t
        s = self._sample("nvmlDeviceGetMemoryInfo", handle)
        return SimpleNamespace(total=s.mem_total, free=s.mem_total - s.mem_used, used=s.mem_used)

    def nvmlDeviceGetClockInfo(self, handle: FakeHandle, clock_type: int) -> int:
        assert clock_type == self.NVML_CLOCK_SM
        return self._sample("nvmlDeviceGetClockInfo", handle).sm_clock

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        return self._sample("nvmlDeviceGetCurrentClocksEventReasons", handle).throttle

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeHandle) -> int:
        return self._sample("nvmlDeviceGetCurrentClocksThrottleReasons", handle).throttle

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, event_types: int, event_set: object) -> None:
        if handle.index in self.register_error:
            raise self.register_error[handle.index]
        self.registered.append(handle.index)

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> Any:
        with self.event_ready:
            if not self.events:  # capped: an early timeout is harmless and keeps stop() quick in tests
                self.event_ready.wait(min(timeout_ms, 5) / 1000.0)
            if not self.events:
                raise NVMLError_Timeout()
            event = self.events.popleft()
        if isinstance(event, Exception):
            raise event
        return event

    def nvmlEventSetFree(self, event_set: object) -> None:
        pass
