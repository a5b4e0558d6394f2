"""How fast ``rlpulse ui`` answers for large runs (target: each page within 1 s).

Eight runs of 1,000 steps x 512 rollouts are written into a fresh chDB store (bench/ui_load.py; the
spans of :data:`SPAN_RUNS` of them, the per-step tables of all). :func:`ui_figures` serves the pages
over HTTP in this process, as ``rlpulse ui`` does (a store opened for each request), and times each
page's whole answer: the runs page, the first run's pages (run, step, trajectory), the 8 runs
overlaid on the compare page (by step; by time, smoothed, two metrics), and the run-wide search over
its 512,000 trajectories (by reward and failed term, by text, a deep page).

A page that does not answer 200 is recorded as failed (``ui_<page>_status``, ``ui_failed_pages``)
and the others are still timed.

    .venv/bin/python -m bench.ui_bench              # prints the figures as JSON, a table on stderr
    .venv/bin/python -m bench.ui_bench --steps 100  # smaller runs
"""

from __future__ import annotations

import argparse
import html
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

from bench.ui_load import (PER_SAMPLE, PROJECT, QUERY_WORD, ROLLOUTS, RUN, STEPS, load, run_id,
                           settle)
from rlpulse.base.settings import Settings
from rlpulse.sinks.store.clickhouse import migrate, open_reader, open_store
from rlpulse.sinks.views.ui_server import UiServer

__all__ = ["PER_SAMPLE", "PROJECT", "RUN", "load", "pages", "settle", "ui_figures"]

RUNS = 8  # runs compared
# Runs whose spans are written: the search and the run, step and trajectory pages read the first run's
# spans only, the compare page reads per-step tables only. All 8 are written anyway, so that each page reads
# a store of 8 runs' spans (12.5 million, 128,000 LLM spans with dialogue), as a user's would: 28 s to load,
# 45 s of merges, 772 MiB here; see docs/performance.md.
SPAN_RUNS = 8
REPEAT = 5
TARGET_S = 1.0
SEARCH_PAGE = 40  # the deep page of the search
ERROR_TEXT = re.compile(r'<p class="error"[^>]*>(.*?)</p>', re.S)


def pages(steps: int) -> dict[str, str]:
    """The first run's pages, as before the compare and search pages (tests read these against one run)."""
    run = f"project={PROJECT}&run={RUN}&attempt=1"
    mid = steps // 2
    return {"runs": "/", "run": f"/run?{run}", "run_metrics": f"/run?{run}&metric=kl&metric=loss&page=3",
            "step": f"/step?{run}&step={mid}", "step_filtered": f"/step?{run}&step={mid}&sort=reward-desc&failed=judge",
            "trajectory": f"/trajectory?{run}&rollout=s{mid}-r3"}


def compare_value(project: str, run: str, attempt: int) -> str:
    """A compare page's ``run=`` value: PROJECT/RUN/ATTEMPT, each name percent-encoded so a '/' in one is unambiguous."""
    return f"{quote(project, safe='')}/{quote(run, safe='')}/{attempt}"


def across_pages(runs: int = RUNS) -> dict[str, str]:
    """The pages across runs and steps: ``runs`` runs compared, and the first run's search (URL formats of issue 32)."""
    compared = "&".join(f"run={quote(compare_value(PROJECT, run_id(i), 1), safe='')}" for i in range(runs))
    search = f"/search?project={quote(PROJECT)}&run={quote(RUN)}&attempt=1"
    filtered = f"{search}&min_reward=0.2&max_reward=0.8&failed=judge"
    return {f"compare_{runs}": f"/compare?{compared}&x=step",
            f"compare_{runs}_time_smooth": f"/compare?{compared}&x=time&smooth=0.6&metric=kl&metric=loss",
            "search": filtered, "search_text": f"{search}&q={QUERY_WORD}",
            f"search_page_{SEARCH_PAGE}": f"{filtered}&page={SEARCH_PAGE}"}


def all_pages(steps: int, runs: int = RUNS) -> dict[str, str]:
    return {**pages(steps), **across_pages(runs)}


def fetch(url: str, token: str) -> tuple[int, bytes, str]:
    """(status, body, why) of one GET; status 0 when no answer came (the connection dropped, a timeout)."""
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read(), ""
    except urllib.error.HTTPError as exc:
        body = exc.read()
        said = ERROR_TEXT.search(body.decode(errors="replace"))  # the error page's own sentence
        return exc.code, body, f"{exc.code} {exc.reason}" + (f": {html.unescape(said.group(1))}" if said else "")
    except (OSError, ValueError) as exc:  # URLError, a dropped connection, a timeout
        return 0, b"", f"{type(exc).__name__}: {exc}"


def time_pages(url: str, token: str, paths: dict[str, str], repeat: int = REPEAT) -> dict[str, Any]:
    """Per page: median and max seconds of ``repeat`` answers, its bytes and status. A page that does not
    answer 200 is asked once, has no times and is listed in ``ui_failed_pages`` with why."""
    out: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for name, path in paths.items():
        took = []
        for _ in range(repeat):
            started = time.perf_counter()
            status, body, why = fetch(url.rstrip("/") + path, token)
            took.append(time.perf_counter() - started)
            if status != 200:
                break
        out[f"ui_{name}_status"] = status
        out[f"ui_{name}_bytes"] = len(body)
        if status == 200:
            out[f"ui_{name}_s_median"] = round(statistics.median(took), 4)
            out[f"ui_{name}_s_max"] = round(max(took), 4)
        else:
            out[f"ui_{name}_s_median"] = out[f"ui_{name}_s_max"] = None
            failed[name] = why
    out["ui_failed_pages"] = failed
    return out


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def ui_figures(settings: Settings, steps: int = STEPS, rollouts: int = ROLLOUTS, repeat: int = REPEAT, runs: int = RUNS,
               span_runs: int = SPAN_RUNS) -> dict[str, Any]:
    """Load ``runs`` runs of ``steps`` x ``rollouts`` (spans for the first ``span_runs``) into a fresh chDB store
    and time each page: ``ui_<page>_s_median``, ``ui_<page>_s_max``, ``ui_<page>_bytes``, ``ui_<page>_status``;
    ``ui_within_target``: every page answered 200, each within 1 s."""
    settings.home.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="ui-bench-", dir=settings.home))
    dsn = f"chdb://{folder / 'store'}"
    span_runs = max(1, min(span_runs, runs))  # the first run's pages and the search read its spans
    try:
        started = time.perf_counter()
        spans = 0
        with open_store(dsn, owner="bench ui") as store:
            migrate(store)
            for i in range(runs):
                spans += load(store, steps, rollouts, run_id(i), i, spans=i < span_runs)
            loaded = time.perf_counter()
            settle(store)
        figures: dict[str, Any] = {
            "ui_steps": steps, "ui_rollouts_per_step": rollouts, "ui_runs": runs, "ui_span_runs": span_runs,
            "ui_spans": spans, "ui_load_s": round(loaded - started, 2), "ui_settle_s": round(time.perf_counter() - loaded, 2),
            "ui_store_mib": round(disk_bytes(folder) / 2**20, 1)}
        if span_runs < runs:
            figures["ui_note"] = (f"spans of {span_runs} run(s) of {runs}, per-step tables of all: the compare page reads "
                                  "per-step tables only, the search one run's spans")
        with UiServer(lambda: open_reader(dsn, owner="bench ui"), dsn) as server:
            figures.update(time_pages(server.url, server.token, all_pages(steps, runs), repeat))
        figures["ui_within_target"] = not figures["ui_failed_pages"] and all(
            v <= TARGET_S for k, v in figures.items() if k.endswith("_s_max"))
        return figures
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def summary(figures: dict[str, Any]) -> str:
    """A table of the pages: status, median and max seconds, bytes."""
    names = [k[3:-len("_status")] for k in figures if k.startswith("ui_") and k.endswith("_status")]
    lines = [f"{'page':<26} {'status':>6} {'median s':>9} {'max s':>7} {'bytes':>10}"]
    for name in names:
        median, most = figures.get(f"ui_{name}_s_median"), figures.get(f"ui_{name}_s_max")
        lines.append(f"{name:<26} {figures[f'ui_{name}_status']:>6} {'-' if median is None else f'{median:.3f}':>9} "
                     f"{'-' if most is None else f'{most:.3f}':>7} {figures[f'ui_{name}_bytes']:>10,}")
    lines.append(f"{figures['ui_runs']} runs of {figures['ui_steps']:,} steps x {figures['ui_rollouts_per_step']} rollouts, "
                 f"spans of {figures['ui_span_runs']} ({figures['ui_spans']:,}); loaded in {figures['ui_load_s']:.0f} s "
                 f"(+{figures['ui_settle_s']:.0f} s of merges), {figures['ui_store_mib']:,.0f} MiB on disk; "
                 f"within target: {str(figures['ui_within_target']).lower()}")
    lines += [f"failed: {name}: {why}" for name, why in figures["ui_failed_pages"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--rollouts", type=int, default=ROLLOUTS)
    parser.add_argument("--repeat", type=int, default=REPEAT)
    parser.add_argument("--runs", type=int, default=RUNS, help="runs compared (1 to 8)")
    parser.add_argument("--span-runs", type=int, default=SPAN_RUNS, help="runs whose spans are written (the first N)")
    args = parser.parse_args()
    if not 1 <= args.runs <= 8:
        parser.error(f"--runs: 1 to 8 (the compare page overlays at most 8), got {args.runs}")
    figures = ui_figures(Settings.load(), args.steps, args.rollouts, args.repeat, args.runs, args.span_runs)
    print(summary(figures), file=sys.stderr)
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
