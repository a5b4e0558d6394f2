"""Tokens, tokens/s and MFU per step (seed 001's step.tokens, step.throughput, step.mfu) where people look:
the saved query step-throughput, the run page of ``rlpulse ui``, the text and HTML reports and ``rlpulse watch``.

Steps with known tokens, durations and MFUs go through the SDK, the broker and the real ``rlpulse sink``
into chDB; one more comes from a writer other than the SDK (an Avro Step record produced to the steps
topic as it is) with an MFU of 1.7, which no view may show as an MFU: each shows none for that step and
says how many steps sent one. A run of the same id in another project is no part of the run's figures.
Every expected figure is computed here from what was published.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from rich.console import Console

from rlpulse.base.settings import Settings
from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.producers import TrainingTelemetry
from rlpulse.schemas.catalogue import run_key
from rlpulse.schemas.codec import Codec
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.store.clickhouse import open_reader
from rlpulse.sinks.views.step_figures import summarize, throughput
from rlpulse.sinks.views.ui_html import fmt_count, fmt_rate, fmt_ratio
from rlpulse.sinks.views.ui_server import UiServer
from rlpulse.sinks.views.watch import render, snapshot
from tests.integration import until

pytestmark = [pytest.mark.integration, pytest.mark.full]

REPO = Path(__file__).resolve().parents[4]
PROJECT, DECOY, RUN = "thr", "thr-decoy", "thr-run"
# (step, tokens, duration_s, mfu) in the order the SDK publishes them: step 1 twice (a restore repeats it:
# the later one counts), step 2 with no MFU (unknown peak), step 3 without a duration (no tokens/s)
SDK_STEPS = [(0, 1000, 2.0, 0.25), (1, 1200, 2.0, 0.35), (1, 1300, 2.0, 0.3), (2, 900, 3.0, None), (3, 800, 0.0, 0.4),
             (4, 1500, 2.5, 0.45)]
RAW_STEP = (5, 2100, 3.0, 1.7)  # from a writer other than the SDK: 700 tokens/s, an MFU outside [0, 1]
DECOY_STEP = (0, 5000, 1.0, 0.9)
TOKEN = "throughput-test-" + "7c1e" * 8


def truth() -> list[dict[str, Any]]:
    """The saved query's rows of PROJECT, from what was published: the latest event of each step, tokens/s
    tokens / duration (none without a duration), the MFU only inside [0, 1]."""
    latest = {s: (tokens, duration, mfu) for s, tokens, duration, mfu in SDK_STEPS + [RAW_STEP]}
    return [{"step": s, "tokens": tokens, "duration_s": duration or None,
             "tokens_per_s": tokens / duration if duration else None,
             "mfu": mfu if mfu is not None and 0 <= mfu <= 1 else None,
             "mfu_out_of_range": int(mfu is not None and not 0 <= mfu <= 1)}
            for s, (tokens, duration, mfu) in sorted(latest.items())]


async def _produce_raw(settings: Settings) -> None:
    step, tokens, duration, mfu = RAW_STEP
    record = dict(project=PROJECT, run_id=RUN, attempt=1, stage="", time_ns=time.time_ns(), type="STEP", trainer="rl",
                  step=step, step_count=len(SDK_STEPS) + 1, tokens=tokens, duration_s=duration,
                  throughput=tokens / duration, mfu=mfu, dropped_events=0, writer_id="raw-writer", sequence_id=1,
                  spans_sent=0, metrics={}, status=None)
    producer = AIOKafkaProducer(**settings.kafka_client_kwargs())
    await producer.start()
    try:
        await producer.send_and_wait(settings.topic("steps"), key=run_key(PROJECT, RUN).encode(),
                                     value=Codec().encode("Step", [record]))
    finally:
        await producer.stop()


@pytest.fixture(scope="module")
def published(module_settings: Settings) -> Settings:
    settings = module_settings
    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start(("sink",))
        wait_groups_ready(settings, (settings.sink_group,), pipeline)
        with TrainingTelemetry(project=DECOY, run_id=RUN, attempt=1, trainer="rl", settings=settings) as tel:
            step, tokens, duration, mfu = DECOY_STEP
            tel.step_completed(step, tokens=tokens, duration_s=duration, mfu=mfu)
            assert tel.flush(30) == 0
        with TrainingTelemetry(project=PROJECT, run_id=RUN, attempt=1, trainer="rl", settings=settings) as tel:
            for step, tokens, duration, mfu in SDK_STEPS:
                tel.step_completed(step, tokens=tokens, duration_s=duration, mfu=mfu)
            assert tel.flush(30) == 0
            asyncio.run(_produce_raw(settings))  # after the SDK's steps: the latest STEP event of the run
        pipeline.wait_caught_up(until=until.counts(settings, {
            f"SELECT count() FROM $db.steps FINAL WHERE run_id = '{RUN}' AND type = 'STEP'": len(SDK_STEPS) + 2}))
        pipeline.stop()
    return settings


def _cli(settings: Settings, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "rlpulse.cli", *args], env={**settings_env(settings), "COLUMNS": "200"},
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_saved_query_gives_each_steps_figures_and_no_mfu_outside_0_1(published: Settings) -> None:
    rows = json.loads(_cli(published, "query", "--saved", "step-throughput", "--param", f"run_id={RUN}",
                           "--param", "attempt=1", "--format", "json"))
    ours = [{k: r[k] for k in ("step", "tokens", "duration_s", "tokens_per_s", "mfu", "mfu_out_of_range")}
            for r in rows if r["project"] == PROJECT]
    assert ours == truth()
    step, tokens, duration, mfu = DECOY_STEP
    assert [(r["step"], r["tokens_per_s"], r["mfu"]) for r in rows if r["project"] == DECOY] == [(step, tokens / duration, mfu)]
    times = [r["time_ns"] for r in rows if r["project"] == PROJECT]
    assert times == sorted(times)  # the steps' latest events, in the order they came


def test_the_summary_is_over_the_last_steps(published: Settings) -> None:
    with open_reader(published.clickhouse_dsn, owner="test") as store:
        rows = throughput(store, PROJECT, RUN, 1)
    expected = truth()
    rates = [r["tokens_per_s"] for r in expected if r["tokens_per_s"] is not None]
    mfus = [r["mfu"] for r in expected if r["mfu"] is not None]
    every = summarize(rows)
    assert (every.steps, every.tokens, every.mfu_out_of_range) == (6, sum(r["tokens"] for r in expected), 1)
    assert (every.median_tokens_per_s, every.mean_mfu) == (statistics.median(rates), pytest.approx(statistics.fmean(mfus)))
    last3 = summarize(rows, last=3)  # steps 3, 4, 5: tokens/s of 4 and 5, the MFU of 3 and 4
    assert (last3.median_tokens_per_s, last3.mean_mfu) == (650.0, pytest.approx(0.425))


def _fetch(server: UiServer, path: str) -> str:
    request = urllib.request.Request(server.url.rstrip("/") + path, headers={"Authorization": f"token {server.token}"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert answer.status == 200
        return answer.read().decode()


def test_the_run_page_shows_tokens_tokens_per_s_and_mfu(published: Settings) -> None:
    dsn = published.clickhouse_dsn
    with UiServer(lambda: open_reader(dsn, owner="test"), dsn, token=TOKEN) as server:
        page = _fetch(server, f"/run?project={PROJECT}&run={RUN}&attempt=1")
    expected = truth()
    for r in expected:
        row = re.search(rf'<tr class="step" data-step="{r["step"]}">(.*?)</tr>', page).group(1)
        cells = dict(re.findall(r'<td class="n (tokens|tokens-per-s|mfu)">([^<]*)</td>', row))
        # written by kind on the run page: a count with separators, a rate with an SI prefix, a ratio in %
        assert cells == {"tokens": fmt_count(r["tokens"]), "tokens-per-s": fmt_rate(r["tokens_per_s"]),
                         "mfu": fmt_ratio(r["mfu"])}, r
    assert page.count('<tr class="step"') == len(expected)  # the decoy project's step is not this run's
    figures = dict(re.findall(r'<div class="figure" data-figure="([^"]+)"><div class="label">[^<]*</div>'
                              r'<div class="value">([^<]*)</div>', page))
    assert (figures["tokens"], figures["median tokens/s (last 10 steps)"], figures["mean MFU (last 10 steps)"]) == (
        "7,600", "600/s", "35%")
    assert ('<p class="muted mfu-out-of-range" data-steps="1">1 step reported an MFU outside [0, 1]: no MFU is shown '
            "for them, and the mean leaves them out.</p>") in page
    # a point per step with the figure: tokens/s at 5 steps (none without a duration), MFU at 4
    assert re.search(r'<svg class="chart" data-chart="throughput".*?data-series="tokens/s" data-points="5"', page)
    assert re.search(r'<svg class="chart" data-chart="mfu".*?data-series="MFU" data-points="4"', page)
    assert "1.7" not in page.split("<h2>Per step")[1]


def test_the_reports_show_the_runs_throughput_and_mfu(published: Settings, tmp_path: Path) -> None:
    text = _cli(published, "report", "--project", PROJECT)
    lines = text.split(f"== throughput and efficiency per run (project {PROJECT}) ==\n")[1].splitlines()
    assert re.split(r"\s{2,}", lines[0]) == ["run_id", "attempt", "steps", "tokens", "median tokens/s (last 10 steps)",
                                             "mean MFU (last 10 steps)", "steps with an MFU outside [0, 1]"]
    assert lines[2].split() == [RUN, "1", "6", "7600", "600.0", "0.35", "1"]
    assert lines[3] == "1 step reported an MFU outside [0, 1]: no MFU is shown for them, and the mean leaves them out."
    out = tmp_path / "report.html"
    _cli(published, "report", RUN, "--html", str(out))
    page = out.read_text()
    figures = dict(re.findall(r'<tr data-figure="([^"]+)"><th>[^<]*</th><td class="n">([^<]*)</td></tr>', page))
    assert figures == {"tokens": "7600", "median-tokens-per-s": "600", "mean-mfu": "0.35", "mfu-out-of-range": "1"}
    assert '<p class="mfu-out-of-range">1 step reported an MFU outside [0, 1]' in page
    for chart, points in (("throughput", 5), ("mfu", 4)):
        svg = re.search(rf'<svg[^>]*data-chart="{chart}".*?</svg>', page, re.S).group(0)
        [line] = re.findall(r'<polyline class="series"[^>]*points="([^"]*)"', svg)
        assert len(line.split()) == points, chart


def test_watch_shows_the_latest_tokens_per_s(published: Settings) -> None:
    with open_reader(published.clickhouse_dsn, owner="test") as store:
        snap = snapshot(store, time.time_ns())
    step, tokens, duration, _ = DECOY_STEP
    assert {r.key: r.tokens_per_s for r in snap.runs} == {f"{PROJECT}/{RUN}/1": 700.0, f"{DECOY}/{RUN}/1": tokens / duration}
    console = Console(record=True, width=200, file=open("/dev/null", "w"))
    console.print(render(snap))
    frame = console.export_text()
    heading = next(ln.split() for ln in frame.splitlines() if ln.startswith("RUN "))
    line = next(ln.split() for ln in frame.splitlines() if ln.startswith(RUN + " ") and ln.rstrip().endswith(PROJECT))
    assert line[heading.index("TOK/S")] == "700"
