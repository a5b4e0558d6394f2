"""``engine_saturated`` in the streams' hardware lane: the rule, its state in the table through replays and
restarts, the lane reading all four record types of ``hardware`` through the real decoder, and schema
evolution of the new records (an older writer, a newer writer, an older reader)."""

from __future__ import annotations

import copy
import io
import json

import fastavro
import pytest

from rlpulse.schemas.catalogue import HARDWARE_TOPIC
from rlpulse.schemas.codec import Codec, DecodeError, load_schemas
from rlpulse.base.settings import AlertThresholds, Settings
from rlpulse.streams.alerting import AlertBook, engine_saturated
from rlpulse.streams.inputs import Inputs
from rlpulse.streams.stage import ENGINE_FORGET_NS, HardwareStage
from rlpulse.streams.testing import NS, WorkerHarness

T0 = 1_700_000_000 * NS
LIMITS = AlertThresholds(engine_kv_usage=0.95, engine_saturated_after=30.0)
URL = "http://rollout-0:8000/metrics"


def sample(t_s: float, waiting: float | None, kv: float | None, engine: str = "0", pod: str = "rollout-0") -> dict:
    record = dict(project="p", run_id="r1", attempt=1, pod=pod, url=URL, engine=engine, model_name="m",
                  time_ns=T0 + int(t_s * NS), requests_running=8.0, requests_waiting=waiting, kv_cache_usage=kv, awake=1)
    return {f["name"]: record.get(f["name"], f.get("default")) for f in load_schemas()["rlpulse.v1.EngineSample"]["fields"]}


def rule(samples: list[dict], thresholds: AlertThresholds = LIMITS) -> list[tuple[str, int, float]]:
    """(state, first_seen seconds, value) of each alert the samples produce, one at a time."""
    book, state, out = AlertBook({}), {}, []
    for s in samples:
        for a in engine_saturated(book, state, s, thresholds, now_ns=s["time_ns"] + NS):
            assert a["rule"] == "engine_saturated" and a["key"] == "rollout-0/0" and a["severity"] == "warning"
            assert (a["project"], a["run_id"], a["attempt"], a["threshold"]) == ("p", "r1", 1, 0.95)
            out.append((a["state"], (a["first_seen_ns"] - T0) // NS, a["value"]))
    return out


def test_fires_once_after_the_configured_time_and_resolves_when_it_stops() -> None:
    samples = [sample(0, 0, 0.5), sample(5, 3, 0.96), sample(20, 4, 0.99), sample(35, 5, 0.97),  # 30 s: not yet longer
               sample(40, 6, 0.98), sample(50, 9, 1.0), sample(55, 0, 0.97), sample(60, 2, 0.5)]
    assert rule(samples) == [("FIRING", 5, 0.98), ("RESOLVED", 5, 0.97)]  # first_seen: when saturation began


def test_both_conditions_and_continuity_are_needed() -> None:
    full_but_no_queue = [sample(t, 0, 0.99) for t in range(0, 100, 10)]
    queue_but_room = [sample(t, 7, 0.9) for t in range(0, 100, 10)]
    broken = [sample(0, 1, 0.99), sample(25, 1, 0.99), sample(28, 1, 0.2), sample(30, 1, 0.99), sample(55, 1, 0.99)]
    assert rule(full_but_no_queue) == rule(queue_but_room) == rule(broken) == []
    # a figure the engine does not export says nothing: the streak goes on across it
    unknown = [sample(0, 1, 0.99), sample(20, None, 0.99), sample(31, 1, 0.99), sample(40, 1, None)]
    assert rule(unknown) == [("FIRING", 0, 0.99)]
    # two episodes: each fires and resolves once
    twice = [sample(0, 1, 1.0), sample(31, 1, 1.0), sample(40, 0, 0.2), sample(50, 1, 1.0), sample(90, 1, 1.0),
             sample(95, 0, 1.0)]
    assert rule(twice) == [("FIRING", 0, 1.0), ("RESOLVED", 0, 0.2), ("FIRING", 50, 1.0), ("RESOLVED", 50, 1.0)]


def alerts(outputs) -> list[tuple[str, str, str]]:
    return [(o.record["rule"], o.key, o.record["state"]) for o in outputs]


def test_the_stage_keeps_the_streak_across_messages_a_replay_and_a_restart() -> None:
    table: dict = {}
    stage = HardwareStage(LIMITS, table)
    first = [sample(0, 2, 0.99), sample(10, 2, 0.99)]
    assert stage.on_message(HARDWARE_TOPIC, 1, first, T0) == []
    assert stage.on_message(HARDWARE_TOPIC, 1, first, T0) == []  # redelivered: skipped by the mark
    restarted = HardwareStage(LIMITS, json.loads(json.dumps(table)))  # recovered from the changelog
    assert alerts(restarted.on_message(HARDWARE_TOPIC, 1, [sample(31, 2, 0.99)], T0)) == [
        ("engine_saturated", "rollout-0/0", "FIRING")]
    assert restarted.on_message(HARDWARE_TOPIC, 1, [sample(31, 2, 0.99), sample(40, 2, 0.99)], T0) == []
    assert alerts(restarted.on_message(HARDWARE_TOPIC, 1, [sample(45, 0, 0.99)], T0)) == [
        ("engine_saturated", "rollout-0/0", "RESOLVED")]
    # another engine of the same pod is its own streak
    assert restarted.on_message(HARDWARE_TOPIC, 1, [sample(50, 1, 1.0, engine="1")], T0) == []
    assert sorted(restarted.table) == ["engine:rollout-0/0", "engine:rollout-0/1"]
    # an engine unheard of for an hour, with nothing open, leaves the table at its partition's tick
    assert restarted.on_tick(1, T0 + ENGINE_FORGET_NS - NS) == []
    restarted.on_tick(0, T0 + ENGINE_FORGET_NS + NS)
    assert len(restarted.table) == 2  # another partition's tick
    restarted.on_tick(1, T0 + ENGINE_FORGET_NS + NS)
    assert restarted.table == {}


def test_an_open_alert_keeps_its_engine_and_the_table_is_bounded(monkeypatch) -> None:
    from rlpulse.streams import stage as stage_module

    stage = HardwareStage(LIMITS, {})
    stage.on_message(HARDWARE_TOPIC, 0, [sample(0, 1, 1.0), sample(31, 1, 1.0)], T0)
    stage.on_tick(0, T0 + 2 * ENGINE_FORGET_NS)
    assert list(stage.table) == ["engine:rollout-0/0"]  # FIRING: kept until it resolves
    monkeypatch.setattr(stage_module, "MAX_ENGINES", 1)
    assert stage.on_message(HARDWARE_TOPIC, 0, [sample(0, 1, 1.0, pod="other")], T0) == []
    assert stage.engines_refused == 1 and list(stage.table) == ["engine:rollout-0/0"]


GPU = dict(project="p", run_id="r1", attempt=1, time_ns=T0, hw_id="GPU-1", index=0, host="h", power_w=300.0,
           temperature_c=60.0, gpu_utilization=0.9, memory_used_bytes=1, memory_total_bytes=2, memory_utilization=0.5,
           memory_activity=0.4, sm_clock_mhz=1500.0, throttle_reasons=0x8, xid_errors=0)
PLACEMENT = dict(project="p", run_id="r1", attempt=1, time_ns=T0, role="actor", rank=0, hw_id="GPU-1")
CAPACITY = dict(pool="train", instance="svc-0", time_ns=T0, devices_declared=8, devices_granted=8)


def test_the_hardware_lane_reads_all_four_record_types_through_the_decoder() -> None:
    h = WorkerHarness(thresholds=LIMITS)
    out = h.feed(HARDWARE_TOPIC, [CAPACITY], schema="CapacitySample")
    out += h.feed(HARDWARE_TOPIC, [PLACEMENT], schema="Placement")
    out += h.feed(HARDWARE_TOPIC, [GPU], schema="GpuSample")
    out += h.feed(HARDWARE_TOPIC, [sample(0, 1, 0.99), sample(40, 1, 0.99)], schema="EngineSample")
    assert alerts(out) == [("hw_slowdown", "GPU-1", "FIRING"), ("engine_saturated", "rollout-0/0", "FIRING")]
    assert sorted(h.gpus) == ["GPU-1", "engine:rollout-0/0"]  # capacity and placements keep no state
    assert h.worker.inputs.skipped == 0


def container(schema: dict, records: list[dict]) -> bytes:
    buf = io.BytesIO()
    fastavro.writer(buf, fastavro.parse_schema(schema), records)
    return buf.getvalue()


def evolved(name: str, keep: tuple[str, ...] = (), added: list[dict] | None = None) -> dict:
    raw = copy.deepcopy(load_schemas()[f"rlpulse.v1.{name}"])
    if keep:
        raw["fields"] = [f for f in raw["fields"] if f["name"] in keep]
    raw["fields"] += added or []
    return raw


def test_an_older_engine_writer_reads_with_the_readers_defaults() -> None:
    """A writer with only the required fields (url, time_ns) and the gauges: every later field takes its
    default (null, 0, ''), which the rule reads as 'not exported'."""
    older = evolved("EngineSample", keep=("url", "time_ns", "requests_waiting", "kv_cache_usage"))
    data = container(older, [{"url": URL, "time_ns": T0, "requests_waiting": 2.0, "kv_cache_usage": 0.99}])
    [record] = Inputs(Codec()).decode(HARDWARE_TOPIC, data, "test")
    assert record["project"] == "" and record["attempt"] == 0 and record["engine"] == "" and record["awake"] is None
    assert record["ttft_p99_s"] is None and record["counter_resets"] == 0 and record["requests_waiting"] == 2.0
    older_capacity = evolved("CapacitySample", keep=("pool", "instance", "time_ns"))
    [cap] = Inputs(Codec()).decode(HARDWARE_TOPIC, container(older_capacity, [{"pool": "p", "instance": "i", "time_ns": 1}]),
                                   "test")
    assert (cap["serving"], cap["accelerator"], cap["project"], cap["devices_observed"], cap["quota"]) == (
        False, "any", "", None, None)


def test_a_newer_writers_added_field_is_read_past() -> None:
    newer = evolved("EngineSample", added=[{"name": "spec_decode_acceptance", "type": ["null", "double"], "default": None}])
    record = dict(sample(0, 1, 0.5), spec_decode_acceptance=0.7)
    [read] = Inputs(Codec()).decode(HARDWARE_TOPIC, container(newer, [record]), "test")
    assert "spec_decode_acceptance" not in read and read["kv_cache_usage"] == 0.5


def test_a_reader_before_these_records_refuses_them_as_not_of_the_topic() -> None:
    """An older sink or streams (hardware = GpuSample, Placement) dead-letters or skips an engine sample,
    counted and logged, never misread as a GPU sample; `rlpulse dlq replay` sends it again after the upgrade."""
    data = Codec().encode("EngineSample", [sample(0, 1, 0.5)])
    with pytest.raises(DecodeError, match="EngineSample"):
        Codec().decode(data, expect=("rlpulse.v1.GpuSample", "rlpulse.v1.Placement"))


def test_the_thresholds_come_from_the_environment() -> None:
    from rlpulse.base import env as envvars
    settings = Settings.load({envvars.ALERT_ENGINE_KV_USAGE: "0.9", envvars.ALERT_ENGINE_SATURATED_AFTER: "2m"})
    assert (settings.alerts.engine_kv_usage, settings.alerts.engine_saturated_after) == (0.9, 120.0)
    assert Settings.load(settings.env()).alerts == settings.alerts
