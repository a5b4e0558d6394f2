"""``rlpulse demo``: the main job, end to end on the real broker and ClickHouse engine."""

from __future__ import annotations

import dataclasses
import time

from rlpulse import services
from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.progress import Ticker
from rlpulse.schemas.settings import Settings
from rlpulse.schemas.topics import ensure_topics

# Short windows so the demo's windows close (by wall clock) within seconds.
DEMO_WINDOW_S = 5.0
DEMO_LATENESS_S = 2.0
DEMO_STALL_AFTER_S = 4.0  # one simulated run stalls for longer than this


def _say(line: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {line}", flush=True)


def run_demo(settings: Settings) -> int:
    from rlpulse.producers.simulator import SimConfig, simulate
    from rlpulse.sinks.clickhouse import open_store
    from rlpulse.sinks.report import failures_by_cause, print_report

    settings = dataclasses.replace(settings, window=DEMO_WINDOW_S, allowed_lateness=DEMO_LATENESS_S,
                                   stall_after=DEMO_STALL_AFTER_S, silent_after=30.0, heartbeat_interval=1.0)
    started = time.monotonic()
    _say(f"local services: Kafka at {settings.kafka_bootstrap}")
    if services.main(settings, "up") != 0:
        return 1
    open_store(settings.clickhouse_dsn, owner="rlpulse demo").close()  # a held store fails here, not in the sink's log
    ensure_topics(settings)
    project = time.strftime("demo-%Y%m%d-%H%M%S")
    with Pipeline(settings) as pipeline:
        _say(f"starting the streams worker and the sink (logs in {pipeline.log_dir})")
        pipeline.start()
        with Ticker("waiting for the streams worker and the sink to join their consumer groups", say=_say):
            wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        _say(f"simulating 3 training runs of project {project} through the SDK")
        config = SimConfig(project=project, runs=3, steps=4, rollouts_per_step=8, stall_s=DEMO_STALL_AFTER_S + 3,
                           gpu=True)
        truth = simulate(settings, config, progress=_say)
        # the last window closes at its end + lateness; the per-step figures settle within seconds after
        window_ns = int(DEMO_WINDOW_S * 1e9)
        last_close = (time.time_ns() // window_ns + 1) * window_ns + int((DEMO_LATENESS_S + 3) * 1e9)
        _say(
            f"published {truth.spans} spans, {truth.step_events} step events and {truth.gpu_samples} GPU samples; "
            f"waiting for the last {DEMO_WINDOW_S:.0f}s window to close and the sink to catch up"
        )
        with Ticker("waiting for the last window to close and the sink to catch up", say=_say) as ticker:

            def progress(line: str) -> None:
                _say(line)
                ticker.update(line)

            pipeline.wait_caught_up(last_close, progress=progress)
        _say("caught up; stopping the sink and the streams")
        pipeline.stop()
    with open_store(settings.clickhouse_dsn, owner="rlpulse demo") as store:
        _say(f"report from ClickHouse ({store.url}, database {store.database})")
        print_report(store, project=project)
        columns, rows = failures_by_cause(store, project)
        fired = set(
            store.client.query(
                f"SELECT rule, key, state FROM {store.database}.alerts FINAL WHERE project = {{p:String}}",
                parameters={"p": project},
            ).result_rows
        )
    stored: dict[tuple[str, str, str], int] = {}  # (run, term, cause), over the run's attempts
    for run_id, _attempt, term, cause, failures, *_ in rows:
        stored[(run_id, term, cause)] = stored.get((run_id, term, cause), 0) + failures
    sent: dict[tuple[str, str, str], int] = dict(truth.failures)
    mismatches = {k: (sent.get(k, 0), stored.get(k, 0)) for k in set(sent) | set(stored) if sent.get(k, 0) != stored.get(k, 0)}
    if mismatches:
        _say(f"MISMATCH between what was sent and ClickHouse (sent, stored): {mismatches}")
        return 1
    missing = truth.expected_alerts - fired
    if missing:
        _say(f"MISSING alerts the simulation should have caused: {sorted(missing)}")
        return 1
    _say(f"every alert the simulation should cause fired and resolved as expected ({len(truth.expected_alerts)})")
    _say(
        f"ClickHouse agrees with what the simulator sent: {sum(sent.values())} grader failures in "
        f"{len({run for run, _, _ in sent})} runs, every term and cause accounted for"
    )
    _say(f"done in {time.monotonic() - started:.0f}s")
    return 0
