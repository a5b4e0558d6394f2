"""The hardware processor bound to a table, as the Faust agent drives it: replays and restarts."""

from __future__ import annotations

import json

from rlpulse.settings import AlertThresholds
from streams.stage import HardwareStage

S = 1_000_000_000


def sample(xids: int, throttle: int, xid_last: int | None = None, t: int = 0) -> dict:
    return dict(project="p", run_id="r", attempt=1, time_ns=t, hw_id="GPU-1", index=0, host="h", power_w=300.0,
                temperature_c=60.0, gpu_utilization=0.9, memory_used_bytes=1, memory_total_bytes=2, memory_utilization=0.5,
                memory_activity=0.4, sm_clock_mhz=1500.0, throttle_reasons=throttle, xid_errors=xids, xid_last=xid_last)


def alerts(outputs) -> list[tuple[str, str, str]]:
    return [(o.record["rule"], o.key, o.record["state"]) for o in outputs]


def test_xid_and_slowdown_fire_once_across_a_replay_and_a_restart():
    thresholds = AlertThresholds(xid_quiet_after=60.0)
    table: dict = {}
    stage = HardwareStage(thresholds, table)
    message = [sample(0, 0x1, t=1), sample(1, 0x9, xid_last=79, t=2)]
    out = stage.on_message(0, message, 0)
    assert alerts(out) == [("xid", "GPU-1", "FIRING"), ("hw_slowdown", "GPU-1", "FIRING")]
    assert stage.on_message(0, message, S) == []  # redelivered: nothing new
    restarted = HardwareStage(thresholds, json.loads(json.dumps(table)))  # recovered from the changelog
    assert restarted.on_message(0, message, 2 * S) == []
    assert alerts(restarted.on_message(0, [sample(1, 0x0, xid_last=79, t=3)], 3 * S)) == [("hw_slowdown", "GPU-1", "RESOLVED")]
    assert restarted.on_tick(1, 70 * S) == []  # another partition's tick leaves this GPU alone
    assert alerts(restarted.on_tick(0, 70 * S)) == [("xid", "GPU-1", "RESOLVED")]
    assert restarted.on_tick(0, 80 * S) == []


def test_placements_carry_no_figures_and_write_nothing():
    table: dict = {}
    stage = HardwareStage(AlertThresholds(), table)
    placement = dict(project="p", run_id="r", attempt=1, time_ns=0, role="actor", rank=0, hw_id="GPU-1")
    assert stage.on_message(0, [placement], 0) == [] and table == {}
