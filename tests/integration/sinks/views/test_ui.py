"""``rlpulse ui`` in a browser: Playwright for Python driving Debian's chromium (never a
downloaded browser) against the real CLI, fed by the simulator, a traced agent on the real ``openai``
client and a run whose id is hostile, through the broker, ``rlpulse streams`` and ``rlpulse sink``.

While the sink holds the chDB store the page reads through its read endpoint; at the end, with the
pipeline stopped, from the store itself. Every figure checked on a page is compared with what the
saved queries give (run the way ``rlpulse query --saved`` runs them) or with the spans as stored.
Every request the browser makes is recorded: none may leave loopback. Each page's screenshot is
written to docs/ui/ (docs/queries-and-views.md shows them).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.producers import TrainingTelemetry
from rlpulse.producers.simulators.simulator import SimConfig, simulate
from rlpulse.producers.tracing import Tracer
from rlpulse.base.env import SPAN_CAP
from rlpulse.base.settings import Settings
from rlpulse.base.terminal import terminal_safe
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.read import queries
from rlpulse.sinks.store.clickhouse import open_reader
from rlpulse.sinks.views.ui_html import fmt_count, fmt_duration, fmt_number, fmt_rate, fmt_ratio
from tests.integration.sinks.views.browser import CHROMIUM, REPO, playwright_or_unavailable, ui_server
from tests.integration import until

pytestmark = [pytest.mark.integration, pytest.mark.full]
pytest.importorskip("openai")

SHOTS = REPO / "docs" / "ui"
TOKEN = "ui-test-" + "5f3a9c" * 6
HOSTILE = "<img src=x onerror=alert(1)>\x1b[2J\x1b]0;pwned\x07"
SIM = SimConfig(project="uisim", runs=2, steps=4, rollouts_per_step=8, gpu=True, seed=11)
RUN = "uisim-run1"
CAP = 6  # full trajectories per step the sink keeps: 2 of each simulated step's 8 are stored without content


def saved(settings: Settings, name: str, **params: Any) -> list[dict[str, Any]]:
    """A saved query as ``rlpulse query --saved NAME`` runs it (its own reader, read-only)."""
    args = {k: str(v) for k, v in params.items()}
    with open_reader(settings.clickhouse_dsn, owner="test") as store:
        columns, rows = queries.run_query(store.client, queries.saved_sql(name, args, store.database), args)
    return [dict(zip(columns, r)) for r in rows]


def shown(value: Any, digits: int = 4) -> str:
    """A figure as the page writes it (rounded, trailing zeros dropped)."""
    if value is None:
        return "–"
    if isinstance(value, int):
        return str(value)
    text = f"{round(float(value), digits):.{digits}f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def points(page: Any, chart: str) -> dict[str, dict[float, float]]:
    """Every dot of a chart: series -> {step: value}, from the exact values the dots carry (data-x, data-value)."""
    found = page.locator(f'svg[data-chart="{chart}"] circle.point').evaluate_all(
        "els => els.map(e => [e.dataset.series, e.dataset.x, e.dataset.value])")
    out: dict[str, dict[float, float]] = {}
    for series, x, value in found:
        out.setdefault(series, {})[float(x)] = float(value)
    return out


def hover(page: Any, chart: str) -> list[str]:
    """The hover text of each step of a chart (its transparent columns' <title>s), left to right."""
    return page.locator(f'svg[data-chart="{chart}"] g.hover rect title').all_text_contents()


@pytest.fixture(scope="module")
def ran(module_settings: Settings) -> Any:
    sync_playwright = playwright_or_unavailable()
    from tests.openai_server import FakeOpenAI
    from tests.traced_agent import Agent, Task

    settings = module_settings
    ensure_topics(settings)
    tasks = [Task(step=s, rollout_id=f"r-{s}-{i}", sample_id="s-0", question=f"step {s}: what is 6*7? ({i})")
             for s in (0, 1) for i in range(2)]
    with FakeOpenAI() as fake, Pipeline(settings) as pipeline:
        pipeline.start(extra_env={SPAN_CAP: str(CAP)})
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        truth = simulate(settings, SIM)
        with TrainingTelemetry(project="traces", run_id="agent", settings=settings) as tel, Tracer(tel, content=True):
            agent = Agent(fake.base_url)
            for step in (0, 1):
                for task in (t for t in tasks if t.step == step):
                    agent.rollout(task)
                tel.step_completed(step)
        with TrainingTelemetry(project="uisim", run_id=HOSTILE, settings=settings) as tel:
            for i in range(2):
                tel.rollout(step=0, rollout_id=f"h-{i}", reward=0.5, completion_tokens=10, max_tokens=100, sample_id=HOSTILE)
            tel.step_completed(0)
        pipeline.wait_caught_up(until=until.counts(settings, {
            f"SELECT count() FROM $db.spans FINAL WHERE project = '{SIM.project}' AND run_id LIKE 'uisim-run%'": truth.spans,
            "SELECT count() FROM $db.spans FINAL WHERE run_id = 'agent'": 4 * 5,
            "SELECT count() FROM $db.step_stats FINAL": SIM.runs * SIM.steps + 2 + 1}))
        with ui_server(settings, TOKEN) as link:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
                requests: list[str] = []
                dialogs: list[str] = []

                def context() -> Any:
                    ctx = browser.new_context(viewport={"width": 1300, "height": 1000})

                    def only_loopback(route: Any) -> None:
                        requests.append(route.request.url)
                        host = urlsplit(route.request.url).hostname
                        route.continue_() if host == "127.0.0.1" else route.abort()

                    ctx.route("**/*", only_loopback)
                    ctx.on("request", lambda r: requests.append(r.url))
                    ctx.on("page", lambda pg: pg.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss())))
                    return ctx

                page = context().new_page()
                yield {"settings": settings, "pipeline": pipeline, "link": link, "base": link.split("?")[0],
                       "page": page, "context": context, "requests": requests, "dialogs": dialogs, "truth": truth}
                browser.close()


def shot(page: Any, name: str, full: bool = True) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=full)


def test_without_the_token_there_is_nothing(ran: Any) -> None:
    page = ran["context"]().new_page()
    for path in ("", "run?project=uisim&run=uisim-run1&attempt=1", "ui.css", "?token=wrong"):
        answer = page.goto(ran["base"] + path)
        assert answer.status == 403, path
        assert "uisim" not in page.content() and "run1" not in page.content()


def test_runs_page_shows_what_the_saved_queries_give(ran: Any) -> None:
    page = ran["page"]
    page.goto(ran["link"])
    assert page.url == ran["base"], "the token leaves the address bar"
    status = {(r["project"], r["run_id"]): r for r in saved(ran["settings"], "run-status")}
    for run in ("uisim-run1", "uisim-run2"):
        row = page.locator(f'tr.run[data-project="uisim"][data-run="{run}"]')
        assert row.locator("td.state").inner_text() == status[("uisim", run)]["status"].upper() == "FINISHED"
        assert row.locator("td.steps-done").inner_text() == str(status[("uisim", run)]["steps"]) == str(SIM.steps)
        assert row.locator("td.step").inner_text() == str(SIM.steps - 1)
        trend = saved(ran["settings"], "clipped-ratio-trend", run_id=run, attempt=1)
        assert row.locator("td.clipped").inner_text() == shown(trend[-1]["clipped_ratio"])
    assert page.locator('tr.run[data-project="traces"][data-run="agent"]').count() == 1
    shot(page, "runs")
    page.select_option("select[name=project]", "traces")
    with page.expect_navigation():  # page.url and the next reads wait for the new page
        page.click("form.filters button")
    assert parse_qs(urlsplit(page.url).query)["project"] == ["traces"]
    assert [r.get_attribute("data-run") for r in page.locator("tr.run").all()] == ["agent"]


def test_run_page_charts_and_steps_equal_the_saved_queries(ran: Any) -> None:
    page, settings = ran["page"], ran["settings"]
    page.goto(ran["base"])
    with page.expect_navigation():  # page.url and the next reads wait for the new page
        page.click(f'tr.run[data-run="{RUN}"] td.run-id a')
    assert urlsplit(page.url).path == "/run"
    [status] = [r for r in saved(settings, "run-status") if (r["project"], r["run_id"]) == ("uisim", RUN)]
    assert [page.locator(f'div.figure[data-figure="{k}"] .value').inner_text() for k in ("status", "steps done")] == [
        status["status"], str(status["steps"])]
    for name in ("reward", "reward-heatmap", "clipped-ratio", "failures", "completion-length", "alerts"):
        chart = page.locator(f'svg[data-chart="{name}"]')
        assert chart.count() == 1 and chart.locator(".no-data").count() == 0, name
    assert page.locator('svg[data-chart="reward-heatmap"] rect.cell').count() > 0
    trend = saved(settings, "clipped-ratio-trend", run_id=RUN, attempt=1)
    pct = {r["step"]: r for r in saved(settings, "reward-percentiles", run_id=RUN, attempt=1)}
    failures: dict[int, int] = {}
    by_cause = saved(settings, "failures-by-step", run_id=RUN)
    for r in by_cause:
        failures[r["step"]] = failures.get(r["step"], 0) + r["failures"]
    assert len(trend) == SIM.steps and sum(failures.values()) > 0
    rates = {r["step"]: r for r in saved(settings, "step-throughput", run_id=RUN, attempt=1) if r["project"] == SIM.project}
    assert sorted(rates) == [r["step"] for r in trend]
    for r in trend:
        row = page.locator(f'tr.step[data-step="{r["step"]}"]')
        rate = rates[r["step"]]
        # each number written by its kind: counts with separators, ratios in %, rates with an SI prefix
        assert {c: row.locator(f"td.{c}").inner_text() for c in ("tokens", "tokens-per-s", "mfu")} == {
            "tokens": fmt_count(rate["tokens"]), "tokens-per-s": fmt_rate(rate["tokens_per_s"]), "mfu": fmt_ratio(rate["mfu"])}
        got = {c: row.locator(f"td.{c}").inner_text() for c in ("rollouts", "clipped", "clipped-ratio", "change", "p10",
                                                                  "p50", "p90", "failures")}
        assert got == {"rollouts": fmt_count(r["rollouts"]), "clipped": fmt_count(r["clipped"]),
                       "clipped-ratio": fmt_ratio(r["clipped_ratio"]), "change": fmt_ratio(r["change"]),
                       "p10": fmt_number(pct[r["step"]]["p10"]), "p50": fmt_number(pct[r["step"]]["p50"]),
                       "p90": fmt_number(pct[r["step"]]["p90"]), "failures": fmt_count(failures.get(r["step"], 0))}
    segments = page.locator('svg[data-chart="failures"] rect.segment title').all_text_contents()
    assert sorted(segments) == sorted(f"step {r['step']} {r['term']}: {r['cause']}: {r['failures']}" for r in by_cause)
    shot(page, "run")


def test_run_page_draws_tokens_throughput_and_the_judge_per_step_as_the_saved_queries_give(ran: Any) -> None:
    page, settings = ran["page"].context.new_page(), ran["settings"]  # the next test goes on from ran["page"]
    page.goto(ran["base"] + f"run?project=uisim&run={RUN}&attempt=1")
    rates = [r for r in saved(settings, "step-throughput", run_id=RUN, attempt=1) if r["project"] == SIM.project]
    assert len(rates) == SIM.steps
    assert points(page, "tokens") == {"tokens": {r["step"]: r["tokens"] for r in rates}}
    assert points(page, "throughput") == {"tokens/s": {r["step"]: r["tokens_per_s"] for r in rates
                                                       if r["tokens_per_s"] is not None}}
    assert points(page, "mfu") == {"MFU": {r["step"]: r["mfu"] for r in rates if r["mfu"] is not None}}
    # hover text on every step of every series, each value written by its kind
    timed = [r for r in rates if r["tokens_per_s"] is not None]
    assert hover(page, "throughput") == [f"step {r['step']} | tokens/s: {fmt_rate(r['tokens_per_s'])}" for r in timed]
    assert page.locator('svg[data-chart="throughput"] circle.point title').all_text_contents() == [
        f"tokens/s at step {r['step']}: {fmt_rate(r['tokens_per_s'])}" for r in timed]
    terms = [r for r in saved(settings, "term-figures", run_id=RUN) if (r["project"], r["attempt"]) == (SIM.project, 1)]
    graded = [r for r in terms if r["graded"]]
    judged = sorted({r["term"] for r in terms if r["judge_input_tokens"] or r["judge_output_tokens"]})
    assert judged == ["judge"]  # the simulated judge reports its tokens; the format check has none
    assert points(page, "judge-tokens") == {
        f"{t} {io}": {r["step"]: r[f"judge_{key}_tokens"] for r in graded if r["term"] == t}
        for t in judged for io, key in (("in", "input"), ("out", "output"))}
    assert points(page, "grader-durations") == {
        f"{t} {q}": {r["step"]: r[f"duration_{q}_s"] for r in graded if r["term"] == t}
        for q in ("p50", "p90") for t in sorted({r["term"] for r in graded})}
    titles = page.locator('svg[data-chart="grader-durations"] circle.point title').all_text_contents()
    assert sorted(titles) == sorted(f"{r['term']} {q} at step {r['step']}: {fmt_duration(r[f'duration_{q}_s'])}"
                                    for r in graded for q in ("p50", "p90"))
    # the terms table: the judge's tokens as counts, its p90 as a duration
    row = page.locator('table.terms tr.term[data-term="judge"]')
    judge = [r for r in terms if r["term"] == "judge"]
    assert row.locator("td.judge-input-tokens").inner_text() == fmt_count(sum(r["judge_input_tokens"] for r in judge))
    assert row.locator("td.duration-p90-s").inner_text() == fmt_duration(
        max(r["duration_p90_s"] for r in judge if r["graded"]))


def test_run_page_is_a_grid_without_empty_charts_and_links_search_and_compare(ran: Any) -> None:
    page = ran["page"].context.new_page()
    page.goto(ran["base"] + f"run?project=uisim&run={RUN}&attempt=1")
    assert page.locator("svg.chart.empty").count() == 0 and page.locator(".no-data").count() == 0
    charts = page.locator(".charts svg.chart").all()
    assert len(charts) >= 10
    first, second = charts[0].bounding_box(), charts[1].bounding_box()
    assert first["y"] == second["y"] and second["x"] > first["x"] + first["width"] - 1, "two charts to a row"
    assert page.locator(".charts g.hover rect").count() > 0
    links = {a.get_attribute("class"): a.get_attribute("href") for a in page.locator(".run-links a").all()}
    assert links == {"search-run": f"/search?project=uisim&run={RUN}&attempt=1",
                     "compare-run": f"/compare?run=uisim%2F{RUN}%2F1"}
    # the traced agent's run has no GPU and no engine: those charts are not drawn, one line names them
    page.goto(ran["base"] + "run?project=traces&run=agent&attempt=1")
    assert page.locator("svg.chart.empty").count() == 0 and page.locator(".no-data").count() == 0
    for name in ("gpu-utilization", "gpu-power", "engine", "engine-rate", "engine-latency", "failures"):
        assert page.locator(f'svg[data-chart="{name}"]').count() == 0, name
    missing = page.locator("p.not-drawn").get_attribute("data-charts").split(",")
    assert {"GPU utilisation", "GPU power", "engines", "grader failures"} <= set(missing)
    assert "rollout metric turns" not in missing


def test_run_page_draws_rollout_and_reward_metrics_as_the_saved_query_gives(ran: Any) -> None:
    page, settings = ran["page"].context.new_page(), ran["settings"]
    page.goto(ran["base"] + "run?project=traces&run=agent&attempt=1")
    rows = [r for r in saved(settings, "rollout-metrics", run_id="agent") if (r["project"], r["attempt"]) == ("traces", 1)]
    names = {(r["kind"], r["name"]) for r in rows}
    assert names == {("ROLLOUT", "turns"), ("ROLLOUT", "tool_calls"), ("REWARD", "exact"), ("REWARD", "length")}
    assert {r["step"] for r in rows} == {0, 1} and all(r["rollouts"] == 2 for r in rows)  # 2 traced rollouts a step
    for kind, name in sorted(names):
        chart = f"{kind.lower()}-metric-{name}"
        mine = [r for r in rows if (r["kind"], r["name"]) == (kind, name)]
        assert points(page, chart) == {q: {r["step"]: r[q] for r in mine} for q in ("mean", "min", "max")}, chart
        assert hover(page, chart) == [
            f"step {r['step']} | mean ± std: {fmt_number(r['mean'] - r['std'])} to {fmt_number(r['mean'] + r['std'])} | "
            f"mean: {fmt_number(r['mean'])} | min: {fmt_number(r['min'])} | max: {fmt_number(r['max'])}" for r in mine]
    shot(page, "run-traced")


def test_step_page_samples_side_by_side(ran: Any) -> None:
    page, settings = ran["page"], ran["settings"]
    with page.expect_navigation():  # page.url and the next reads wait for the new page
        page.click('tr.step[data-step="2"] a')
    assert parse_qs(urlsplit(page.url).query)["step"] == ["2"]
    trend = next(r for r in saved(settings, "clipped-ratio-trend", run_id=RUN, attempt=1) if r["step"] == 2)
    figure = {k: page.locator(f'div.figure[data-figure="{k}"] .value').inner_text()
              for k in ("rollouts", "clipped", "clipped ratio")}
    assert figure == {"rollouts": str(trend["rollouts"]), "clipped": str(trend["clipped"]),
                      "clipped ratio": shown(trend["clipped_ratio"])}
    rewards = dict(until.query(settings, f"SELECT rollout_id, reward FROM $db.spans FINAL WHERE run_id = '{RUN}' "
                                         "AND step = 2 AND kind = 'ROLLOUT'") or [])
    groups = page.locator("section.group")
    per_sample = SIM.rollouts_per_step // SIM.rollouts_per_sample
    assert groups.count() == per_sample
    for g in groups.all():
        cards = g.locator("a.card").all()
        assert len(cards) == SIM.rollouts_per_sample
        boxes = [c.bounding_box() for c in cards]
        assert len({round(b["y"]) for b in boxes}) == 1, "the N trajectories share one row"
        assert [b["x"] for b in boxes] == sorted(b["x"] for b in boxes)
        for c in cards:
            assert c.locator(".reward").inner_text() == shown(rewards[c.get_attribute("data-rollout")])
    dropped = {r["step"]: r for r in saved(settings, "content-dropped", run_id=RUN)}
    assert page.locator("a.card .capped").count() == dropped[2]["trajectories_capped"] == SIM.rollouts_per_step - CAP
    shot(page, "step")
    page.select_option("select[name=sort]", "reward-desc")
    page.select_option("select[name=failed]", "any")
    with page.expect_navigation():  # page.url and the next reads wait for the new page
        page.click("form.filters button")
    query = parse_qs(urlsplit(page.url).query)
    assert (query["sort"], query["failed"]) == (["reward-desc"], ["any"])
    means = [float(t.split("mean reward ")[1].split(" ")[0]) for t in page.locator("section.group h3").all_inner_texts()]
    assert means == sorted(means, reverse=True)
    for g in page.locator("section.group").all():
        assert g.locator("a.card .failed").count() >= 1
    ran["shared"] = page.url


def test_a_shared_url_reopens_the_same_view(ran: Any) -> None:
    page = ran["page"]
    page.goto(ran["shared"])
    before = page.inner_text("main")
    other = ran["context"]().new_page()  # another browser profile: no cookie; the shared link plus the token
    other.goto(ran["shared"] + f"&token={TOKEN}")
    assert other.url == ran["shared"]
    assert other.inner_text("main") == before


def test_trajectory_page_graders_tools_and_span_tree(ran: Any) -> None:
    page, settings = ran["page"], ran["settings"]
    page.goto(ran["shared"])
    card = page.locator("a.card").first
    rollout = card.get_attribute("data-rollout")
    capped = card.locator(".capped").count()
    with page.expect_navigation():  # page.url and the next reads wait for the new page
        card.click()
    assert page.locator("p.content-capped").count() == capped  # the page says when the span cap kept its content out
    assert parse_qs(urlsplit(page.url).query)["rollout"] == [rollout]
    tree = saved(settings, "span-tree", run_id=RUN, attempt=1, rollout_id=rollout)
    rows = page.locator("table.tree tr.tree-row").all()
    assert [(r.locator("td").nth(0).inner_text(), r.locator("td.duration-ms").inner_text()) for r in rows] == [
        (t["name"], shown(t["duration_ms"], 3)) for t in tree]
    graders = until.query(settings, f"SELECT term, outcome, score FROM $db.spans FINAL WHERE run_id = '{RUN}' "
                                    f"AND rollout_id = '{rollout}' AND kind = 'GRADER' ORDER BY term")
    got = sorted((r.get_attribute("data-term"), r.get_attribute("data-outcome"), r.locator("td.score").inner_text())
                 for r in page.locator("table.graders tr.grader").all())
    assert got == [(t, o, shown(s)) for t, o, s in graders] and len(got) == len(SIM.terms)
    assert page.locator("table.tools tr.tool").all_inner_texts()[0].startswith("search")


def test_traced_trajectory_dialogue_and_tool_calls(ran: Any) -> None:
    page = ran["page"]
    page.goto(ran["base"] + "step?project=traces&run=agent&attempt=1&step=0")
    [group] = page.locator("section.group").all()
    assert group.get_attribute("data-sample") == "s-0" and group.locator("a.card").count() == 2
    with page.expect_navigation():  # page.url and the next reads wait for the new page
        group.locator('a.card[data-rollout="r-0-0"]').click()
    roles = [m.get_attribute("data-role") for m in page.locator(".dialogue .msg").all()]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert "calculator" in page.locator(".dialogue .tool-call").inner_text()
    assert page.locator("table.tools pre.arguments").inner_text() == '{"expression":"6*7"}'
    assert page.locator("table.tools pre.result").inner_text() == '"42"'
    assert page.locator('div.figure[data-figure="reward"] .value').inner_text() == "1"
    shot(page, "trajectory")


def test_a_hostile_run_id_renders_as_text(ran: Any) -> None:
    page = ran["page"]
    page.goto(ran["base"] + "?project=uisim")
    row = page.locator("tr.run").filter(has_text="onerror")
    assert row.locator("td.run-id").inner_text() == terminal_safe(HOSTILE)
    with page.expect_navigation():  # page.url and the next reads wait for the new page
        row.locator("td.run-id a").click()
    assert terminal_safe(HOSTILE) in page.locator("h1").inner_text()
    with page.expect_navigation():  # page.url and the next reads wait for the new page
        page.click('tr.step[data-step="0"] a')
    assert page.locator("section.group").get_attribute("data-sample") == terminal_safe(HOSTILE)
    assert page.locator("img").count() == 0 and ran["dialogs"] == []
    assert page.title() == "Step 0 of " + terminal_safe(HOSTILE)  # the escape that would retitle a terminal, as text


def test_reads_the_store_itself_once_the_sink_stopped(ran: Any) -> None:
    ran["pipeline"].stop()
    page = ran["page"]
    page.goto(ran["base"])
    assert page.locator("tr.run").count() == 4
    assert "chdb://" in page.inner_text("footer") or "http" in page.inner_text("footer")


def test_no_request_left_loopback(ran: Any) -> None:
    assert ran["requests"]
    hosts = {urlsplit(u).hostname for u in ran["requests"] if not u.startswith("data:")}
    assert hosts == {"127.0.0.1"}, hosts
