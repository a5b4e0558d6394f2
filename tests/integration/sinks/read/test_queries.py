"""``rlpulse query``: read-only execution, server-side parameters, output formats, saved queries.

No broker: each test makes a fresh chDB store, inserts known rows directly, closes it, and runs
the real CLI in a subprocess (chDB allows one process per store).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from rlpulse.sinks.store.clickhouse import migrate, open_store
from rlpulse.streams.histograms import REWARD_BOUNDS, RewardHistogram

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[4]
S = 1_000_000_000
# An hour ago on a whole second: recent enough for the tables' TTL, clean to read back.
T0 = (time.time_ns() // S - 3600) * S


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"chdb://{tmp_path / 'ch'}"


def seed(url: str, tables: dict[str, list[dict[str, Any]]]) -> None:
    """Migrate the store and insert ``rows`` per table; closes the store so the CLI can open it.

    Duplicate keys are kept as rows (``optimize_on_insert=0``), as after a replay that the
    ReplacingMergeTree has not merged yet; the saved queries must count them once.
    """
    with open_store(url, owner="test") as store:
        migrate(store)
        for table, rows in tables.items():
            columns = list(rows[0])
            store.client.insert(f"rlpulse.{table}", [[r[c] for c in columns] for r in rows], column_names=columns,
                                settings={"optimize_on_insert": 0})
            stored = store.client.query(f"SELECT count() FROM rlpulse.{table}").result_rows[0][0]
            assert stored == len(rows), f"{table}: {stored} rows stored of {len(rows)} inserted"


def cli(url: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, RLPULSE_CLICKHOUSE_URL=url, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "rlpulse.cli", "query", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def ok(url: str, *args: str) -> str:
    run = cli(url, *args)
    assert run.returncode == 0, run.stderr
    return run.stdout


def rows(url: str, *args: str) -> list[dict[str, Any]]:
    return json.loads(ok(url, *args, "--format", "json"))


def iso(ns: int) -> str:
    """A DateTime64 in UTC as --format json writes it (naive ISO, microseconds)."""
    return datetime.fromtimestamp(ns // S, timezone.utc).replace(tzinfo=None, microsecond=(ns % S) // 1000).isoformat()


def span(span_id: str, parent: str | None, name: str, seq: int, rollout: str = "ro-1", run_id: str = "r1") -> dict:
    return {"project": "p", "run_id": run_id, "attempt": 1, "stage": "rollout", "trace_id": "t1", "span_id": span_id,
            "parent_span_id": parent, "name": name, "kind": "INTERNAL", "start_time_ns": T0 + seq * S,
            "end_time_ns": T0 + seq * S + 250_000_000, "status": "OK", "status_message": "", "rollout_id": rollout,
            "attempt_id": "a1", "sequence_id": seq}


# ---------------------------------------------------------------- read-only, params, formats


@pytest.mark.parametrize("sql", [
    "DROP TABLE rlpulse.spans",
    "INSERT INTO rlpulse.spans (run_id, span_id) VALUES ('evil', 'x')",
    "ALTER TABLE rlpulse.spans DELETE WHERE 1",
    "TRUNCATE TABLE rlpulse.spans",
    "SELECT 1 SETTINGS readonly = 0",
])
def test_writes_are_refused_read_only_and_leave_the_data(url: str, sql: str) -> None:
    seed(url, {"spans": [span("s1", None, "rollout", 0), span("s2", "s1", "generate", 1)]})
    run = cli(url, sql)
    assert run.returncode == 1
    assert run.stdout == ""
    assert "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "read-only" in run.stderr
    assert "readonly mode" in run.stderr or "READONLY" in run.stderr  # ClickHouse's own reason
    assert (
        ok(url, "SELECT count() AS n, groupArray(span_id) AS ids FROM rlpulse.spans", "--format", "csv")
        == 'n,ids\n2,"[""s1"",""s2""]"\n'
    )


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT 1; DROP TABLE rlpulse.steps; SELECT 1",
        "SELECT 1; DROP TABLE rlpulse.steps",
        "SELECT 1 -- \n; DROP TABLE rlpulse.steps",
        "DROP TABLE rlpulse.steps; SELECT 1",
    ],
)
def test_more_than_one_statement_is_refused_and_the_table_stays(url: str, sql: str) -> None:
    """A text of several statements: the chDB backend once ran each on its own, readonly=1
    applied to the last only, and the DROP went through. Exactly one read-only statement runs."""
    seed(url, {"spans": [span("s1", None, "rollout", 0)]})
    run = cli(url, sql)
    assert (run.returncode, run.stdout) == (1, "")
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert run.stderr.startswith("rlpulse query: refused: "), run.stderr
    assert "exactly one read-only statement" in run.stderr or "Drop is not a read" in run.stderr
    assert rows(
        url, "SELECT name FROM system.tables WHERE database = 'rlpulse' AND name IN ('spans', 'steps') ORDER BY name"
    ) == [{"name": "spans"}, {"name": "steps"}]
    assert ok(url, "SELECT 1 AS one;", "--format", "csv") == "one\n1\n"  # one statement and its ';' still run


def test_other_clickhouse_errors_are_one_line(url: str) -> None:
    seed(url, {"spans": [span("s1", None, "rollout", 0)]})
    run = cli(url, "SELECT nope FROM rlpulse.spans")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "UNKNOWN_IDENTIFIER" in run.stderr


def test_params_are_server_side_and_a_quote_is_not_injected(url: str) -> None:
    seed(
        url,
        {
            "spans": [
                span("s1", None, "rollout", 0),
                span("s2", "s1", "generate", 1),
                span("s3", None, "rollout", 0, rollout="ro-2", run_id="r2"),
            ]
        },
    )
    sql = "SELECT span_id, name FROM rlpulse.spans WHERE run_id = {run:String} ORDER BY span_id"
    assert ok(url, sql, "--param", "run=r1", "--format", "csv") == "span_id,name\ns1,rollout\ns2,generate\n"
    assert ok(url, sql, "--param", "run=r1' OR '1'='1", "--format", "csv") == "span_id,name\n"
    assert ok(url, sql, "--param", "run=r2' OR run_id != '", "--format", "csv") == "span_id,name\n"
    value = """it's "quoted" \\ {x:String}"""
    assert rows(url, "SELECT {v:String} AS v, {n:UInt32} + 1 AS n", "--param", f"v={value}", "--param", "n=41") == [
        {"v": value, "n": 42}
    ]
    bad = cli(url, "SELECT {n:UInt32} AS n", "--param", "n=1; DROP TABLE rlpulse.spans")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert ok(url, "SELECT count() AS n FROM rlpulse.spans", "--format", "csv") == "n\n3\n"
    assert cli(url, sql, "--param", "noequals").returncode == 2


def test_formats_are_exact(url: str) -> None:
    seed(url, {"spans": [span("s1", None, "rollout", 0)]})
    sql = (
        "SELECT 1 AS n, 0.25 AS x, 'a,b \"c\"' AS s, CAST(NULL AS Nullable(String)) AS z, [1, 2] AS arr, "
        "toDateTime64('2024-05-06 07:08:09.5', 3, 'UTC') AS t"
    )
    assert ok(url, sql, "--format", "csv") == ('n,x,s,z,arr,t\n1,0.25,"a,b ""c""",,"[1,2]",2024-05-06T07:08:09.500000\n')
    assert json.loads(ok(url, sql, "--format", "json")) == [
        {"n": 1, "x": 0.25, "s": 'a,b "c"', "z": None, "arr": [1, 2], "t": "2024-05-06T07:08:09.500000"}
    ]
    assert ok(url, sql) == (
        "n  x     s        z  arr     t\n"
        "-  ----  -------  -  ------  --------------------------\n"
        '1  0.25  a,b "c"     [1, 2]  2024-05-06 07:08:09.500000\n'
    )
    assert ok(url, "SELECT 1 AS n WHERE 0", "--format", "json") == "[]\n"


def test_saved_queries_are_listed_and_an_unknown_name_lists_them(url: str) -> None:
    listing = ok(url, "--list")
    # a name starts each entry; its description and parameters wrap under it, indented
    names = [line.split()[0] for line in listing.splitlines() if not line.startswith(" ")]
    assert {
        "stalled-runs",
        "failures-by-cause",
        "reward-percentiles",
        "clipped-ratio-trend",
        "gpu-utilization-by-run",
        "span-tree",
    } <= set(names)
    assert "p10/p50/p90 of the total reward" in listing
    run = cli(url, "--saved", "nope")
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "no saved query 'nope'" in run.stderr
    for name in names:
        assert name in run.stderr
    missing = cli(url, "--saved", "span-tree", "--param", "run_id=r1")
    assert missing.returncode == 2 and "attempt" in missing.stderr and "rollout_id" in missing.stderr


# ---------------------------------------------------------------- saved queries


def alert(rule: str, key: str, state: str, t: int, first: int) -> dict:
    run_id, attempt = key.split("/")
    return {
        "rule": rule,
        "state": state,
        "key": key,
        "severity": "critical",
        "summary": f"{key} {state}",
        "value": float(t - first) / S,
        "threshold": 900.0,
        "project": "p",
        "run_id": run_id,
        "attempt": int(attempt),
        "time_ns": T0 + t,
        "first_seen_ns": T0 + first,
        "last_seen_ns": T0 + t,
    }


def test_stalled_runs(url: str) -> None:
    firing = alert("stalled_run", "r1/1", "FIRING", 10 * S, 10 * S)
    seed(
        url,
        {
            "alerts": [
                firing,
                dict(firing),  # replayed: one row twice
                alert("stalled_run", "r2/1", "FIRING", 10 * S, 10 * S),
                alert("stalled_run", "r2/1", "RESOLVED", 20 * S, 10 * S),
                alert("stalled_run", "r3/2", "FIRING", 5 * S, 5 * S),
                alert("stalled_run", "r3/2", "RESOLVED", 8 * S, 5 * S),
                alert("stalled_run", "r3/2", "FIRING", 30 * S, 30 * S),  # a second episode
                alert("silent_run", "r4/1", "FIRING", 10 * S, 10 * S),
            ]
        },
    )
    got = rows(url, "--saved", "stalled-runs")
    assert [(r["run_id"], r["attempt"], r["key"], r["stalled_since"], r["summary"]) for r in got] == [
        ("r1", 1, "r1/1", iso(T0 + 10 * S), "r1/1 FIRING"),
        ("r3", 2, "r3/2", iso(T0 + 30 * S), "r3/2 FIRING"),
    ]


def failure_row(run_id: str, cause: str, window: int, failures: int, graded: int, emitted: int, term: str = "judge") -> dict:
    return {
        "project": "p",
        "run_id": run_id,
        "attempt": 1,
        "term": term,
        "cause": cause,
        "window_start_ns": T0 + window * 60 * S,
        "window_end_ns": T0 + (window + 1) * 60 * S,
        "failures": failures,
        "graded": graded,
        "emitted_at_ns": T0 + emitted,
    }


def test_failures_by_cause(url: str) -> None:
    seed(
        url,
        {
            "grader_failures": [
                failure_row("r1", "timeout", 0, 3, 15, 1),
                failure_row("r1", "timeout", 0, 3, 15, 1),  # replayed duplicate
                failure_row("r1", "timeout", 1, 9, 9, 2),  # superseded by the later emission below
                failure_row("r1", "timeout", 1, 3, 10, 3),
                failure_row("r1", "parse", 0, 1, 10, 1),
                failure_row("r1", "timeout", 0, 4, 8, 1, term="format"),
                failure_row("r2", "timeout", 1, 0, 7, 2),
                failure_row("r1", "timeout", 5, 50, 50, 6),  # window outside [since, until)
                failure_row("r1", "timeout", -2, 50, 50, 6),
            ]
        },
    )
    since, until = iso(T0).replace("T", " "), iso(T0 + 5 * 60 * S).replace("T", " ")
    got = rows(url, "--saved", "failures-by-cause", "--param", f"since={since}", "--param", f"until={until}")
    assert [(r["run_id"], r["term"], r["cause"], r["windows"], r["failures"], r["graded"], r["failure_rate"]) for r in got] == [
        ("r1", "format", "timeout", 1, 4, 8, 0.5),
        ("r1", "judge", "parse", 1, 1, 10, 0.1),
        ("r1", "judge", "timeout", 2, 6, 25, 0.24),
        ("r2", "judge", "timeout", 1, 0, 7, 0.0),
    ]


def histogram_row(step: int, rewards: list[float], emitted: int, term: str = "total") -> dict:
    h = RewardHistogram()
    for x in rewards:
        h.add(x)
    return {
        "project": "p",
        "run_id": "r1",
        "attempt": 1,
        "step": step,
        "term": term,
        "bounds": [float(b) for b in REWARD_BOUNDS],
        "bucket_counts": list(h.counts),
        "count": h.count,
        "sum": h.sum,
        "min": h.min,
        "max": h.max,
        "zero_fraction": h.zeros / h.count,
        "emitted_at_ns": T0 + emitted,
    }


def estimate(row: dict, q: float) -> float:
    """The .sql file's interpolation, in Python."""
    b, c, n = row["bounds"], row["bucket_counts"], row["count"]
    r, cum = q * n, 0
    for k, ck in enumerate(c):
        if cum + ck >= r:
            lo = row["min"] if k == 0 else max(b[k - 1], row["min"])
            hi = row["max"] if k == len(c) - 1 else min(b[k], row["max"])
            return lo + (hi - lo) * (r - cum) / ck
        cum += ck
    raise AssertionError


def true_percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    i = int(pos)
    return xs[i] + (xs[min(i + 1, len(xs) - 1)] - xs[i]) * (pos - i)


def bucket_width(x: float) -> float:
    edges = [min(REWARD_BOUNDS[0], x)] + list(REWARD_BOUNDS) + [max(REWARD_BOUNDS[-1], x)]
    for lo, hi in zip(edges, edges[1:]):
        if x <= hi:
            return hi - lo
    raise AssertionError


def test_reward_percentiles(url: str) -> None:
    rng = random.Random(3)
    rewards = {
        0: [round(rng.uniform(0, 1), 3) for _ in range(300)] + [0.0] * 40,
        1: [round(rng.uniform(0.5, 1.8), 3) for _ in range(200)] + [round(rng.uniform(-0.5, 0), 3) for _ in range(30)],
        2: [0.0] * 10,
        3: [round(rng.betavariate(5, 2), 3) for _ in range(500)],
    }
    latest = {step: histogram_row(step, xs, emitted=10) for step, xs in rewards.items()}
    seed(
        url,
        {
            "reward_histograms": [
                *latest.values(),
                latest[0],  # replayed duplicate
                histogram_row(1, [5.0] * 7, emitted=5),  # an older emission of step 1: superseded
                histogram_row(0, [0.99] * 50, emitted=10, term="judge"),  # another term
                {**histogram_row(0, [0.5], emitted=10), "run_id": "r2"},  # another run
            ]
        },
    )
    got = rows(url, "--saved", "reward-percentiles", "--param", "run_id=r1", "--param", "attempt=1")
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    for r in got:
        xs, row = rewards[r["step"]], latest[r["step"]]
        assert r["count"] == len(xs)
        assert r["min"] == round(min(xs), 4) and r["max"] == round(max(xs), 4)
        for name, q in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9)):
            assert r[name] == pytest.approx(estimate(row, q), abs=1e-4), (r["step"], name)
            truth = true_percentile(xs, q)
            assert abs(r[name] - truth) <= bucket_width(truth) + 1e-9, (r["step"], name, r[name], truth)
    assert (got[2]["p10"], got[2]["p50"], got[2]["p90"]) == (0.0, 0.0, 0.0)


def step_stats_row(step: int, rollouts: int, clipped: int, emitted: int, run_id: str = "r1") -> dict:
    return {
        "project": "p",
        "run_id": run_id,
        "attempt": 1,
        "step": step,
        "rollouts": rollouts,
        "clipped": clipped,
        "clipped_ratio": clipped / rollouts,
        "emitted_at_ns": T0 + emitted,
    }


def test_clipped_ratio_trend(url: str) -> None:
    seed(
        url,
        {
            "step_stats": [
                step_stats_row(0, 20, 2, 1),
                step_stats_row(1, 8, 7, 1),  # superseded by the later emission of step 1
                step_stats_row(1, 20, 5, 2),
                step_stats_row(1, 20, 5, 2),  # and replayed
                step_stats_row(2, 20, 4, 3),
                step_stats_row(3, 20, 10, 4),
                step_stats_row(0, 20, 20, 1, run_id="r2"),
            ]
        },
    )
    out = ok(url, "--saved", "clipped-ratio-trend", "--param", "run_id=r1", "--param", "attempt=1", "--format", "csv")
    assert out == (
        "step,rollouts,clipped,clipped_ratio,change\n0,20,2,0.1,\n1,20,5,0.25,0.15\n2,20,4,0.2,-0.05\n3,20,10,0.5,0.3\n"
    )


def placement(run_id: str, hw_id: str, role: str, rank: int, t: int, index: int = 0, host: str = "h1") -> dict:
    return {
        "project": "p",
        "run_id": run_id,
        "attempt": 1,
        "stage": "train",
        "time_ns": T0 + t * S,
        "role": role,
        "rank": rank,
        "pod": f"{run_id}-{role}-{rank}",
        "node": host,
        "host": host,
        "index": index,
        "hw_id": hw_id,
    }


def gpu_sample(hw_id: str, t: int, utilization: float, power: float, index: int = 0, host: str = "h1") -> dict:
    # run_id is left empty on purpose: the query must find the run through placements.
    return {
        "project": "p",
        "run_id": "",
        "attempt": 0,
        "time_ns": T0 + t * S,
        "hw_id": hw_id,
        "index": index,
        "host": host,
        "node": host,
        "pod": "",
        "power_w": power,
        "temperature_c": 50.0,
        "gpu_utilization": utilization,
        "memory_used_bytes": 0,
        "memory_total_bytes": 0,
        "memory_utilization": 0.0,
        "memory_activity": 0.0,
        "sm_clock_mhz": 0.0,
        "throttle_reasons": 0,
        "xid_errors": 0,
    }


def test_gpu_utilization_by_run(url: str) -> None:
    placements = (
        # run A: trainer on GPU-a (placements every 60 s up to 240 s, so it holds GPU-a until 300 s)
        [placement("A", "GPU-a", "trainer", 0, t) for t in range(0, 241, 60)]
        # run A: rollout on GPU-m at 0..120 s; then GPU-m moves to run B at 150 s (before 120 + 60)
        + [placement("A", "GPU-m", "rollout", 1, t, index=1) for t in (0, 60, 120)]
        + [placement("B", "GPU-m", "rollout", 0, t, index=1) for t in range(150, 391, 60)]
        # run B: trainer on GPU-b, index 0 on another host (same index as GPU-a)
        + [placement("B", "GPU-b", "trainer", 0, t, host="h2") for t in range(0, 421, 60)]
        # run C: GPU-c, index 0 on host h1 like GPU-a: never A's, whatever its index
        + [placement("C", "GPU-c", "trainer", 0, t) for t in range(0, 421, 60)]
    )
    samples = (
        [gpu_sample("GPU-a", t, 80.0 + (t // 30) % 2 * 10, 300.0) for t in range(0, 481, 30)]  # 80/90 alternating
        + [gpu_sample("GPU-m", t, 50.0 if t < 150 else 90.0, 200.0 if t < 150 else 250.0, index=1) for t in range(0, 481, 30)]
        + [gpu_sample("GPU-b", t, 40.0, 100.0, host="h2") for t in range(0, 481, 30)]
        + [gpu_sample("GPU-c", t, 5.0, 60.0) for t in range(0, 481, 30)]
    )
    samples += [s for s in samples if s["hw_id"] == "GPU-m" and s["time_ns"] < T0 + 150 * S]  # replayed duplicates
    seed(url, {"placements": placements, "gpu_samples": samples})

    def summary(run_id: str) -> list[tuple]:
        got = rows(url, "--saved", "gpu-utilization-by-run", "--param", f"run_id={run_id}")
        return [
            (
                r["hw_id"],
                r["role"],
                r["rank"],
                r["samples"],
                r["mean_gpu_utilization"],
                r["mean_power_w"],
                r["held_from"],
                r["held_to"],
            )
            for r in got
        ]

    # GPU-a: samples 0..300 s = 11 (t//30 even -> 80: 0,60,...,300 = 6; odd -> 90: 5); mean (6*80+5*90)/11
    # GPU-m for A: [0, 150 s): 0,30,60,90,120 = 5 samples at 50 (duplicates counted once)
    assert summary("A") == [
        ("GPU-m", "rollout", 1, 5, 50.0, 200.0, iso(T0), iso(T0 + 150 * S - 1)),
        ("GPU-a", "trainer", 0, 11, round((6 * 80 + 5 * 90) / 11, 3), 300.0, iso(T0), iso(T0 + 300 * S)),
    ]
    # GPU-m for B: [150, 390 + 60 = 450 s]: 150..450 = 11 samples at 90; GPU-b: [0, 480] = 17 samples
    assert summary("B") == [
        ("GPU-m", "rollout", 0, 11, 90.0, 250.0, iso(T0 + 150 * S), iso(T0 + 450 * S)),
        ("GPU-b", "trainer", 0, 17, 40.0, 100.0, iso(T0), iso(T0 + 480 * S)),
    ]


def test_span_tree(url: str) -> None:
    tree = [
        span("root", None, "rollout", 0),
        span("gen", "root", "generate", 1),
        span("grade", "root", "grade", 2),
        span("judge", "grade", "judge_call", 3),
        span("http", "judge", "http_post", 4),
        span("orphan", "step-7", "reward", 5),  # parent outside the rollout: a root of its own
    ]
    seed(
        url,
        {
            "spans": [
                *tree,
                span("judge", "grade", "judge_call", 3),  # replayed duplicate
                span("other", None, "rollout", 0, rollout="ro-2"),
                span("gen2", "other", "generate", 1, rollout="ro-2"),
            ]
        },
    )
    got = rows(url, "--saved", "span-tree", "--param", "run_id=r1", "--param", "attempt=1", "--param", "rollout_id=ro-1")
    assert [(r["sequence_id"], r["depth"], r["name"], r["span_id"], r["parent_span_id"]) for r in got] == [
        (0, 0, "rollout", "root", None),
        (1, 1, "generate", "gen", "root"),
        (2, 1, "grade", "grade", "root"),
        (3, 2, "judge_call", "judge", "grade"),
        (4, 3, "http_post", "http", "judge"),
        (5, 0, "reward", "orphan", "step-7"),
    ]
    assert got[0]["duration_ms"] == 250.0 and got[0]["start_time"] == iso(T0)
