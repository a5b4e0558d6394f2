"""What a GPU sample's codes mean: NVML's clock event reason bits and NVIDIA's XID classes.

One table each, read by the GPU poller (the names and class it puts on a ``GpuSample``), the
alert rules (the ``hw_slowdown`` and ``xid`` summaries and meanings) and the generated reference
(``docs/reference/alerts.md`` prints the meanings, built from these tables).
"""

from __future__ import annotations

from typing import NamedTuple


class ThrottleReason(NamedTuple):
    bit: int
    name: str  # rlpulse's name: what ``throttle_reason_names`` and the alert summaries carry
    nvml: str  # NVML's macro, for looking it up in the NVML reference
    meaning: str


# Every bit of NVML's clocks event reasons, as nvidia-ml-py 13.615's pynvml module defines them:
# nvmlClocksEventReason* 0x1..0x100; 0x200 and 0x400 exist only under the deprecated
# nvmlClocksThrottleReason* names (NVML reference, group nvmlClocksEventReasons, lists them as
# nvmlClocksEventReasonBoardLimit / Reliability). Meanings from the NVML API reference.
THROTTLE_REASONS: tuple[ThrottleReason, ...] = (
    ThrottleReason(0x1, "gpu_idle", "GpuIdle", "nothing runs on the GPU; clocks drop to idle"),
    ThrottleReason(0x2, "applications_clocks", "ApplicationsClocksSetting", "clocks held at the applications clocks setting"),
    ThrottleReason(0x4, "sw_power_cap", "SwPowerCap", "software power scaling keeps the board under its power limit"),
    ThrottleReason(0x8, "hw_slowdown", "HwSlowdown",
                   "hardware slowdown: core clocks cut by 2x or more (temperature, power brake, or power draw too high)"),
    ThrottleReason(0x10, "sync_boost", "SyncBoost", "held to the clocks of its sync-boost group"),
    ThrottleReason(0x20, "sw_thermal", "SwThermalSlowdown", "software thermal slowdown: GPU or memory too hot"),
    ThrottleReason(0x40, "hw_thermal", "HwThermalSlowdown", "hardware thermal slowdown: core clocks cut by 2x or more, too hot"),
    ThrottleReason(0x80, "hw_power_brake", "HwPowerBrakeSlowdown",
                   "hardware power brake: core clocks cut by 2x or more, the external power brake asserted"),
    ThrottleReason(0x100, "display_clock", "DisplayClockSetting", "held by the display clocks setting"),
    ThrottleReason(0x200, "board_limit", "BoardLimit", "held by a board limit"),
    ThrottleReason(0x400, "reliability", "Reliability", "held for reliability"),
)
_BY_BIT = {r.bit: r for r in THROTTLE_REASONS}
# The bit that fires ``hw_slowdown`` (seed 001): NVML sets it whenever the hardware cuts the core
# clocks by 2x or more, whatever the cause; 0x40 (thermal) and 0x80 (power brake) say which cause.
HW_SLOWDOWN_BIT = 0x8


def throttle_reason_names(mask: int) -> list[str]:
    """The names of the bits set in ``mask``, lowest bit first; an unnamed bit as ``bit_0x...``."""
    mask &= 0xFFFF_FFFF_FFFF_FFFF  # a mask read back from an Avro long may be negative (bit 63)
    names = []
    bit = 1
    while mask:
        if mask & 1:
            names.append(_BY_BIT[bit].name if bit in _BY_BIT else f"bit_{bit:#x}")
        mask >>= 1
        bit <<= 1
    return names


def throttle_reasons_table() -> str:
    """``0x8 hw_slowdown, 0x40 hw_thermal, ...``: every named bit, for the generated reference."""
    return ", ".join(f"{r.bit:#x} {r.name}" for r in THROTTLE_REASONS)


# -- XIDs ----------------------------------------------------------------------------------------
# The classes of ``GpuSample.xid_class`` (a string, not an Avro enum: the SDK's record check takes
# no enum inside a nullable union, and a reader must keep a class added later as written).
XID_APPLICATION, XID_HARDWARE, XID_UNKNOWN = "application", "hardware", "unknown"
XID_CLASSES: tuple[str, ...] = (XID_APPLICATION, XID_HARDWARE, XID_UNKNOWN)
XID_CLASS_MEANING = {
    XID_APPLICATION: "a fault of the job's own kernels or process; fix the code, the GPU is fine",
    XID_HARDWARE: "a hardware or driver fault (memory, links, bus, firmware); drain or reset the GPU",
    XID_UNKNOWN: "not in rlpulse's catalogue; see NVIDIA's XID catalogue for the code",
}

# code -> (class, NVIDIA's description). Sources: NVIDIA's Xid catalogue for Ampere and newer
# (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html: description and
# resolution bucket per code) and its older "Xid Error Listing" (cause columns: user app error,
# driver error, HW error, ...). Application: the catalogue's action is RESTART_APP with the
# investigation in the application (CHECK_APP/CUDA, WORKFLOW_XID_13/31/43), and the listing names
# a user application error. Hardware: ECC, row remapping, NVLink, PCIe, firmware/GSP faults, whose
# action is a GPU reset, a node reboot or a support case. Anything else: unknown.
XID_CATALOGUE: dict[int, tuple[str, str]] = {
    13: (XID_APPLICATION, "graphics engine exception (e.g. an out-of-range access or illegal instruction in a kernel)"),
    31: (XID_APPLICATION, "GPU memory page fault: an illegal memory access by the job's kernels (MMU fault)"),
    43: (XID_APPLICATION, "GPU stopped processing: the job's channel was reset after its own fault"),
    45: (XID_APPLICATION, "preemptive cleanup: the job's channels torn down after an earlier error or its exit"),
    48: (XID_HARDWARE, "double-bit ECC error (DBE)"),
    61: (XID_HARDWARE, "internal micro-controller breakpoint/warning (firmware)"),
    62: (XID_HARDWARE, "internal micro-controller halt (firmware)"),
    63: (XID_HARDWARE, "ECC page retirement or row remapping recorded (reset the GPU to apply it)"),
    64: (XID_HARDWARE, "ECC page retirement or row remapping failure"),
    74: (XID_HARDWARE, "NVLink error"),
    79: (XID_HARDWARE, "GPU has fallen off the bus (PCIe)"),
    92: (XID_HARDWARE, "high single-bit ECC error rate"),
    94: (XID_HARDWARE, "contained ECC error (the affected application was stopped)"),
    95: (XID_HARDWARE, "uncontained ECC error (every application on the GPU affected)"),
    119: (XID_HARDWARE, "GSP RPC timeout (GPU System Processor firmware)"),
    120: (XID_HARDWARE, "GSP error (GPU System Processor firmware)"),
    140: (XID_HARDWARE, "unrecovered ECC error"),
}


def xid_class(code: int | None) -> str | None:
    """The class of XID ``code`` (``unknown`` when not in the catalogue); None for no XID."""
    if code is None:
        return None
    return XID_CATALOGUE.get(int(code), (XID_UNKNOWN, ""))[0]


def xid_description(code: int | None) -> str:
    """NVIDIA's description of ``code``, or "" when it is not in the catalogue."""
    return XID_CATALOGUE.get(int(code), ("", ""))[1] if code is not None else ""


def xid_codes_of(klass: str) -> list[int]:
    """The catalogued codes of one class, ascending."""
    return sorted(code for code, (k, _) in XID_CATALOGUE.items() if k == klass)


def xid_classes_table() -> str:
    """Each class, what it means and its catalogued codes, for the generated reference."""
    parts = []
    for klass in XID_CLASSES:
        codes = xid_codes_of(klass)
        parts.append(f"{klass}: {XID_CLASS_MEANING[klass]}" + (f" (XIDs {', '.join(map(str, codes))})" if codes else ""))
    return "; ".join(parts)
