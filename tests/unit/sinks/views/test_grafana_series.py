"""Each time series panel of the Grafana dashboard, run on a chDB store with rows, draws exactly the
points it should: the run's and attempt's only, within the time range, deduplicated, in time order,
with the columns the plugin's time series format and the panel's legend expect.

The store holds run ``run-1`` attempt 1, its replayed (older) emissions, and rows that must not
show: another run, another attempt, a GPU sample of no run, a window outside the time range.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from rlpulse.sinks.views.grafana import dashboard, flat_panels, grafana_interpolate
from rlpulse.sinks.views.grafana_panels import ROWS
from tests.unit.sinks.views.test_grafana import TEST_VALUES

REPO = Path(__file__).resolve().parents[4]
S = 1_000_000_000
# Recent times: the tables' TTL (90 / 365 days) deletes older rows as they are inserted. The time range
# is the last day; T0 an hour ago, on a whole minute; OUTSIDE past the range's end.
T0 = (int(time.time()) // 60 * 60 - 3600) * S
FROM_MS, TO_MS = (T0 // S - 86400) * 1000, (T0 // S + 1800) * 1000
OUTSIDE = (TO_MS // 1000 + 600) * S

LOAD = textwrap.dedent("""
    import json, sys
    from rlpulse.sinks.store.clickhouse import migrate, open_store
    T0, OUTSIDE, S = (int(a) for a in sys.argv[3:6])
    rows = {
        "steps": (["project", "run_id", "attempt", "time_ns", "type", "step", "writer_id", "sequence_id"], [
            ["p", "run-1", 1, T0 - 10 * S, "RUN_START", -1, "w", 0],
            ["p", "run-1", 1, T0, "STEP", 0, "w", 1],
            ["p", "run-1", 1, T0 + 60 * S, "STEP", 1, "w", 2],
            ["p", "run-1", 1, T0 + 120 * S, "STEP", 2, "w", 3],
            ["p", "run-2", 1, T0, "STEP", 0, "w", 1],
        ]),
        # step 1 emitted twice (the later wins); step 3 has no STEP event (its time: when it was emitted)
        "step_stats": (["project", "run_id", "attempt", "step", "reward_mean", "clipped_ratio", "emitted_at_ns"], [
            ["p", "run-1", 1, 0, 0.5, 0.1, T0 + 1 * S],
            ["p", "run-1", 1, 1, 0.3, 0.9, T0 + 50 * S],
            ["p", "run-1", 1, 1, 0.6, 0.2, T0 + 61 * S],
            ["p", "run-1", 1, 2, 0.7, 0.25, T0 + 121 * S],
            ["p", "run-1", 1, 3, 0.8, 0.3, T0 + 200 * S],
            ["p", "run-1", 2, 0, 5.0, 0.5, T0 + 1 * S],
            ["p", "run-2", 1, 0, 9.0, 0.5, T0 + 1 * S],
        ]),
        "reward_histograms": (["project", "run_id", "attempt", "step", "term", "bounds", "bucket_counts", "count", "min",
                               "max", "emitted_at_ns"], [
            ["p", "run-1", 1, step, "total", [0.5], [2, 2], 4, 0.1, 0.9, T0 + 1 * S] for step in (0, 1)
        ]),
        "grader_failures": (["project", "run_id", "attempt", "term", "cause", "window_start_ns", "window_end_ns",
                             "failures", "graded", "emitted_at_ns"], [
            ["p", "run-1", 1, "judge", "timeout", T0, T0 + 60 * S, 1, 5, T0 + 30 * S],
            ["p", "run-1", 1, "judge", "timeout", T0, T0 + 60 * S, 2, 10, T0 + 61 * S],
            ["p", "run-1", 1, "format", "timeout", T0, T0 + 60 * S, 1, 8, T0 + 61 * S],
            ["p", "run-1", 1, "judge", "error", T0, T0 + 60 * S, 3, 10, T0 + 61 * S],
            ["p", "run-1", 1, "judge", "timeout", T0 + 60 * S, T0 + 120 * S, 4, 10, T0 + 121 * S],
            ["p", "run-1", 1, "judge", "timeout", OUTSIDE, OUTSIDE + 60 * S, 7, 10, OUTSIDE + 61 * S],
            ["p", "run-2", 1, "judge", "timeout", T0, T0 + 60 * S, 100, 100, T0 + 61 * S],
        ]),
        "grader_windows": (["project", "run_id", "attempt", "term", "window_start_ns", "window_end_ns", "graded",
                            "failures", "emitted_at_ns"], [
            ["p", "run-1", 1, "judge", T0, T0 + 60 * S, 4, 4, T0 + 30 * S],
            ["p", "run-1", 1, "judge", T0, T0 + 60 * S, 10, 5, T0 + 61 * S],
            ["p", "run-1", 1, "format", T0, T0 + 60 * S, 8, 1, T0 + 61 * S],
            ["p", "run-1", 1, "judge", T0 + 60 * S, T0 + 120 * S, 0, 0, T0 + 121 * S],
            ["p", "run-1", 2, "judge", T0, T0 + 60 * S, 1, 1, T0 + 61 * S],
        ]),
        # pod-a's first sample twice (a replay); the second engine has no pod: its URL names it
        "engine_samples": (["project", "run_id", "attempt", "pod", "url", "engine", "time_ns", "kv_cache_usage",
                            "requests_running", "requests_waiting"], [
            ["p", "run-1", 1, "pod-a", "http://a:8000", "vllm", T0 + 5 * S, 0.5, 3.0, 1.0],
            ["p", "run-1", 1, "pod-a", "http://a:8000", "vllm", T0 + 5 * S, 0.5, 3.0, 1.0],
            ["p", "run-1", 1, "pod-a", "http://a:8000", "vllm", T0 + 20 * S, 0.75, 4.0, 0.0],
            ["p", "run-1", 1, "", "http://e2:8000", "vllm", T0 + 5 * S, 0.25, 1.0, 2.0],
            ["p", "run-2", 1, "pod-z", "http://z:8000", "vllm", T0 + 5 * S, 1.0, 9.0, 9.0],
        ]),
        "gpu_samples": (["project", "run_id", "attempt", "time_ns", "hw_id", "index", "host", "gpu_utilization",
                         "power_w"], [
            ["p", "run-1", 1, T0 + 5 * S, "GPU-a", 0, "h1", 0.9, 300.0],
            ["p", "run-1", 1, T0 + 5 * S, "GPU-a", 0, "h1", 0.9, 300.0],
            ["p", "run-1", 1, T0 + 15 * S, "GPU-a", 0, "h1", 0.4, 200.0],
            ["p", "run-1", 1, T0 + 5 * S, "GPU-b", 1, "h1", 0.1, 100.0],
            ["", "", 0, T0 + 25 * S, "GPU-b", 1, "h1", 0.0, 50.0],
            ["p", "run-2", 1, T0 + 5 * S, "GPU-c", 0, "h2", 1.0, 400.0],
        ]),
    }
    out = {}
    with open_store(sys.argv[1], owner="test") as store:
        migrate(store)
        for table, (columns, data) in rows.items():
            store.client.insert(f"rlpulse.{table}", data, column_names=columns)
        for title, sql in json.loads(sys.argv[2]).items():
            result = store.client.query(sql, settings={"readonly": 1})
            out[title] = {"columns": list(result.column_names), "types": [t.name for t in result.column_types],
                          "rows": [[v.isoformat() if hasattr(v, "isoformat") else v for v in row]
                                   for row in result.result_rows]}
    print(json.dumps(out))
""")


def at(seconds: int) -> str:
    """A point's time as the query returns it (UTC), ``seconds`` after T0."""
    return datetime.fromtimestamp(T0 // S + seconds, timezone.utc).replace(tzinfo=None).isoformat()


def expanded(sql: str) -> str:
    """As Grafana and the plugin expand a panel's SQL for the run, over FROM_MS .. TO_MS."""
    sql = grafana_interpolate(sql, TEST_VALUES)
    return sql.replace("$__fromTime_ms", f"fromUnixTimestamp64Milli({FROM_MS})").replace(
        "$__toTime_ms", f"fromUnixTimestamp64Milli({TO_MS})")


EXPECTED = {
    "Reward per step": [[at(0), 0.5, 0.18, 0.5, 0.82], [at(60), 0.6, 0.18, 0.5, 0.82], [at(120), 0.7, None, None, None],
                        [at(200), 0.8, None, None, None]],
    "Clipped ratio": [[at(0), 0.1], [at(60), 0.2], [at(120), 0.25], [at(200), 0.3]],
    "Grader failures by cause": [[at(0), "error", 3], [at(0), "timeout", 3], [at(60), "timeout", 4]],
    "Grader failure rate by term": [[at(0), "format", 0.125], [at(0), "judge", 0.5], [at(60), "judge", 0.0]],
    "Engine KV-cache usage": [[at(5), "http://e2:8000", 0.25], [at(5), "pod-a", 0.5], [at(20), "pod-a", 0.75]],
    "Engine queue: requests running and waiting": [[at(5), "http://e2:8000", 1.0, 2.0], [at(5), "pod-a", 3.0, 1.0],
                                                   [at(20), "pod-a", 4.0, 0.0]],
    "GPU utilisation": [[at(5), "h1 gpu 0", 0.9], [at(5), "h1 gpu 1", 0.1], [at(15), "h1 gpu 0", 0.4]],
    "GPU power": [[at(5), "h1 gpu 0", 300.0], [at(5), "h1 gpu 1", 100.0], [at(15), "h1 gpu 0", 200.0]],
}


@pytest.mark.full  # a chDB store migrated and filled in a subprocess: a few seconds
def test_each_time_series_draws_exactly_its_runs_points(tmp_path: Path) -> None:
    pytest.importorskip("chdb")
    series = {ts.title: ts for _, row in ROWS for ts in row}
    queries = {p["title"]: expanded(p["targets"][0]["rawSql"]) for p in flat_panels(dashboard()) if p["type"] == "timeseries"}
    assert list(queries) == list(series) == list(EXPECTED)
    run = subprocess.run([sys.executable, "-c", LOAD, f"chdb://{tmp_path / 'ch'}", json.dumps(queries), str(T0),
                          str(OUTSIDE), str(S)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    for title, ts in series.items():
        got = out[title]
        # what the plugin's time series format reads: a DateTime64 time first, text labels, numbers
        assert got["columns"] == list(ts.columns), title
        types = dict(zip(got["columns"], got["types"]))
        assert types["time"].startswith("DateTime64("), (title, types)
        assert all("String" in types[c] for c in ts.labels), (title, types)
        assert all("Float" in types[c] or "Int" in types[c] for c in ts.values), (title, types)
        assert got["rows"] == EXPECTED[title], title
