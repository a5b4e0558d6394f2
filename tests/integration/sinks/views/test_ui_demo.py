"""``rlpulse ui`` after the demo's own workload: every panel of a run's page has data.

The demo's simulated runs (``rlpulse.demo.demo_config``: trainer scalars, checkpoint saves, a GPU
with an XID) and its other signals (``rlpulse.demo.simulate_signals``: the first run's engine,
dated within that run's steps) go through the broker, ``rlpulse streams`` and ``rlpulse sink``
with the demo's settings; then Debian's chromium (Playwright, never a downloaded browser) opens the
first run's page as a newcomer would from the link the demo prints. No chart may say "no data";
the trainer's loss and KL are drawn at every step with the values the simulator sent, the engine
charts have a point at every step, and the run's checkpoint saves are what the saved query
``checkpoints`` lists.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from rlpulse.base.settings import Settings
from rlpulse.demo import demo_config, demo_settings, simulate_signals
from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.producers.simulators.simulator import simulate
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.read import queries
from rlpulse.sinks.store.clickhouse import open_reader
from rlpulse.sinks.views.ui_html import fmt_number
from tests.integration import until
from tests.integration.sinks.views.browser import CHROMIUM, playwright_or_unavailable, ui_server

pytestmark = [pytest.mark.integration, pytest.mark.full]

TOKEN = "ui-demo-test-" + "9c3a5f" * 6
PROJECT = "uidemo"
RUN = f"{PROJECT}-run1"  # the run the demo's engine samples belong to
CHARTS = ("reward", "reward-heatmap", "clipped-ratio", "failures", "completion-length", "throughput", "mfu", "engine",
          "engine-rate", "gpu-utilization", "gpu-power", "alerts")


def saved(settings: Settings, name: str, **params: Any) -> list[dict[str, Any]]:
    """A saved query as ``rlpulse query --saved NAME`` runs it."""
    args = {k: str(v) for k, v in params.items()}
    with open_reader(settings.clickhouse_dsn, owner="test") as store:
        columns, rows = queries.run_query(store.client, queries.saved_sql(name, args, store.database), args)
    return [dict(zip(columns, r)) for r in rows]


@pytest.fixture(scope="module")
def demo_page(module_settings: Settings) -> Any:
    """The first run's page, rendered in chromium after the demo's workload is in ClickHouse."""
    sync_playwright = playwright_or_unavailable()
    settings = demo_settings(module_settings)
    ensure_topics(settings)
    config = demo_config(PROJECT)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        truth = simulate(settings, config)
        simulate_signals(settings, PROJECT, truth)
        window_ns = int(settings.window * 1e9)  # as the demo: the last window closes at its end + lateness
        last_close = (time.time_ns() // window_ns + 1) * window_ns + int((settings.allowed_lateness + 3) * 1e9)
        ours = f"project = '{PROJECT}'"
        steps = config.runs * config.steps
        pipeline.wait_caught_up(last_close, timeout=300, until=until.counts(settings, {
            f"SELECT count() FROM $db.spans FINAL WHERE {ours} AND run_id LIKE '{PROJECT}-run%'": truth.spans,
            f"SELECT count() FROM $db.step_stats FINAL WHERE {ours}": steps,
            f"SELECT count() FROM $db.reward_histograms FINAL WHERE {ours} AND term = 'total'": steps,
            f"SELECT count() FROM $db.completion_length_histograms FINAL WHERE {ours}": steps,
            f"SELECT count() FROM $db.engine_samples FINAL WHERE {ours}": 40,
            f"SELECT count() FROM (SELECT DISTINCT rule, key, state FROM $db.alerts WHERE {ours})":
                len(truth.expected_alerts) + 2}))  # and engine_saturated FIRING, RESOLVED
        pipeline.stop()
    with ui_server(settings, TOKEN) as link, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        page.goto(f"{link.split('?')[0]}run?project={PROJECT}&run={RUN}&attempt=1&token={TOKEN}")
        yield {"settings": settings, "truth": truth, "config": config, "page": page, "html": page.content()}
        browser.close()


def test_no_panel_of_the_run_page_says_no_data(demo_page: Any) -> None:
    page = demo_page["page"]
    assert page.locator("h1").count() == 1 and RUN in page.locator("h1").inner_text()
    assert "no data" not in demo_page["html"].lower()
    assert page.locator(".no-data").count() == 0 and page.locator("svg.chart.empty").count() == 0
    for name in CHARTS:
        chart = page.locator(f'svg[data-chart="{name}"]')
        assert chart.count() == 1, name
        assert chart.locator("polyline.series, rect.segment, rect.cell, .marker").count() > 0, name
    figures = {f.get_attribute("data-figure"): f.locator(".value").inner_text()
               for f in page.locator("div.figure").all()}
    assert figures["status"].lower() == "finished" and figures["steps done"] == str(demo_page["config"].steps)
    assert "–" not in figures.values(), figures


def test_loss_and_kl_are_drawn_at_every_step_with_the_values_sent(demo_page: Any) -> None:
    page, truth, config = demo_page["page"], demo_page["truth"], demo_page["config"]
    titles = {page.locator(f'svg[data-chart="metric-{i}"]').get_attribute("aria-label")
              for i in range(page.locator('svg[data-chart^="metric-"]').count())}
    assert {"Trainer metric loss", "Trainer metric kl"} <= titles, titles
    for name in ("loss", "kl"):
        line = page.locator(f'svg[data-chart^="metric-"] polyline[data-series="{name}"]')
        assert line.get_attribute("data-points") == str(config.steps), name
        got = sorted(page.locator('svg[data-chart^="metric-"] circle title').filter(
            has_text=re.compile(rf"^{name} at step")).all_text_contents())
        # the hover text writes the value as the page writes numbers (ui_html.fmt_number); the dot carries it exact
        assert got == sorted(f"{name} at step {s}: {fmt_number(truth.metrics[(RUN, s)][name])}" for s in range(config.steps))
        exact = line.locator("xpath=..").locator(f'circle.point[data-series="{name}"]').evaluate_all(
            "els => els.map(e => [Number(e.dataset.x), Number(e.dataset.value)])")
        assert sorted(map(tuple, exact)) == [(s, truth.metrics[(RUN, s)][name]) for s in range(config.steps)]
    stored = saved(demo_page["settings"], "step-metrics", run_id=RUN)
    assert {(r["step"], r["name"]): r["value"] for r in stored} == {
        (s, n): v for (run, s), m in truth.metrics.items() if run == RUN for n, v in m.items()}


def test_engine_charts_have_a_point_at_every_step(demo_page: Any) -> None:
    page, config = demo_page["page"], demo_page["config"]
    for chart, series in (("engine", "kv_cache_usage_max"), ("engine", "awake_share"),
                          ("engine-rate", "generation tokens/s")):
        line = page.locator(f'svg[data-chart="{chart}"] polyline[data-series="{series}"]')
        assert line.get_attribute("data-points") == str(config.steps), (chart, series)
    by_step = saved(demo_page["settings"], "engine-by-step", run_id=RUN, attempt=1)
    assert [r["step"] for r in by_step] == list(range(config.steps))
    assert sum(r["samples"] for r in by_step) == 40  # every sample of the engine falls within one of the run's steps


def test_the_runs_checkpoint_saves_are_listed(demo_page: Any) -> None:
    truth, config = demo_page["truth"], demo_page["config"]
    rows = saved(demo_page["settings"], "checkpoints", run_id=RUN)
    every = config.checkpoint_every
    assert [(r["step"], r["op"], r["outcome"]) for r in rows] == [
        (s, "save", "ok") for s in range(config.steps) if s % every == every - 1]
    assert len(rows) == truth.checkpoints[RUN] and all(r["bytes"] and r["duration_s"] > 0 for r in rows)
