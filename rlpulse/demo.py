"""``rlpulse demo``: the main job, end to end on the real broker and ClickHouse engine."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any
from urllib.parse import urlencode

from rlpulse import services
from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.progress import Ticker
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from rlpulse.producers.simulators.simulator import GroundTruth, SimConfig

# Short windows so the demo's windows close (by wall clock) within seconds.
DEMO_WINDOW_S = 5.0
DEMO_LATENESS_S = 2.0
DEMO_STALL_AFTER_S = 4.0  # one simulated run stalls for longer than this
DEMO_STEP_S = 0.5  # each simulated step lasts this long, so the engine's samples fall between step events
# The engine's samples are dated within the first run (4 steps of DEMO_STEP_S at least): its saturation
# episode covers about two thirds of them, longer than this.
DEMO_ENGINE_SATURATED_AFTER_S = 1.0
UI_PORT = 8421  # `rlpulse ui`'s default port


def demo_settings(settings: Settings) -> Settings:
    """``settings`` with the demo's short windows and thresholds (topics, broker and store unchanged)."""
    alerts = dataclasses.replace(settings.alerts, engine_saturated_after=DEMO_ENGINE_SATURATED_AFTER_S)
    return dataclasses.replace(settings, window=DEMO_WINDOW_S, allowed_lateness=DEMO_LATENESS_S,
                               stall_after=DEMO_STALL_AFTER_S, silent_after=30.0, heartbeat_interval=1.0, alerts=alerts)


def demo_config(project: str) -> SimConfig:
    """The demo's three simulated runs: rollouts with graders failing by every cause, trainer scalars,
    checkpoint saves, a GPU each (an XID and a slowdown on the first), a stall in the last."""
    return SimConfig(project=project, runs=3, steps=4, rollouts_per_step=8, stall_s=DEMO_STALL_AFTER_S + 3, gpu=True,
                     checkpoint_every=2, step_s=DEMO_STEP_S)


def _say(line: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {line}", flush=True)


def run_demo(settings: Settings) -> int:
    from rlpulse.producers.simulators.simulator import simulate
    from rlpulse.sinks.store.clickhouse import open_store
    from rlpulse.sinks.views.report import failures_by_cause, print_report

    settings = demo_settings(settings)
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
        truth = simulate(settings, demo_config(project), progress=_say)
        traced, engines, capacity = simulate_signals(settings, project, truth)
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
    if not _print_signals(settings, project, traced, engines, capacity):
        return 1
    _say(f"done in {time.monotonic() - started:.0f}s")
    _open_next(project, truth)
    return 0


def _open_next(project: str, truth: GroundTruth) -> None:
    """What to open next, with this demo's project, run and time range filled in."""
    prog = os.path.relpath(sys.argv[0]) if os.path.basename(sys.argv[0]) == "rlpulse" else "rlpulse"
    run = f"{project}-run1"  # the run with every panel: engines, a GPU with an XID, checkpoints
    first = min(start for start, _ in truth.times.values())
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(first // 1_000_000_000 - 60))
    until = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(time.time() + 60))
    page = f"http://127.0.0.1:{UI_PORT}/run?" + urlencode({"project": project, "run": run, "attempt": 1})
    print(f"""
== open next ==
  {prog} ui
      the runs in a browser, on http://127.0.0.1:{UI_PORT}/ (open the link it prints: it carries the page's token);
      run {run}'s page: {page}
  {prog} watch --project {project} --metric loss --metric kl
      a live terminal view of the runs, with the trainer's loss and KL as columns (Ctrl-C quits)
  {prog} query --saved failures-by-cause --param since='{since}' --param until='{until}'
      grader failures by run, term and cause (`{prog} query --list` lists every saved query)""", flush=True)


def simulate_signals(settings: Settings, project: str, truth: GroundTruth) -> tuple[Any, int, int]:
    """Simulated signals besides the runs: a traced agent's run (LLM and tool calls, content on), a
    vLLM engine's samples for the first run (a sleep/wake cycle and a saturation episode) and two
    pools' capacity reported by two service instances."""
    from rlpulse.producers.simulators.engine_sim import simulate_capacity, simulate_engine_during
    from rlpulse.producers.simulators.tracing_sim import simulate_traced_agent

    traced = simulate_traced_agent(settings, project=project, run_id=f"{project}-agent")
    run = f"{project}-run1"
    engines = len(simulate_engine_during(settings, project, run, *truth.times[run]))
    capacity = simulate_capacity(settings, project=project)
    _say(f"published a traced agent's run ({traced.llm_calls} LLM and {traced.tool_calls} tool calls in {traced.spans} "
         f"spans), {engines} engine samples and {capacity} capacity reports")
    return traced, engines, capacity


def _print_signals(settings: Settings, project: str, traced: Any, engines: int, capacity: int) -> bool:
    """The traced agent's span tree, the engine's figures and the capacity table, read from ClickHouse."""
    from rlpulse.sinks.views.capacity import capacity_tables, render_capacity
    from rlpulse.sinks.store.clickhouse import open_store
    from rlpulse.sinks.read.queries import saved_sql
    from rlpulse.base.terminal import print_table

    with open_store(settings.clickhouse_dsn, owner="rlpulse demo") as store:
        params = {"run_id": traced.run_id, "attempt": "1", "rollout_id": traced.example}
        tree = store.client.query(saved_sql("span-tree", params, store.database), parameters=params)
        rows = [dict(zip(tree.column_names, r)) for r in tree.result_rows]
        print(f"\n== traced agent {traced.run_id}, rollout {traced.example}: its span tree (saved query span-tree) ==")
        for r in rows:
            print(f"  {'  ' * int(r['depth'])}{r['kind']:<8} {r['name']}  {r['duration_ms']:.0f} ms  {r['status']}")
        engine = store.client.query(f"""
            SELECT pod, count() AS samples, max(requests_waiting) AS max_waiting, round(max(kv_cache_usage), 3) AS max_kv,
                   round(avg(awake), 3) AS awake_share, round(quantile(0.5)(ttft_p90_s), 3) AS ttft_p90_s,
                   -- hits over lookups of the whole run: each sample's rate weighted by its lookups
                   round(sum(prefix_cache_hit_rate * prefix_cache_queries) / sum(prefix_cache_queries), 3)
                       AS prefix_cache_hit_rate,
                   round(sum(queue_time_mean_s * queue_time_count) / sum(queue_time_count), 4) AS queue_time_mean_s,
                   round(sum(itl_mean_s * itl_count) / sum(itl_count), 4) AS itl_mean_s
            FROM {store.database}.engine_samples FINAL WHERE project = {{p:String}} GROUP BY pod ORDER BY pod""",
            parameters={"p": project})
        print(f"\n== rollout engines of project {project} (engine_samples) ==")
        print_table(engine.column_names, engine.result_rows)
        saturated = store.client.query(f"SELECT state FROM {store.database}.alerts FINAL WHERE rule = 'engine_saturated' "
                                       "AND project = {p:String} ORDER BY time_ns", parameters={"p": project}).result_rows
    with open_store(settings.clickhouse_dsn, owner="rlpulse demo") as store:  # run_query leaves its client read-only
        pools, projects = capacity_tables(store)
    print("\n== capacity (rlpulse capacity) ==")
    print(render_capacity(pools, projects), end="")
    ok = bool(rows) and engine.result_rows and [s for (s,) in saturated] == ["FIRING", "RESOLVED"] and pools
    if not ok:
        _say(f"MISSING signals: span tree {len(rows)} spans, engine rows {len(engine.result_rows)}, "
             f"engine_saturated {saturated}, capacity pools {len(pools)}")
        return False
    _say(f"the traced agent's tree ({len(rows)} spans), {engines} engine samples with one engine_saturated episode, "
         f"and {capacity} capacity reports are in ClickHouse")
    return True
