"""The hardware processor bound to a table, as the Faust agent drives it: replays and restarts."""

from __future__ import annotations

import json

from rlpulse.schemas.catalogue import HARDWARE_TOPIC
from rlpulse.base.settings import AlertThresholds
from rlpulse.streams.stage import HardwareStage

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
    out = stage.on_message(HARDWARE_TOPIC, 0, message, 0)
    assert alerts(out) == [("xid", "GPU-1", "FIRING"), ("hw_slowdown", "GPU-1", "FIRING")]
    assert stage.on_message(HARDWARE_TOPIC, 0, message, S) == []  # redelivered: nothing new
    restarted = HardwareStage(thresholds, json.loads(json.dumps(table)))  # recovered from the changelog
    assert restarted.on_message(HARDWARE_TOPIC, 0, message, 2 * S) == []
    resolved = restarted.on_message(HARDWARE_TOPIC, 0, [sample(1, 0x0, xid_last=79, t=3)], 3 * S)
    assert alerts(resolved) == [("hw_slowdown", "GPU-1", "RESOLVED")]
    assert restarted.on_tick(1, 70 * S) == []  # another partition's tick leaves this GPU alone
    assert alerts(restarted.on_tick(0, 70 * S)) == [("xid", "GPU-1", "RESOLVED")]
    assert restarted.on_tick(0, 80 * S) == []


def test_placements_carry_no_figures_and_write_nothing():
    table: dict = {}
    stage = HardwareStage(AlertThresholds(), table)
    placement = dict(project="p", run_id="r", attempt=1, time_ns=0, role="actor", rank=0, hw_id="GPU-1")
    assert stage.on_message(HARDWARE_TOPIC, 0, [placement], 0) == [] and table == {}


def test_the_xid_report_published_at_once_neither_resolves_nor_refires_an_open_slowdown():
    """The poller publishes a sample the moment an XID occurs, between its regular exports: its
    throttle_reasons is the latest single reading (here without 0x8) or 0 before any reading, not
    the OR over an export, so it says nothing about the slowdown ending."""
    table: dict = {}
    stage = HardwareStage(AlertThresholds(xid_quiet_after=60.0), table)
    out = []
    for i, (xids, throttle, xid_last) in enumerate([(0, 0x1, None), (0, 0x9, None), (1, 0x1, 79), (1, 0x9, 79),
                                                    (2, 0x0, 48), (2, 0x9, 48), (2, 0x1, 48)]):
        out += stage.on_message(HARDWARE_TOPIC, 0, [sample(xids, throttle, xid_last=xid_last, t=(i + 1) * S)], (i + 1) * S)
    assert alerts(out) == [("hw_slowdown", "GPU-1", "FIRING"), ("xid", "GPU-1", "FIRING"),
                           ("hw_slowdown", "GPU-1", "RESOLVED")]
    [fired, _, resolved] = [o.record for o in out]
    assert fired["first_seen_ns"] == resolved["first_seen_ns"] == 2 * S  # the sample's time: one episode
    assert resolved["time_ns"] == 7 * S


def test_an_xid_report_can_open_a_slowdown_and_a_regular_sample_closes_it():
    stage = HardwareStage(AlertThresholds(xid_quiet_after=60.0), {})
    out = stage.on_message(HARDWARE_TOPIC, 0, [sample(0, 0x1, t=1), sample(1, 0x8, xid_last=79, t=2)], S)
    out += stage.on_message(HARDWARE_TOPIC, 0, [sample(1, 0x0, xid_last=79, t=3)], 2 * S)
    assert alerts(out) == [("xid", "GPU-1", "FIRING"), ("hw_slowdown", "GPU-1", "FIRING"), ("hw_slowdown", "GPU-1", "RESOLVED")]


def test_a_gpu_alert_fired_again_after_a_lost_state_write_is_the_same_episode():
    table: dict = {}
    stage = HardwareStage(AlertThresholds(xid_quiet_after=60.0), table)
    stage.on_message(HARDWARE_TOPIC, 0, [sample(0, 0x1, t=S)], S)
    before = json.loads(json.dumps(table))
    message = [sample(1, 0x9, xid_last=79, t=2 * S)]
    first = stage.on_message(HARDWARE_TOPIC, 0, message, 2 * S)
    restarted = HardwareStage(AlertThresholds(xid_quiet_after=60.0), before)  # the write of `message` was lost
    again = restarted.on_message(HARDWARE_TOPIC, 0, message, 20 * S)  # replayed after the restart
    assert alerts(first) == alerts(again) == [("xid", "GPU-1", "FIRING"), ("hw_slowdown", "GPU-1", "FIRING")]
    assert [(a.record["rule"], a.record["first_seen_ns"]) for a in first] == \
        [(a.record["rule"], a.record["first_seen_ns"]) for a in again]  # the sink's key: one row each
