"""``rlpulse watch``: the snapshot's figures from known rows in a chDB store, the rendered frame,
the command's one-frame and error paths, and the live view in tmux against a simulated pipeline."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from rich.console import Console

from rlpulse.producers.simulators.simulator import SimConfig, simulate
from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.store.clickhouse import StoreBusyError, migrate, open_reader, open_store
from rlpulse.sinks.views.watch import WatchSnapshot, render, snapshot
from tests.conftest import unavailable
from tests.integration import until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[4]
NS = 1_000_000_000
NOW = (time.time_ns() // NS) * NS


def _insert(client, table: str, rows: list[dict]) -> None:
    columns = list(rows[0])
    client.insert(f"rlpulse.{table}", [[r[c] for c in columns] for r in rows], column_names=columns)


def _step(project: str, run_id: str, attempt: int, ago_s: float, type_: str, step: int, count: int,
          throughput: float = 0.0, duration_s: float = 0.0) -> dict:
    return {"project": project, "run_id": run_id, "attempt": attempt, "stage": "train", "time_ns": NOW - int(ago_s * NS),
            "type": type_, "trainer": "rl", "step": step, "step_count": count, "tokens": int(throughput * duration_s),
            "duration_s": duration_s, "throughput": throughput, "mfu": None, "dropped_events": 0, "writer_id": "w1",
            "sequence_id": int(1e6 - ago_s)}


def _alert(rule: str, key: str, state: str, ago_s: float, run: tuple[str, str, int] = ("", "", 0),
           first_ago_s: float | None = None) -> dict:
    t = NOW - int(ago_s * NS)
    return {"rule": rule, "state": state, "key": key, "severity": "warning", "summary": f"{rule} on {key}",
            "value": 1.0, "threshold": 0.5, "project": run[0], "run_id": run[1], "attempt": run[2], "time_ns": t,
            "first_seen_ns": NOW - int((first_ago_s if first_ago_s is not None else ago_s) * NS), "last_seen_ns": t}


def _stats(run_id: str, attempt: int, step: int, reward: float, clipped: int, emitted_ago_s: float) -> dict:
    return {"project": "p", "run_id": run_id, "attempt": attempt, "step": step, "rollouts": 16, "clipped": clipped,
            "clipped_ratio": clipped / 16, "reward_mean": reward, "reward_std": 0.1, "reward_min": 0.0,
            "reward_max": 1.0, "reward_zero_fraction": 0.0, "completion_mean": 100.0, "completion_min": 1,
            "completion_max": 200, "samples": 4, "samples_same_reward": 0, "sample_reward_spread_mean": 0.2,
            "complete": True, "emitted_at_ns": NOW - int(emitted_ago_s * NS)}


def _window(term: str, start_ago_s: float, failures: int, graded: int, emitted_ago_s: float) -> dict:
    start = NOW - int(start_ago_s * NS)
    return {"project": "p", "run_id": "alpha", "attempt": 2, "term": term, "window_start_ns": start,
            "window_end_ns": start + 60 * NS, "graded": graded, "failures": failures, "failure_rate": failures / graded,
            "duration_p50_s": 1.0, "duration_p90_s": 1.0, "duration_p99_s": 1.0, "duration_max_s": 1.0,
            "emitted_at_ns": NOW - int(emitted_ago_s * NS)}


def _gpu(hw_id: str, ago_s: float, util: float, power: float) -> dict:
    return {"project": "p", "run_id": "", "attempt": 0, "time_ns": NOW - int(ago_s * NS), "hw_id": hw_id, "index": 0,
            "host": "h1", "node": "n1", "pod": "", "rank": 0, "role": "trainer", "power_w": power,
            "temperature_c": 60.0, "gpu_utilization": util, "memory_used_bytes": 1, "memory_total_bytes": 2,
            "memory_utilization": 0.5, "memory_activity": 0.1, "sm_clock_mhz": 1400.0, "throttle_reasons": 0,
            "xid_errors": 0, "xid_last": None}


def seed(url: str) -> None:
    """Known rows, times relative to NOW (see each run's comment for its expected line)."""
    with open_store(url, owner="test") as store:
        migrate(store)
        c = store.client
        steps = []
        # alpha attempt 1: an older attempt, recent but superseded by attempt 2
        steps += [_step("p", "alpha", 1, 590, "RUN_START", 0, 0), _step("p", "alpha", 1, 580, "STEP", 0, 1)]
        # alpha attempt 2, RUNNING: a step every 30 s from 480 s ago (steps 0..14, count 15 at 30 s ago), a
        # heartbeat 10 s ago. Rate window: the 300 s up to now; 300 s ago the count was 6, so 9 steps in
        # 5 min = 1.8 a minute. Tokens/s 1000 + step: the latest STEP event's is step 14's, 1014.
        steps.append(_step("p", "alpha", 2, 480, "RUN_START", 0, 0))
        steps += [_step("p", "alpha", 2, 480 - 30 * (k + 1), "STEP", k, k + 1, 1000.0 + k, 2.0) for k in range(15)]
        steps.append(_step("p", "alpha", 2, 180, "STEP", 9, 10))  # a replayed event: changes nothing
        steps.append(_step("p", "alpha", 2, 10, "HEARTBEAT", 14, 15))
        # beta, STALLED: started 120 s ago, one step, heartbeats to 5 s ago: 1 step in 2 min = 0.5 a minute;
        # its step processed no token in 2 s: 0 tokens/s (delta's 0 has no duration: no figure)
        steps += [_step("p", "beta", 1, 120, "RUN_START", 0, 0), _step("p", "beta", 1, 100, "STEP", 0, 1, 0.0, 2.0),
                  _step("p", "beta", 1, 60, "HEARTBEAT", 0, 1), _step("p", "beta", 1, 5, "HEARTBEAT", 0, 1)]
        # gamma, SILENT (its stall alert is open too: SILENT wins): last report 20 min ago, shown because of the
        # open alert; no step in the last 5 min: 0.0 a minute
        steps += [_step("p", "gamma", 1, 1500, "RUN_START", 0, 0)]
        steps += [_step("p", "gamma", 1, 1400 - 100 * k, "STEP", k, k + 1) for k in range(3)]
        # delta, ENDED: 2 steps from 300 s to its RUN_END 180 s ago = 1.0 a minute
        steps += [_step("p", "delta", 1, 300, "RUN_START", 0, 0), _step("p", "delta", 1, 260, "STEP", 0, 1),
                  _step("p", "delta", 1, 200, "STEP", 1, 2), _step("p", "delta", 1, 180, "RUN_END", 1, 2)]
        # old: ended two hours ago, not active; other: another project, running
        steps += [_step("p", "old", 1, 7300, "RUN_START", 0, 0), _step("p", "old", 1, 7200, "RUN_END", 0, 0)]
        steps += [_step("q", "other", 1, 60, "RUN_START", 0, 0), _step("q", "other", 1, 30, "STEP", 0, 1)]
        _insert(c, "steps", steps)
        _insert(c, "step_stats", [
            _stats("alpha", 2, 13, 0.5, 2, 40),
            _stats("alpha", 2, 14, 0.1, 8, 30),  # an earlier emission of step 14: the later one wins
            _stats("alpha", 2, 14, 0.625, 4, 20),
            _stats("alpha", 1, 20, 0.99, 16, 20),  # the old attempt's
        ])
        _insert(c, "grader_windows", [
            _window("judge", 480, 20, 20, 400),  # ended 420 s ago: before the rate window, not counted
            _window("judge", 350, 3, 20, 280),  # ends 290 s ago: inside the last 300 s
            _window("format", 350, 1, 20, 280),
            _window("judge", 120, 10, 20, 55),  # re-emitted later with 4 failures
            _window("judge", 120, 4, 20, 50),
            _window("format", 120, 0, 20, 50),
        ])  # counted: (3 + 1 + 4 + 0) / 80 = 10.0%
        place = {"project": "p", "run_id": "alpha", "attempt": 2, "stage": "train", "role": "trainer", "rank": 0,
                 "pod": "", "node": "n1", "host": "h1", "index": 0, "hw_id": "GPU-a1"}
        _insert(c, "placements", [{**place, "time_ns": NOW - 100 * NS}, {**place, "time_ns": NOW - 30 * NS},
                                  {**place, "run_id": "old", "attempt": 1, "hw_id": "GPU-z9", "time_ns": NOW - 7300 * NS}])
        _insert(c, "gpu_samples", [_gpu("GPU-a1", 200, 0.1, 100.0),  # before the placement: not the run's
                                   _gpu("GPU-a1", 90, 0.5, 250.0), _gpu("GPU-a1", 20, 0.9, 312.4)])
        _insert(c, "alerts", [
            _alert("grader_failure_rate", "p/alpha/2/judge", "FIRING", 60, ("p", "alpha", 2)),
            _alert("clipped_ratio_rising", "p/alpha/2", "FIRING", 200, ("p", "alpha", 2)),
            _alert("clipped_ratio_rising", "p/alpha/2", "RESOLVED", 100, ("p", "alpha", 2), first_ago_s=200),
            _alert("xid", "GPU-a1", "FIRING", 15),
            _alert("stalled_run", "p/beta/1", "FIRING", 50, ("p", "beta", 1)),
            _alert("stalled_run", "p/gamma/1", "FIRING", 1300, ("p", "gamma", 1)),
            _alert("silent_run", "p/gamma/1", "FIRING", 900, ("p", "gamma", 1)),
        ])


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    # The rows are placed relative to NOW, and `rlpulse watch` judges them by the wall clock: NOW is
    # taken again here, since `make test` can run this test long after the module was imported.
    global NOW
    NOW = (time.time_ns() // NS) * NS
    url = f"chdb://{tmp_path / 'ch'}"
    seed(url)
    return url


def _line(text: str, run: str) -> list[str]:
    lines = [ln.split() for ln in text.splitlines() if ln.startswith(run + " ")]
    assert len(lines) == 1, f"one line for {run} expected in:\n{text}"
    return lines[0]


def _frame(snap: WatchSnapshot, width: int = 160) -> str:
    console = Console(record=True, width=width, file=open(os.devnull, "w"))
    console.print(render(snap))
    return console.export_text()


def test_snapshot_figures(store_url: str) -> None:
    with open_store(store_url, owner="test") as store:
        snap = snapshot(store, NOW)
    runs = {r.key: r for r in snap.runs}
    assert [r.key for r in snap.runs] == ["p/gamma/1", "p/beta/1", "p/alpha/2", "q/other/1", "p/delta/1"]
    alpha = runs["p/alpha/2"]
    assert (alpha.state, alpha.step, alpha.step_count, alpha.steps_per_min, alpha.tokens_per_s) == (
        "RUNNING", 14, 15, 1.8, 1014.0)
    assert (alpha.reward_mean, alpha.clipped_ratio, alpha.failure_rate, alpha.graded) == (0.625, 0.25, 0.1, 80)
    assert [(g.hw_id, g.host, g.index, g.utilization, g.power_w, g.sample_ns) for g in alpha.gpus] == [
        ("GPU-a1", "h1", 0, 0.9, 312.4, NOW - 20 * NS)]
    assert sorted((a.rule, a.key) for a in alpha.alerts) == [("grader_failure_rate", "p/alpha/2/judge"), ("xid", "GPU-a1")]
    beta = runs["p/beta/1"]
    assert (beta.state, beta.step, beta.steps_per_min, beta.reward_mean, beta.failure_rate) == ("STALLED", 0, 0.5, None, None)
    assert [a.rule for a in beta.alerts] == ["stalled_run"] and beta.gpus == []
    gamma = runs["p/gamma/1"]
    assert (gamma.state, gamma.step, gamma.steps_per_min) == ("SILENT", 2, 0.0)
    assert sorted(a.rule for a in gamma.alerts) == ["silent_run", "stalled_run"]
    delta = runs["p/delta/1"]
    assert (delta.state, delta.step, delta.steps_per_min, delta.alerts) == ("ENDED", 1, 1.0, [])
    assert (beta.tokens_per_s, gamma.tokens_per_s, delta.tokens_per_s) == (0.0, None, None)
    assert runs["q/other/1"].state == "RUNNING"


def test_an_ended_run_shows_its_status_and_chosen_metrics_are_columns(tmp_path: Path) -> None:
    url = f"chdb://{tmp_path / 'ch'}"
    now = (time.time_ns() // NS) * NS

    def step(run_id: str, ago_s: float, type_: str, step: int, count: int, metrics: dict | None = None,
             status: str | None = None) -> dict:
        return {**_step("p", run_id, 1, ago_s, type_, step, count), "time_ns": now - int(ago_s * NS),
                "metrics": metrics or {}, "status": status}

    with open_store(url, owner="test") as store:
        migrate(store)
        _insert(store.client, "steps", [
            step("ok", 60, "RUN_START", -1, 0), step("ok", 50, "STEP", 0, 1, {"loss": 2.5, "kl": 0.25}),
            step("ok", 40, "STEP", 1, 2, {"loss": 1.25}), step("ok", 30, "RUN_END", -1, 2, status="finished"),
            step("bad", 60, "RUN_START", -1, 0), step("bad", 50, "METRICS", 0, 0, {"loss": 9.0}),
            step("bad", 45, "RUN_END", -1, 0, status="failed"),
            step("live", 20, "RUN_START", -1, 0), step("live", 10, "STEP", 0, 1, {"kl": 0.5}),
        ])
        snap = snapshot(store, now, metrics=("loss", "kl"))
    runs = {r.run_id: r for r in snap.runs}
    assert {k: (r.state, r.end_status, r.metrics) for k, r in runs.items()} == {
        "ok": ("ENDED", "finished", {"loss": 1.25, "kl": 0.25}), "bad": ("ENDED", "failed", {"loss": 9.0}),
        "live": ("RUNNING", None, {"kl": 0.5})}
    frame = _frame(snap)
    assert _line(frame, "ok")[1:3] == ["1", "FINISHED"] and _line(frame, "bad")[1:3] == ["1", "FAILED"]
    assert "LOSS" in frame and "KL" in frame and "1.25" in _line(frame, "ok") and "9" in _line(frame, "bad")


def test_snapshot_scope(store_url: str) -> None:
    with open_store(store_url, owner="test") as store:
        only_p = snapshot(store, NOW, project="p")
        every = snapshot(store, NOW, show_all=True)
        later = snapshot(store, NOW + 3 * 3600 * NS, project="q")
    assert [r.key for r in only_p.runs] == ["p/gamma/1", "p/beta/1", "p/alpha/2", "p/delta/1"]
    assert sorted(r.key for r in every.runs) == ["p/alpha/2", "p/beta/1", "p/delta/1", "p/gamma/1", "p/old/1", "q/other/1"]
    assert later.runs == [] and later.any_runs
    assert "no active runs in rlpulse in the last 10m00s; `rlpulse watch --all` shows every run" in _frame(later)


def test_render_lines(store_url: str) -> None:
    with open_store(store_url, owner="test") as store:
        text = _frame(snapshot(store, NOW))
    runs = text[:text.index("GPUs")]
    assert _line(runs, "RUN") == ["RUN", "ATT", "STATE", "STEP", "STEPS/MIN", "REWARD", "CLIPPED", "FAIL", "TOK/S",
                                  "GPUS", "ALERTS", "LAST", "PROJECT"]
    assert _line(runs, "alpha") == ["alpha", "2", "RUNNING", "14", "1.8", "0.625", "25.0%", "10.0%", "1014", "1", "2", "10s",
                                    "p"]
    assert _line(runs, "beta") == ["beta", "1", "STALLED", "0", "0.5", "-", "-", "-", "0", "0", "1", "5s", "p"]
    assert _line(runs, "gamma") == ["gamma", "1", "SILENT", "2", "0.0", "-", "-", "-", "-", "0", "2", "20m00s", "p"]
    assert _line(runs, "delta") == ["delta", "1", "ENDED", "1", "1.0", "-", "-", "-", "-", "0", "0", "3m00s", "p"]
    assert _line(runs, "other")[-1] == "q"
    assert "5 runs (1 silent, 1 stalled, 2 running, 1 ended)" in text
    gpus = text[text.index("GPUs"):text.index("Open alerts")]
    assert _line(gpus, "RUN") == ["RUN", "GPU", "HOST", "UTIL", "POWER", "MEM", "SAMPLE"]
    assert _line(gpus, "alpha") == ["alpha", "GPU-a1", "h1", "#0", "90%", "312", "W", "50%", "20s", "ago"]
    alerts = text[text.index("Open alerts"):].splitlines()
    assert alerts[1].split() == ["RULE", "KEY", "SEVERITY", "FOR", "SUMMARY"]
    assert [ln.split()[:2] for ln in alerts[2:]] == [
        ["stalled_run", "p/gamma/1"], ["silent_run", "p/gamma/1"], ["grader_failure_rate", "p/alpha/2/judge"],
        ["stalled_run", "p/beta/1"], ["xid", "GPU-a1"]]
    assert alerts[3].split() == ["silent_run", "p/gamma/1", "warning", "15m00s", "silent_run", "on", "p/gamma/1"]


LONG = {"p": "demo-20261203-150728", "q": "demo-20261203-161500"}
UUID = "GPU-8c7b1e4f-2a3d-4f5e-9a8b-1c2d3e4f5a6b"


def _long_names(snap: WatchSnapshot) -> WatchSnapshot:
    """The seeded snapshot with names as long as real ones: the simulator's run ids hold the project
    (``demo-20261203-150728-grpo-qwen7b-alpha``), GPUs have UUIDs."""
    def run_id(project: str, run: str) -> str:
        return f"{LONG[project]}-grpo-qwen7b-{run}"

    def alert(a):
        if not a.project:
            return dataclasses.replace(a, key=UUID)
        old, new = f"{a.project}/{a.run_id}/", f"{LONG[a.project]}/{run_id(a.project, a.run_id)}/"
        return dataclasses.replace(a, key=a.key.replace(old, new), project=LONG[a.project],
                                   run_id=run_id(a.project, a.run_id))
    runs = [dataclasses.replace(r, project=LONG[r.project], run_id=run_id(r.project, r.run_id),
                                gpus=[dataclasses.replace(g, hw_id=UUID) for g in r.gpus],
                                alerts=[alert(a) for a in r.alerts]) for r in snap.runs]
    return dataclasses.replace(snap, runs=runs)


RUN_HEADINGS = ["RUN", "ATT", "STATE", "STEP", "STEPS/MIN", "REWARD", "CLIPPED", "FAIL", "TOK/S", "GPUS", "ALERTS",
                "LAST", "PROJECT"]
GPU_HEADINGS = ["RUN", "GPU", "HOST", "UTIL", "POWER", "MEM", "SAMPLE"]
ALERT_HEADINGS = ["RULE", "KEY", "SEVERITY", "FOR", "SUMMARY"]
# the columns shown with the long names: the essential ones at 80, all at 200
SHOWN = {
    80: (["RUN", "STATE", "STEP", "STEPS/MIN", "REWARD", "CLIPPED", "FAIL"],
         ["RUN", "GPU", "UTIL", "POWER", "MEM", "SAMPLE"], ["RULE", "KEY", "SEVERITY", "FOR"]),
    120: (RUN_HEADINGS[:-1], GPU_HEADINGS, ALERT_HEADINGS),
    200: (RUN_HEADINGS, GPU_HEADINGS, ALERT_HEADINGS),
}


def _tables(text: str) -> tuple[list[str], list[str], list[str]]:
    return (text[:text.index("GPUs")].splitlines(), text[text.index("GPUs"):text.index("Open alerts")].splitlines(),
            text[text.index("Open alerts"):].splitlines())


@pytest.mark.parametrize("width", [80, 120, 200])
def test_render_widths(store_url: str, width: int) -> None:
    """At 80, 120 and 200 columns: no line is wider than the terminal, every heading shown is whole (the
    essential columns always), and each run is told apart by its id's end even when the id is cut."""
    with open_store(store_url, owner="test") as store:
        seeded = snapshot(store, NOW)
    for snap in (seeded, _long_names(seeded)):
        text = _frame(snap, width)
        assert max(len(ln) for ln in text.splitlines()) <= width, text
        runs, gpus, alerts = _tables(text)
        headings = [_line("\n".join(runs), "RUN"), _line("\n".join(gpus), "RUN"), alerts[1].split()]
        for shown, every, essential in zip(headings, (RUN_HEADINGS, GPU_HEADINGS, ALERT_HEADINGS), SHOWN[80]):
            assert set(essential) <= set(shown) <= set(every), text
            assert shown == [h for h in every if h in shown], text  # in their order
        for r in snap.runs:
            end = r.run_id.rsplit("-", 1)[-1]
            lines = [ln for ln in runs if ln.split()[:1] and ln.split()[0].endswith(end)]
            assert len(lines) == 1 and r.state in lines[0].split(), text
    assert headings == list(SHOWN[width]), text  # the long names'
    runs = runs[[ln.split()[:1] for ln in runs].index(["RUN"]) + 1:]  # the lines under the heading
    ids = [ln.split()[0] for ln in runs if ln.strip()]
    if width == 80:  # no room for a project column: each project heads its runs; the ids are cut in the middle
        assert ids == ["demo-20261203-150728", "demo-20261203-15…-qwen7b-gamma", "demo-20261203-150…-qwen7b-beta",
                       "demo-20261203-15…-qwen7b-alpha", "demo-20261203-15…-qwen7b-delta", "demo-20261203-161500",
                       "demo-20261203-16…-qwen7b-other"], text
        assert gpus[2].split()[:2] == ["demo-20261203-150728-grpo-qwen7b-alpha", "…1c2d3e4f5a6b"], text
        assert [ln.split()[1] for ln in alerts[2:] if ln.strip()] == [
            "demo-20261203-150728…-grpo-qwen7b-gamma/1", "demo-20261203-150728…-grpo-qwen7b-gamma/1",
            "demo-20261203-150728/demo-…-alpha/2/judge", "demo-20261203-150728/…-grpo-qwen7b-beta/1", UUID], text
    elif width == 120:  # every column but PROJECT: the ids cut in the middle, told apart by their end
        assert "demo-20261203-150728-g…-qwen7b-gamma" in ids and gpus[2].split()[1] == UUID, text
    else:
        assert "demo-20261203-150728-grpo-qwen7b-gamma" in ids and gpus[2].split()[1] == UUID, text
    if width == 200:
        assert [ln.split()[-1] for ln in runs if ln.strip()] == [LONG["p"]] * 3 + [LONG["q"], LONG["p"]], text
        assert alerts[4].split()[1] == "demo-20261203-150728/demo-20261203-150728-grpo-qwen7b-alpha/2/judge", text


def test_render_empty_store() -> None:
    empty = WatchSnapshot("chdb:///x", "rlpulse", NOW, [], any_runs=False)
    assert "no runs yet in rlpulse — start a job or `rlpulse demo`" in _frame(empty)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlpulse.cli", "watch", *args], env={**os.environ, **(env or {})},
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_cli_once_and_errors(store_url: str, tmp_path: Path) -> None:
    done = _cli("--once", "--project", "p", "--clickhouse-url", store_url, env={"COLUMNS": "160"})
    assert done.returncode == 0, done.stderr
    assert _line(done.stdout[:done.stdout.index("GPUs")], "alpha")[:4] == ["alpha", "2", "RUNNING", "14"]
    assert "other" not in done.stdout and "project p" in done.stdout
    empty = _cli("--once", "--clickhouse-url", f"chdb://{tmp_path / 'empty'}", env={"COLUMNS": "160"})
    assert empty.returncode == 0 and "no runs yet in rlpulse — start a job or `rlpulse demo`" in empty.stdout, empty
    down = _cli("--once", "--clickhouse-url", "http://u:secret@127.0.0.1:9/rlpulse")
    assert down.returncode == 1
    lines = down.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "rlpulse watch: cannot connect to ClickHouse at http://u:***@127.0.0.1:9/rlpulse: "), down.stderr
    assert "secret" not in down.stderr


# --- the live view in a terminal: tmux, a simulated pipeline ---------------------------------------

TMUX = shutil.which("tmux")
PROJECT = "w"


class TmuxWatch:
    """``rlpulse watch`` in a detached tmux session of 160x40 on a tmux server of its own (its own
    socket), so the test never touches anyone else's sessions; ``close`` ends that server."""

    def __init__(self, settings: Settings, *args: str):
        self.socket = f"rlpulse-watch-{uuid.uuid4().hex[:8]}"
        env = {k: v for k, v in settings_env(settings).items() if k.startswith("RLPULSE_")}
        env["PYTHONPATH"] = str(REPO)
        watch = " ".join(shlex.quote(a) for a in (sys.executable, "-m", "rlpulse.cli", "watch", *args))
        assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
        # COLUMNS and LINES (pytest's environment has 80x24) would override the terminal's size;
        # after watch exits, its status stays on the screen for the test to read
        self.command = (f"cd {shlex.quote(str(REPO))} && env -u COLUMNS -u LINES {assigns} {watch}; "
                        "echo watch exited $?; sleep 600")

    def _tmux(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([TMUX, "-L", self.socket, *args], capture_output=True, text=True, timeout=30)

    def start(self) -> None:
        done = self._tmux("new-session", "-d", "-x", "160", "-y", "40", "-s", "watch", self.command)
        assert done.returncode == 0, done.stderr

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "watch").stdout

    def wait_for(self, ready, timeout: float = 60.0, what: str = "") -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if ready(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"the screen never showed {what} in {timeout:.0f}s; last screen:\n{text}")
            time.sleep(0.3)

    def interrupt(self) -> None:
        self._tmux("send-keys", "-t", "watch", "C-c")

    def close(self) -> None:
        socket = self._tmux("display-message", "-p", "#{socket_path}").stdout.strip()
        self._tmux("kill-server")
        if socket:  # kill-server leaves the socket file behind
            Path(socket).unlink(missing_ok=True)


def _runs_part(screen: str) -> str:
    return screen[:screen.index("GPUs")] if "GPUs" in screen else screen


def _shows(*runs: tuple[str, str]):
    """A screen predicate: each (run, state) has its line."""
    def ready(screen: str) -> bool:
        lines = [ln.split() for ln in _runs_part(screen).splitlines()]
        return all(any(ln[:1] == [f"{PROJECT}-{run}"] and ln[2:3] == [state] for ln in lines) for run, state in runs)
    return ready


def _pipeline_settings(settings: Settings) -> Settings:
    # heartbeats every second: a stalled run still reports, so it stalls (3 s) before it goes silent (6 s)
    return dataclasses.replace(settings, stall_after=3.0, silent_after=6.0, heartbeat_interval=1.0)


SIM = SimConfig(project=PROJECT, runs=2, steps=3, rollouts_per_step=8, stall_s=6.0, silent_run=True, gpu=True)


def _check_final_screen(screen: str, truth) -> None:
    """Both simulated runs ended at step 2 (the second after its stall), the silent run is SILENT at step 0;
    each run's failure rate is what the simulator sent, its clipped ratio that of its last step; every
    run's GPU shows its last sample (90 %, 300 W + 10 W a step)."""
    runs = _runs_part(screen)
    for r in (1, 2):
        run = f"{PROJECT}-run{r}"
        line = _line(runs, run)
        graded = sum(n for (rid, _t), n in truth.graded.items() if rid == run)
        failed = sum(n for (rid, _t, _c), n in truth.failures.items() if rid == run)
        assert line[1:4] == ["1", "FINISHED", "2"], line
        assert line[6:8] + line[9:10] == [f"{truth.clipped[(run, 2)] / SIM.rollouts_per_step:.1%}",
                                          f"{failed / graded:.1%}", "1"], line
        assert line[8].isdigit() and int(line[8]) > 0, line  # TOK/S: the simulator's (test_step_throughput checks the value)
    silent = _line(runs, f"{PROJECT}-silent")
    assert silent[1:4] == ["1", "SILENT", "0"], silent
    gpus = screen[screen.index("GPUs"):]
    for r in (1, 2):
        gpu = _line(gpus, f"{PROJECT}-run{r}")
        assert gpu[1:8] == [f"GPU-sim-{PROJECT}-run{r}", "sim-host", "#0", "90%", "320", "W", "75%"], gpu
    alerts = [ln.split()[:2] for ln in screen[screen.index("Open alerts"):].splitlines()]
    assert ["silent_run", f"{PROJECT}/{PROJECT}-silent/1"] in alerts, alerts
    assert "Traceback" not in screen


@contextlib.contextmanager
def _hold(dsn: str):
    deadline = time.monotonic() + 30
    while True:
        try:
            store = open_store(dsn, owner="test holding the store")
            break
        except StoreBusyError:  # watch is reading this instant
            assert time.monotonic() < deadline, "watch held the store for 30 s"
            time.sleep(0.1)
    try:
        yield store
    finally:
        store.close()


def _quit(tmux: TmuxWatch) -> None:
    tmux.interrupt()
    screen = tmux.wait_for(lambda s: "watch exited" in s, 30, "the exit status")
    assert "watch exited 0" in screen and "Traceback" not in screen, screen


@pytest.mark.full  # a terminal: make test-all
def test_watch_in_tmux_after_the_pipeline(settings: Settings, artifacts_dir: Path) -> None:
    """The store no one holds (the pipeline ran and stopped): the view shows the runs, then refreshes with
    a run written meanwhile, and quits on Ctrl-C with status 0."""
    if TMUX is None:
        unavailable("tmux is not installed (apt-get install tmux)")
    settings = _pipeline_settings(settings)
    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        truth = simulate(settings, SIM)
        # the ended runs' steps close at once; the silent run shows SILENT once its alert is in
        pipeline.wait_caught_up(until=until.counts(settings, {
            "SELECT count() FROM $db.alerts FINAL WHERE rule = 'silent_run'": 1,
            f"SELECT count() FROM $db.step_stats FINAL WHERE run_id != '{PROJECT}-silent'": SIM.runs * SIM.steps}))
        pipeline.stop()
    tmux = TmuxWatch(settings, "--interval", "1s")
    try:
        tmux.start()
        screen = tmux.wait_for(_shows(("run1", "FINISHED"), ("run2", "FINISHED"), ("silent", "SILENT")), 60, "the runs")
        (artifacts_dir / "screen.txt").write_text(screen)
        _check_final_screen(screen, truth)
        assert "read endpoint" not in screen  # the store was free: opened directly
        # a new run written while watch runs: it must not hold the store between refreshes
        with _hold(settings.clickhouse_dsn) as store:
            store.client.insert(f"{store.database}.steps", [
                [PROJECT, f"{PROJECT}-late", 1, "train", time.time_ns() - 2 * NS, "RUN_START", "rl", 0, 0, "w9", 1],
                [PROJECT, f"{PROJECT}-late", 1, "train", time.time_ns(), "STEP", "rl", 0, 1, "w9", 2]],
                column_names=["project", "run_id", "attempt", "stage", "time_ns", "type", "trainer", "step",
                              "step_count", "writer_id", "sequence_id"])
        tmux.wait_for(_shows(("late", "RUNNING")), 30, "the run written meanwhile")
        # a store held by a process that serves no reads: the last frame stays, with the reason, until it is free
        with _hold(settings.clickhouse_dsn):
            busy = tmux.wait_for(lambda s: "retrying" in s, 30, "the busy store's error")
        (artifacts_dir / "screen-busy.txt").write_text(busy)
        assert "cannot read" in busy and "StoreBusyError" in busy and "pid" in busy, busy
        assert _shows(("late", "RUNNING"))(busy)
        tmux.wait_for(lambda s: "retrying" not in s and _shows(("late", "RUNNING"))(s), 30, "recovery")
        _quit(tmux)
    finally:
        tmux.close()


@pytest.mark.full  # a terminal: make test-all
def test_watch_in_tmux_live_sink(settings: Settings, artifacts_dir: Path) -> None:
    """LIVE STORE CASE: watch while the sink holds the chDB store, through the sink's read endpoint
    (open_reader): the stalled run is seen STALLED live, then the end state. A store open_reader
    cannot read while the sink runs is a broken read endpoint: a failure, never a skip."""
    if TMUX is None:
        unavailable("tmux is not installed (apt-get install tmux)")
    settings = _pipeline_settings(settings)
    ensure_topics(settings)
    tmux = TmuxWatch(settings, "--interval", "1s")
    with Pipeline(settings) as pipeline:
        try:
            pipeline.start()
            wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
            # the sink publishes its read endpoint right after it takes the store (find_endpoint
            # gives it 5 s): a StoreBusyError here fails the test
            open_reader(settings.clickhouse_dsn, owner="test").close()
            tmux.start()
            tmux.wait_for(lambda s: "no runs yet in" in s, 60, "the empty store's message")
            seen: list[str] = []
            stop = threading.Event()

            def record() -> None:
                while not stop.is_set():
                    seen.append(tmux.screen())
                    time.sleep(0.3)

            recorder = threading.Thread(target=record, daemon=True)
            recorder.start()
            try:
                truth = simulate(settings, SIM)
                screen = tmux.wait_for(_shows(("run1", "FINISHED"), ("run2", "FINISHED"), ("silent", "SILENT")), 90,
                                       "the runs' end state")
            finally:
                stop.set()
                recorder.join()
            (artifacts_dir / "screen.txt").write_text(screen)
            stalled = [s for s in seen if _shows(("run2", "STALLED"))(s)]
            assert stalled, "run2 was never seen STALLED"
            (artifacts_dir / "screen-stalled.txt").write_text(stalled[0])
            _check_final_screen(screen, truth)
            if settings.clickhouse_dsn.startswith("chdb:"):
                assert "(through the sink's read endpoint http://127.0.0.1:" in screen.replace("\n", ""), screen
            _quit(tmux)
        finally:
            tmux.close()
