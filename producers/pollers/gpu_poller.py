"""GPU poller: NVML samples -> ``GpuSample`` and ``Placement`` records on the hardware topic.

Semantics from seed 001, "GPU health": sample every 5 s; at each export, power, GPU
utilization, memory activity and SM clock are the mean of the samples since the previous
export, throttle reasons the OR of every sample's mask, the rest the latest sample. XIDs are
counted from 0 and published at once, with their class (``rlpulse.schemas.gpu_health``). If NVML
cannot be read: one log line, placements without ``hw_id``, no figures. What one reading holds,
and the optional figures NVML may lack: ``rlpulse.producers.pollers.nvml_reads``.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

from rlpulse.producers.pollers.nvml_reads import ZERO, NvmlReader, Reading, figures, summarize
from rlpulse.producers.sdk.sender import Outgoing, Sender
from rlpulse.base.settings import Settings
from rlpulse.schemas.gpu_health import xid_class, xid_description

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """The run a process's GPUs are held for; published with each export."""

    run_id: str
    attempt: int = 1
    role: str = "trainer"  # seed 001: a process that trains in one process uses role trainer
    rank: int = 0
    project: str = ""
    stage: str = ""


@dataclass
class _Gpu:
    index: int
    handle: Any = None
    uuid: str | None = None  # None: unreadable -> placement without hw_id, no figures
    pending: list[Reading] = field(default_factory=list)  # samples since the previous export
    last: Reading | None = None  # kept across exports: an XID record reports it
    exported: Reading | None = None  # the last reading of the previous export: NVLink counters' base
    xid_errors: int = 0
    xid_last: int | None = None


def _handle_key(handle: Any) -> Any:
    # Real pynvml handles are ctypes pointers that compare by identity, and event data carries
    # a new pointer object: match on the address. Fakes use plain hashable handles.
    try:
        return ctypes.addressof(handle.contents)
    except (AttributeError, TypeError, ValueError):
        return handle


class GpuPoller:
    """Reads NVML for the GPUs of this process and publishes through ``publish`` (``Sender.offer``).

    ``sample``/``export`` run on the caller's thread; the XID watcher runs on its own, so the
    per-GPU state is guarded by one lock.
    """

    def __init__(
        self, nvml: Any, publish: Callable[[Outgoing], object], settings: Settings, *,
        indices: list[int] | None = None, sample_interval_s: float = 5.0, export_interval_s: float = 15.0,
        host: str = socket.gethostname(), node: str = "", pod: str = "", placement: Placement | None = None,
        clock: Callable[[], int] = time.time_ns,
        xid_wait_ms: int = 500,  # one NVML wait: how long stop() may take to end the XID thread
        unavailable_reason: str = "",  # why ``nvml`` is None, for the one warning
    ):
        self._nvml, self._publish, self._topic = nvml, publish, settings.topic("hardware")
        self._indices = list(indices) if indices is not None else None
        self.sample_interval_s, self.export_interval_s = sample_interval_s, export_interval_s
        self.host, self.node, self.pod, self.placement = host, node, pod, placement
        self._clock, self.xid_wait_ms, self._unavailable_reason = clock, xid_wait_ms, unavailable_reason
        self._error: type[BaseException] = getattr(nvml, "NVMLError", Exception) if nvml is not None else Exception
        self._lock = threading.Lock()
        self._reader = NvmlReader(nvml)
        self.gpus: list[_Gpu] = []
        self._by_handle: dict[Any, _Gpu] = {}
        self.available = False  # NVML initialised
        self._opened = False
        self._xid_stop = threading.Event()
        self._xid_thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> bool:
        """Initialise NVML and find the GPUs; False (after one warning) when NVML cannot be read."""
        if self._opened:
            return self.available
        self._opened = True
        # Without NVML we still know the indices we were asked for; they get placements.
        self.gpus = [_Gpu(i) for i in self._indices or []]
        nv = self._nvml
        try:
            if nv is None:
                raise RuntimeError(self._unavailable_reason or "no NVML module")
            nv.nvmlInit()
            indices = self._indices if self._indices is not None else list(range(nv.nvmlDeviceGetCount()))
        except Exception as exc:  # library missing, driver not loaded, ...: never crash the job
            log.warning(
                "NVML unavailable (%s: %s); publishing placements without hw_id and no GPU figures", type(exc).__name__, exc
            )
            return False
        self.available = True
        self.gpus = [_Gpu(i) for i in indices]
        for gpu in self.gpus:
            try:
                gpu.handle = nv.nvmlDeviceGetHandleByIndex(gpu.index)
                uuid = nv.nvmlDeviceGetUUID(gpu.handle)
                gpu.uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            except self._error as exc:
                gpu.handle = None
                log.warning(
                    "GPU %d: cannot read its handle/UUID (%s); its placement has no hw_id and it gets no figures", gpu.index, exc
                )
        self._by_handle = {_handle_key(g.handle): g for g in self._readable()}
        return True

    def close(self) -> None:
        """Stop the XID watcher and shut NVML down."""
        self.stop()
        if self.available:
            self.available = False
            self._reader.close()
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # shutting down anyway: nothing useful to do with it
                pass

    def _readable(self) -> list[_Gpu]:
        return [g for g in self.gpus if g.uuid is not None]

    # -- sampling and export ---------------------------------------------------------------
    def sample(self) -> int:
        """Read every readable GPU once; returns how many were sampled."""
        sampled = 0
        for gpu in self._readable():
            reading = self._reader.read(gpu.index, gpu.uuid, gpu.handle)
            if reading is None:
                continue
            with self._lock:
                gpu.pending.append(reading)
                gpu.last = reading
            sampled += 1
        return sampled

    def export(self) -> list[dict[str, Any]]:
        """Publish one GpuSample per GPU sampled since the last export, and the placements."""
        now = self._clock()
        records: list[dict[str, Any]] = []
        with self._lock:
            for gpu in self._readable():
                if gpu.pending:  # nothing sampled since the last export: no record
                    records.append(self._gpu_sample(gpu, summarize(gpu.pending, gpu.exported), now))
                    gpu.exported, gpu.pending = gpu.pending[-1], []
        for record in records:
            self._publish(Outgoing(self._topic, record["hw_id"], "GpuSample", record))
        for record in self._placements(now):
            key = record["hw_id"] or (f"{self.host}/{record['index']}" if record["index"] is not None else self.host)
            self._publish(Outgoing(self._topic, key, "Placement", record))
        return records

    def _gpu_sample(self, gpu: _Gpu, r: Reading, now: int) -> dict[str, Any]:
        p = self.placement
        return {
            "project": p.project if p else "",
            "run_id": p.run_id if p else "",
            "attempt": p.attempt if p else 0,
            "time_ns": now,
            "hw_id": gpu.uuid,
            "index": gpu.index,
            "host": self.host,
            "node": self.node,
            "pod": self.pod,
            "rank": p.rank if p else None,
            "role": p.role if p else None,
            **figures(r),
            "xid_errors": gpu.xid_errors,
            "xid_last": gpu.xid_last,
            "xid_class": xid_class(gpu.xid_last),
        }

    def _placements(self, now: int) -> list[dict[str, Any]]:
        p = self.placement
        if p is None:
            return []
        # No GPU known at all (NVML down, no indices given): still say the process holds the run.
        held: list[tuple[int | None, str | None]] = [(g.index, g.uuid) for g in self.gpus] or [(None, None)]
        return [
            {
                "project": p.project,
                "run_id": p.run_id,
                "attempt": p.attempt,
                "stage": p.stage,
                "time_ns": now,
                "role": p.role,
                "rank": p.rank,
                "pod": self.pod,
                "node": self.node,
                "host": self.host,
                "index": index,
                "hw_id": uuid,
            }
            for index, uuid in held
        ]

    # -- XIDs ------------------------------------------------------------------------------
    def start_xid_watch(self, wait_ms: int | None = None) -> bool:
        """Register the GPUs for XID events and watch them on a daemon thread; False if none can be."""
        if not self.available or (self._xid_thread is not None and self._xid_thread.is_alive()):
            return False
        nv = self._nvml
        # Registration happens here, not on the thread, so an XID right after this returns is seen.
        try:
            event_set = nv.nvmlEventSetCreate()
        except self._error as exc:
            log.warning("cannot create an NVML event set (%s); not watching XIDs", exc)
            return False
        registered = 0
        for gpu in self._readable():
            try:
                nv.nvmlDeviceRegisterEvents(gpu.handle, nv.nvmlEventTypeXidCriticalError, event_set)
                registered += 1
            except self._error as exc:
                log.warning("GPU %d (%s): cannot watch XID events (%s); no XID counts there", gpu.index, gpu.uuid, exc)
        if not registered:
            self._free(event_set)
            return False
        self._xid_stop.clear()
        self._xid_thread = threading.Thread(
            target=self._watch, args=(event_set, wait_ms or self.xid_wait_ms), name="rlpulse-xid", daemon=True
        )
        self._xid_thread.start()
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """End the XID watcher (it notices within one wait)."""
        self._xid_stop.set()
        if self._xid_thread is not None:
            self._xid_thread.join(timeout)
            self._xid_thread = None

    def _watch(self, event_set: Any, wait_ms: int) -> None:
        nv = self._nvml
        wait = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait
        timeout_error = getattr(nv, "NVMLError_Timeout", ())
        try:
            while not self._xid_stop.is_set():
                try:
                    data = wait(event_set, wait_ms)
                except Exception as exc:
                    if isinstance(exc, timeout_error) or getattr(exc, "value", None) == getattr(nv, "NVML_ERROR_TIMEOUT", 10):
                        continue  # no event within wait_ms: the normal case
                    log.warning("waiting for XID events failed (%s: %s); no longer watching XIDs", type(exc).__name__, exc)
                    return
                self._on_event(data)
        finally:
            self._free(event_set)

    def _on_event(self, data: Any) -> None:
        if not int(data.eventType) & self._nvml.nvmlEventTypeXidCriticalError:
            return
        code = int(data.eventData)
        gpu = self._by_handle.get(_handle_key(data.device))
        if gpu is None:
            log.warning("XID %d on a GPU this poller does not hold", code)
            return
        with self._lock:
            gpu.xid_errors += 1
            gpu.xid_last = code
            # Published at once so the alert does not wait for the next export.
            record = self._gpu_sample(gpu, gpu.last or ZERO, self._clock())
        # Seed 001: the job writes each XID and its GPU to its output.
        log.warning("XID %d (%s%s) on GPU %s (index %d)", code, record["xid_class"],
                    f": {xid_description(code)}" if xid_description(code) else "", gpu.uuid, gpu.index)
        self._publish(Outgoing(self._topic, record["hw_id"], "GpuSample", record))

    def _free(self, event_set: Any) -> None:
        try:
            self._nvml.nvmlEventSetFree(event_set)
        except Exception:  # freeing is best effort; NVML may already be shut down
            pass

    # -- loop ------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Sample and export on their intervals until ``stop`` is set; a last export at the end."""
        if self.open():
            self.start_xid_watch()
        now = time.monotonic()
        next_sample = next_export = now  # export first: placements go out at once
        try:
            while True:
                now = time.monotonic()
                # Export before sampling when both are due, so each export covers the same
                # number of samples (3 with the 5 s / 15 s defaults).
                if now >= next_export:
                    self.export()
                    next_export = _next(next_export, self.export_interval_s, now)
                if now >= next_sample:
                    self.sample()
                    next_sample = _next(next_sample, self.sample_interval_s, now)
                if stop.wait(max(0.0, min(next_sample, next_export) - time.monotonic())):
                    break
        finally:
            self.export()  # the samples of the last, partial interval
            self.stop()


def _next(deadline: float, interval: float, now: float) -> float:
    deadline += interval
    # After a stall (suspended process, slow NVML), skip missed ticks instead of bursting.
    return deadline if deadline > now else now + interval


def main(
    settings: Settings,
    *,
    indices: list[int] | None = None,
    sample_interval: float = 5.0,
    export_interval: float = 15.0,
    run_id: str | None = None,
    attempt: int = 1,
    role: str = "trainer",
    rank: int = 0,
    project: str = "",
    nvml_module: Any = None,
    stage: str = "",
    node: str = "",
    pod: str = "",
    stop: threading.Event | None = None,
) -> int:
    """``rlpulse gpu-poller``: publish until SIGTERM/SIGINT (or ``stop``); returns 0."""
    nvml: Any = nvml_module
    reason = ""
    if nvml is None:
        try:
            import pynvml  # optional: rlpulse[gpu]

            nvml = pynvml
        except ImportError as exc:
            nvml, reason = None, f"pynvml is not installed ({exc}); pip install 'rlpulse[gpu]'"
    placement = Placement(run_id, attempt, role, rank, project, stage) if run_id else None
    sender = Sender(settings)
    sender.start()
    poller = GpuPoller(
        nvml,
        sender.offer,
        settings,
        indices=indices,
        sample_interval_s=sample_interval,
        export_interval_s=export_interval,
        node=node,
        pod=pod,
        placement=placement,
        unavailable_reason=reason,
    )
    stop = stop or threading.Event()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers only work there
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        poller.run(stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        poller.close()
        undelivered = sender.close()
        if undelivered:
            log.warning("gpu-poller: %d hardware events undelivered", undelivered)
    return 0
