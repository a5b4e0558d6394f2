"""The capacity SDK call (producers/pollers/capacity.py), the simulator's engines and pools, and the command's text."""

from __future__ import annotations

from datetime import datetime

import pytest

from rlpulse.producers.pollers.capacity import CapacityReporter, PoolCapacity, ProjectCapacity
from rlpulse.producers.simulators.engine_sim import capacity_reports, engine_records
from rlpulse.producers.sdk.sender import Outgoing
from rlpulse.schemas.codec import Codec
from rlpulse.base.settings import AlertThresholds, Settings
from rlpulse.sinks.views.capacity import POOL_COLUMNS, _cell, render_capacity
from rlpulse.streams.alerting import AlertBook, engine_saturated

SETTINGS = Settings(topic_prefix="t")
NS = 1_000_000_000


class FakeSender:
    def __init__(self) -> None:
        self.offered: list[Outgoing] = []

    def offer(self, item: Outgoing) -> bool:
        self.offered.append(item)
        return True

    def flush(self, timeout: float = 30.0) -> int:
        return 0


def reporter(instance: str = "svc-0") -> tuple[CapacityReporter, FakeSender]:
    sender = FakeSender()
    ticks = iter(range(100))
    return CapacityReporter(SETTINGS, instance, sender=sender, clock=lambda: next(ticks) * NS), sender  # type: ignore[arg-type]


def test_a_report_is_one_record_per_pool_and_per_project_claim() -> None:
    r, sender = reporter()
    assert r.report([PoolCapacity("train", 64, None, granted=32, queued=16, claims_granted=4, claims_queued=2,
                                  accelerator="h100"),
                     PoolCapacity("serve", 16, 16, granted=8, claims_granted=1, serving=True)],
                    [ProjectCapacity("proj", "train", granted=32, queued=16, quota=48)]) == 3
    assert [(o.topic, o.key, o.schema) for o in sender.offered] == [("t.hardware", "serve", "CapacitySample"),
                                                                     ("t.hardware", "train", "CapacitySample"),
                                                                     ("t.hardware", "train", "CapacitySample")]
    serve, train, proj = (o.record for o in sender.offered)
    assert train == {"pool": "train", "serving": False, "accelerator": "h100", "project": "", "instance": "svc-0",
                     "time_ns": 0, "devices_declared": 64, "devices_observed": None, "devices_granted": 32,
                     "devices_queued": 16, "claims_granted": 4, "claims_queued": 2, "quota": None}
    assert serve["serving"] is True and serve["devices_observed"] == 16
    assert proj == {"pool": "train", "serving": False, "accelerator": "h100", "project": "proj", "instance": "svc-0",
                    "time_ns": 0, "devices_declared": None, "devices_observed": None, "devices_granted": 32,
                    "devices_queued": 16, "claims_granted": None, "claims_queued": None, "quota": 48}
    Codec().encode("CapacitySample", [o.record for o in sender.offered])


def test_a_pool_or_project_left_out_after_its_last_claim_reads_zero() -> None:
    r, sender = reporter()
    r.report([PoolCapacity("serve", 16, 16, granted=8, claims_granted=1)], [ProjectCapacity("proj", "serve", granted=8, quota=8)])
    sender.offered.clear()
    assert r.report([]) == 2  # the claim ended: the service no longer lists the pool or the project
    pool, project = (o.record for o in sender.offered)
    assert (pool["pool"], pool["devices_declared"], pool["devices_observed"], pool["devices_granted"],
            pool["claims_granted"], pool["time_ns"]) == ("serve", 16, 16, 0, 0, NS)
    assert (project["project"], project["devices_granted"], project["devices_queued"], project["quota"]) == ("proj", 0, 0, 8)


@pytest.mark.parametrize("pools, projects, why", [
    ([PoolCapacity("", 1)], [], "pool must be a non-empty string"),
    ([PoolCapacity("p", -1)], [], "pool p: declared must be an int from 0"),
    ([PoolCapacity("p", True)], [], "pool p: declared must be an int from 0"),  # type: ignore[arg-type]
    ([PoolCapacity("p", 1, observed=1.5)], [], "observed must be an int"),  # type: ignore[arg-type]
    ([PoolCapacity("p" * 300, 1)], [], "pool is 300 characters"),
    ([PoolCapacity("p", 1), PoolCapacity("p", 2)], [], "listed twice"),
    ([], [ProjectCapacity("x", "p", quota=-2)], "project x: quota must be an int"),
    ([], [ProjectCapacity("x", "p"), ProjectCapacity("x", "p")], "listed twice"),
])
def test_bad_figures_raise_naming_them_and_publish_nothing(pools, projects, why) -> None:
    r, sender = reporter()
    with pytest.raises(ValueError, match=why):
        r.report(pools, projects)
    assert sender.offered == []
    with pytest.raises(ValueError, match="instance must be a non-empty string"):
        CapacityReporter(SETTINGS, "", sender=FakeSender())  # type: ignore[arg-type]


def test_the_command_prints_the_seeds_columns() -> None:
    at = datetime(2026, 12, 4, 12, 0, 5)
    pools = [[_cell(v) for v in row] for row in (("serve-a100", "a100", True, 16, 16, 0, 0, 0, 0, 2, at),
                                                  ("train-h100", "h100", False, 64, None, 40, 0, 5, 0, 2, at))]
    projects = [[_cell(v) for v in ("sim", "train-h100", 40, 0, 48, 2, at)]]
    assert [h for h, _ in POOL_COLUMNS][:5] == ["POOL", "ACCELERATOR", "SERVING", "DECLARED", "OBSERVED"]
    assert render_capacity(pools, projects) == (
        "POOL        ACCELERATOR  SERVING  DECLARED  OBSERVED  GRANTED  QUEUED  "
        "CLAIMS GRANTED  CLAIMS QUEUED  INSTANCES  REPORTED\n"
        "----------  -----------  -------  --------  --------  -------  ------  "
        "--------------  -------------  ---------  -----------------------\n"
        "serve-a100  a100         yes      16        16        0        0       "
        "0               0              2          2026-12-04 12:00:05 UTC\n"
        "train-h100  h100         no       64        -         40       0       "
        "5               0              2          2026-12-04 12:00:05 UTC\n"
        "\n"
        "PROJECT  POOL        GRANTED  QUEUED  QUOTA  INSTANCES  REPORTED\n"
        "-------  ----------  -------  ------  -----  ---------  -----------------------\n"
        "sim      train-h100  40       0       48     2          2026-12-04 12:00:05 UTC\n")
    assert render_capacity([], []).startswith("no capacity reported yet")


def test_the_simulated_engine_saturates_once_and_sleeps_once() -> None:
    records = engine_records("sim", "sim-run1", start_ns=10**18)
    Codec().encode("EngineSample", records)
    assert [r["awake"] for r in records].count(0) == 3 and records[-1]["awake"] == 1
    book, state, fired = AlertBook({}), {}, []
    for r in records:
        fired += [a["state"] for a in engine_saturated(book, state, r, AlertThresholds(), r["time_ns"])]
    assert fired == ["FIRING", "RESOLVED"]  # the default 120 s: the episode lasts 135 s
    reports = capacity_reports()
    assert [len(pools) for pools, _ in reports] == [2, 2, 1]  # the serving pool's claim ends: left out, read as 0
