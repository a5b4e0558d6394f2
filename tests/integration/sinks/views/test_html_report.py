"""``rlpulse report RUN --html``: known rows in a chDB store, the real CLI, the page rendered by
headless Chromium; the dumped DOM must hold every chart with what was inserted drawn in it."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from rlpulse.sinks.store.clickhouse import migrate, open_store
from tests.conftest import unavailable

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[4]
CHROMIUM = "/usr/bin/chromium"
CHARTS = ("reward-heatmap", "failures-by-cause", "clipped-ratio", "tokens", "throughput", "mfu", "gpu-utilization",
          "gpu-power", "alerts-timeline")
NS = 1_000_000_000
BOUNDS = [0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1, 2, 5]
STEPS = 6


def _insert(client, table: str, rows: list[dict]) -> None:
    columns = list(rows[0])
    client.insert(f"rlpulse.{table}", [[r[c] for c in columns] for r in rows], column_names=columns)


def _seed(store_url: str) -> dict[str, int]:
    """Rows of runA (attempts 1 and 2; the report must pick 2), a decoy run and a decoy GPU."""
    now = time.time_ns() - 3600 * NS
    base = {"project": "p", "run_id": "runA", "attempt": 2}
    with open_store(store_url, owner="test") as store:
        migrate(store)
        c = store.client
        hist, cells = [], 0
        for step in range(STEPS):
            counts = [0] * 15
            for b in (step % 15, (step + 3) % 15, 11):
                counts[b] += step + 1
            cells += sum(1 for n in counts if n)
            hist.append({**base, "step": step, "term": "total", "bounds": BOUNDS, "bucket_counts": counts,
                         "count": sum(counts), "sum": 1.0, "min": 0.0, "max": 1.0, "zero_fraction": 0.0,
                         "emitted_at_ns": now + step})
        hist.append({**hist[0], "emitted_at_ns": now - 10})  # a replayed older duplicate: FINAL drops it
        hist.append({**hist[0], "term": "judge", "bucket_counts": [1] * 15})  # another term: not in the heatmap
        hist.append({**hist[0], "attempt": 1})  # an older attempt
        _insert(c, "reward_histograms", hist)
        _insert(c, "step_stats", [
            {**base, "step": s, "rollouts": 16, "clipped": s, "clipped_ratio": s / 16, "reward_mean": 0.5,
             "reward_std": 0.1, "reward_min": 0.0, "reward_max": 1.0, "reward_zero_fraction": 0.1,
             "completion_mean": 100.0, "completion_min": 1, "completion_max": 200, "samples": 4,
             "samples_same_reward": 0, "sample_reward_spread_mean": 0.2, "complete": True, "emitted_at_ns": now + s}
            for s in range(STEPS)])
        _insert(c, "steps", [  # a STEP event per step: tokens/s and MFU for their charts (the last MFU out of [0, 1])
            {**base, "stage": "train", "time_ns": now + s * NS, "type": "STEP", "trainer": "rl", "step": s,
             "step_count": s + 1, "tokens": 1000, "duration_s": 2.0, "throughput": 500.0 + s,
             "mfu": 1.5 if s == STEPS - 1 else 0.25, "dropped_events": 0, "writer_id": "w", "sequence_id": s + 1}
            for s in range(STEPS)])
        failures = []
        for w in range(4):
            for cause in ("timeout", "http_500", "parse"):
                failures.append({**base, "term": "judge", "cause": cause, "window_start_ns": now + w * 10 * NS,
                                 "window_end_ns": now + (w + 1) * 10 * NS, "failures": 2 * w + 3,
                                 "graded": 40, "emitted_at_ns": now})
        _insert(c, "grader_failures", failures)
        placement = {**base, "stage": "train", "role": "trainer", "pod": "pod-0", "node": "n0", "host": "h0"}
        _insert(c, "placements", [
            {**placement, "time_ns": now, "rank": 0, "index": 0, "hw_id": "GPU-aaaa"},
            {**placement, "time_ns": now, "rank": 1, "index": 1, "hw_id": "GPU-bbbb"},
            {**placement, "run_id": "other", "time_ns": now, "rank": 0, "index": 0, "hw_id": "GPU-cccc"},
        ])
        samples = []
        # utilisation as NVML's poller stores it: a fraction, 0..1 (GPU-aaaa at 0.9, 0.91, ...)
        for hw, idx, util in (("GPU-aaaa", 0, 0.9), ("GPU-bbbb", 1, 0.4), ("GPU-cccc", 0, 0.05)):
            for k in range(8):  # 7 inside [placement, placement + 60 s], the last one after it
                samples.append({"project": "p", "run_id": "", "attempt": 0, "time_ns": now + k * 10 * NS,
                                "hw_id": hw, "index": idx, "host": "h0", "node": "n0", "pod": "pod-0",
                                "rank": None, "role": None, "power_w": 300 + 20 * k + 100 * util,
                                "temperature_c": 60.0, "gpu_utilization": round(util + k / 100, 2), "memory_used_bytes": 1,
                                "memory_total_bytes": 2, "memory_utilization": 50.0, "memory_activity": 10.0,
                                "sm_clock_mhz": 1500.0, "throttle_reasons": 0, "xid_errors": 0, "xid_last": None})
        _insert(c, "gpu_samples", samples)
        alert = {"severity": "warning", "summary": "s", "value": 1.0, "threshold": 0.5, "project": "p"}
        _insert(c, "alerts", [
            {**alert, "rule": "grader_failure_rate", "state": "FIRING", "key": "runA", "run_id": "runA", "attempt": 2,
             "time_ns": now + 5 * NS, "first_seen_ns": now + 5 * NS, "last_seen_ns": now + 5 * NS},
            {**alert, "rule": "grader_failure_rate", "state": "RESOLVED", "key": "runA", "run_id": "runA", "attempt": 2,
             "time_ns": now + 35 * NS, "first_seen_ns": now + 5 * NS, "last_seen_ns": now + 35 * NS},
            {**alert, "rule": "gpu_xid", "state": "FIRING", "key": "GPU-bbbb", "run_id": "", "attempt": 0,
             "time_ns": now + 20 * NS, "first_seen_ns": now + 20 * NS, "last_seen_ns": now + 20 * NS},
            {**alert, "rule": "gpu_xid", "state": "FIRING", "key": "GPU-cccc", "run_id": "", "attempt": 0,
             "time_ns": now + 20 * NS, "first_seen_ns": now + 20 * NS, "last_seen_ns": now + 20 * NS},
        ])
    return {"cells": cells, "alerts": 3, "windows": 4, "segments": 4 * 3, "gpu_points": 7}


def _chromium(out: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", *extra, out.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _png_colours(data: bytes) -> int:
    """Distinct colours of an 8-bit RGB(A) PNG (Chromium writes those), without a PNG library."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, colour_type = 8, b"", 0, 0, 0
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour_type = struct.unpack(">IIBB", chunk[:10])
            assert depth == 8 and colour_type in (2, 6), (depth, colour_type)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    bpp = 3 if colour_type == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    prev, seen = bytearray(stride), set()
    for y in range(height):
        filt, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a, b = line[i - bpp] if i >= bpp else 0, prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if filt == 1:
                line[i] = (line[i] + a) & 255
            elif filt == 2:
                line[i] = (line[i] + b) & 255
            elif filt == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif filt == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        if y % 8 == 0:
            seen.update(bytes(line[x:x + 3]) for x in range(0, stride, bpp * 4))
        prev = line
    return len(seen)


def _chart(dom: str, name: str) -> str:
    match = re.search(rf'<svg[^>]*data-chart="{name}"[^>]*>(.*?)</svg>', dom, re.S)
    assert match, f"no <svg data-chart={name}> in the rendered page"
    assert "no-data" not in match.group(1), f"{name} says no data"
    return match.group(1)


@pytest.mark.full  # a browser: make test-all
def test_html_report_renders_every_chart(tmp_path: Path) -> None:
    if not Path(CHROMIUM).exists():
        unavailable(f"{CHROMIUM} is missing: apt-get install chromium, or make browser (headless Chromium renders the page)")
    store_url = f"chdb://{tmp_path / 'ch'}"
    expected = _seed(store_url)
    out = tmp_path / "report.html"
    env = {**os.environ, "RLPULSE_CLICKHOUSE_URL": store_url, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "rlpulse.cli", "report", "runA", "--html", str(out)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    assert "attempt 2" in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "the page must not load anything"

    dumped = _chromium(out, tmp_path / "profile-dom", "--dump-dom")
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom = dumped.stdout
    for name in CHARTS:
        _chart(dom, name)
    assert len(re.findall(r'<rect class="cell"', _chart(dom, "reward-heatmap"))) == expected["cells"]
    clipped = re.findall(r'<polyline class="series"[^>]*points="([^"]*)"', _chart(dom, "clipped-ratio"))
    assert len(clipped) == 1 and len(clipped[0].split()) == STEPS
    assert len(re.findall(r'<rect class="segment"', _chart(dom, "failures-by-cause"))) == expected["segments"]
    for name, points in (("throughput", STEPS), ("mfu", STEPS - 1)):  # no MFU drawn for the one outside [0, 1]
        [line] = re.findall(r'<polyline class="series"[^>]*points="([^"]*)"', _chart(dom, name))
        assert len(line.split()) == points, name
    for name in ("gpu-utilization", "gpu-power"):
        lines = re.findall(r'<polyline class="series" data-series="([^"]*)"[^>]*points="([^"]*)"', _chart(dom, name))
        assert sorted(label.split()[-1] for label, _ in lines) == ["GPU-aaaa", "GPU-bbbb"], lines
        assert all(len(points.split()) == expected["gpu_points"] for _, points in lines)
    markers = re.findall(r'class="marker" data-state="(\w+)"', _chart(dom, "alerts-timeline"))
    assert sorted(markers) == ["FIRING", "FIRING", "RESOLVED"]

    artefact = Path(os.environ.get("RLPULSE_TEST_ARTIFACTS", REPO / "test-artifacts")) / "html-report" / "report.png"
    artefact.parent.mkdir(parents=True, exist_ok=True)
    png = tmp_path / "report.png"
    shot = _chromium(out, tmp_path / "profile-shot", f"--screenshot={png}", "--window-size=1400,2400")
    assert shot.returncode == 0 and png.exists(), shot.stderr[-2000:]
    shutil.copyfile(png, artefact)
    data = png.read_bytes()
    assert len(data) > 20_000, f"screenshot is only {len(data)} bytes"
    assert _png_colours(data) > 10, "the screenshot is (nearly) one colour"


def test_text_report_still_works(tmp_path: Path) -> None:
    store_url = f"chdb://{tmp_path / 'ch'}"
    _seed(store_url)
    env = {**os.environ, "RLPULSE_CLICKHOUSE_URL": store_url, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "rlpulse.cli", "report"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "== rows per table" in done.stdout and "runA" in done.stdout
    lines = done.stdout.split("== throughput and efficiency per run (all projects) ==\n")[1].splitlines()
    # steps 0-5, 1000 tokens each at 500 + step tokens/s; MFU 0.25 but the last step's 1.5 (outside [0, 1])
    assert re.split(r"\s{2,}", lines[0])[:4] == ["project", "run_id", "attempt", "steps"]
    assert lines[2].split() == ["p", "runA", "2", "6", "6000", "502.5", "0.25", "1"]
    assert lines[3] == "1 step reported an MFU outside [0, 1]: no MFU is shown for them, and the mean leaves them out."


def test_empty_run_renders_no_data_notes(tmp_path: Path) -> None:
    from rlpulse.sinks.views.html_report import render

    with open_store(f"chdb://{tmp_path / 'ch'}", owner="test") as store:
        migrate(store)
        page = render(store, "nobody")
    for name in CHARTS:
        assert f'data-chart="{name}"' in page
    assert 'data-chart="term-shares"' in page  # the reward terms' chart (this test's run declares no term)
    assert page.count('class="no-data"') == len(CHARTS) + 1


def test_the_reports_gpu_chart_reads_a_gpu_at_0_9_as_90_percent(tmp_path: Path) -> None:
    """Utilisation is stored 0..1: the report drew it on a 0-100 axis once, so a GPU at 90 % read as idle.
    It is drawn as the run page draws it: a 0..1 axis labelled in %, the point 90 % of the way up."""
    from rlpulse.sinks.views.html_report import render

    store_url = f"chdb://{tmp_path / 'ch'}"
    _seed(store_url)
    with open_store(store_url, owner="test") as store:
        page = render(store, "runA")
    svg = re.search(r'<svg[^>]*data-chart="gpu-utilization".*?</svg>', page, re.S).group(0)
    ticks = {label: float(y) - 4 for y, label in re.findall(r'<text class="y-tick" x="[^"]*" y="([^"]*)"[^>]*>([^<]*)<', svg)}
    assert list(ticks) == ["0%", "25%", "50%", "75%", "100%"]
    points = re.findall(r'<circle class="point" data-series="([^"]*)" data-x="[^"]*" data-value="([^"]*)" cx="[^"]*" '
                        r'cy="([^"]*)"[^>]*><title>([^<]*)</title>', svg)
    first = [p for p in points if p[0].endswith("GPU-aaaa")][0]
    assert first[1] == "0.9" and first[3].endswith(": 90%"), first
    zero, full = ticks["0%"], ticks["100%"]
    assert float(first[2]) == pytest.approx(zero + 0.9 * (full - zero), abs=0.06)  # 90 % of the way up the axis
    # every point's hover text is its value in %, and the GPU of another run is not drawn
    assert sorted(title.rsplit(": ", 1)[1] for _, _, _, title in points) == sorted(
        f"{round(u + k / 100, 2) * 100:.3g}%" for u in (0.9, 0.4) for k in range(7))
    assert "GPU-cccc" not in svg
