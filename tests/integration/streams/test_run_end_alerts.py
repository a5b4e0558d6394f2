"""A fast run stalls within a few of its own step times, and a run that ends resolves its run-scoped
alerts ("run ended") while a GPU's XID stays open: through the SDK, the broker, ``rlpulse streams``
and ``rlpulse sink`` into ClickHouse, read as users read it (the alerts table, ``rlpulse watch``'s
open alerts). The stall window's truth is computed from the steps table's own event times."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from rlpulse.base.settings import AlertThresholds, Settings
from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.producers import TrainingTelemetry
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.store.clickhouse import open_store
from rlpulse.sinks.views.watch import open_alerts
from tests.integration import until
from tests.integration.streams.test_streams import publish_gpu

pytestmark = [pytest.mark.integration, pytest.mark.full]

STEP_S = 0.4  # the run's usual step time
FACTOR = 5.0


def run_settings(settings: Settings) -> Settings:
    # global window 60 s: a stall the run's own window (5 x ~0.4 s) catches in ~2 s would take a minute
    return dataclasses.replace(settings, stall_after=60.0, stall_min=1.0, stall_factor=FACTOR, silent_after=3.0,
                               heartbeat_interval=0.5,
                               alerts=AlertThresholds(reward_zero_fraction=0.5, xid_quiet_after=3600.0))


def run_fast_then_stall(settings: Settings) -> None:
    """Five steps of ~0.4 s (the last one collapses: every reward 0), then 5 s of heartbeats without a
    step, then RUN_END."""
    with TrainingTelemetry(project="re", run_id="fast", attempt=1, settings=settings) as tel:
        for step in range(5):
            began = time.monotonic()
            for i in range(4):
                reward = 0.0 if step == 4 else 0.5 + 0.1 * i
                tel.rollout(step=step, rollout_id=f"f{step}-{i}", reward=reward, completion_tokens=10, max_tokens=100)
            time.sleep(max(0.0, began + STEP_S - time.monotonic()))
            tel.step_completed(step=step)
        tel.flush(30)
        time.sleep(5.0)  # heartbeats go on every 0.5 s; step_count stays 5
        assert tel.flush(30) == 0


def test_a_fast_run_stalls_on_its_own_window_and_its_end_resolves_its_alerts(settings: Settings) -> None:
    settings = run_settings(settings)
    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        asyncio.run(publish_gpu(settings))  # GPU-aaaa: an XID (and a slowdown that comes and goes)
        run_fast_then_stall(settings)
        pipeline.wait_caught_up(until=until.counts(settings, {
            "SELECT count() FROM $db.alerts FINAL WHERE project = 're' AND state = 'RESOLVED'": 2,
            "SELECT count() FROM $db.alerts FINAL WHERE rule = 'xid'": 1}))
        pipeline.stop()
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        db, q = store.database, store.client.query
        rows = q(f"SELECT rule, key, state, threshold, summary, first_seen_ns FROM {db}.alerts FINAL "
                 f"WHERE project = 're' ORDER BY rule, state").result_rows
        # the truth of the window: the first report at count 0, then the first event of each higher count
        firsts = q(f"SELECT step_count, min(time_ns) FROM {db}.steps FINAL WHERE run_id = 'fast' "
                   f"GROUP BY step_count ORDER BY step_count").result_rows
        still_open = [(a.rule, a.key) for a in open_alerts(store)]
        xid = q(f"SELECT state FROM {db}.alerts FINAL WHERE rule = 'xid'").result_rows
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("reward_collapse", "re/fast/1", "FIRING"), ("reward_collapse", "re/fast/1", "RESOLVED"),
        ("stalled_run", "re/fast/1", "FIRING"), ("stalled_run", "re/fast/1", "RESOLVED")]
    assert [r[4] for r in rows if r[2] == "RESOLVED"] == ["run fast attempt 1: run ended"] * 2
    assert rows[0][5] == rows[1][5] and rows[2][5] == rows[3][5]  # one episode each

    assert [c for c, _ in firsts] == [0, 1, 2, 3, 4, 5]
    times = [t for _, t in firsts]
    intervals = sorted(b - a for a, b in zip(times, times[1:]))
    window_s = max(FACTOR * intervals[len(intervals) // 2], 1e9) / 1e9  # upper median x factor, floor 1 s
    stalled = rows[2]
    assert stalled[3] == pytest.approx(window_s, abs=1e-6) and 1.0 <= stalled[3] < 10.0  # not the global 60 s
    assert f"{FACTOR:g} x median step time" in stalled[4] and "over the last 5 steps" in stalled[4]

    # what `rlpulse watch` shows: the ended run has nothing open; the GPU's XID stays open
    assert xid == [("FIRING",)]
    assert still_open == [("xid", "GPU-aaaa")]
