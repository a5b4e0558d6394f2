"""The compare and search pages of ``rlpulse ui`` in a browser (Playwright, Debian's chromium), fed
through the real path: the SDK's ``TrainingTelemetry`` (``config=``, rollouts, grader calls,
``step_completed(metrics=...)``) and a traced agent on the real ``openai`` client, through the broker,
``rlpulse streams`` and ``rlpulse sink``; the real ``rlpulse ui`` serves the pages.

Every figure read off a page is compared exactly with what the saved queries give (run as
``rlpulse query --saved`` runs them: reward-percentiles, clipped-ratio-trend, term-figures,
step-throughput, step-metrics, run-config), or, for the search, with SQL over the stored spans
written here, independently of the page's own.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import pytest

from rlpulse.base.settings import Settings
from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.producers import TrainingTelemetry
from rlpulse.producers.tracing import Tracer
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.read import queries
from rlpulse.sinks.store.clickhouse import open_reader
from tests.integration import until
from rlpulse.sinks.views.ui_html import fmt_number, fmt_rate
from tests.integration.sinks.views.browser import CHROMIUM, REPO, playwright_or_unavailable, ui_server

pytestmark = [pytest.mark.integration, pytest.mark.full]
pytest.importorskip("openai")

TOKEN = "cmp-test-" + "7c1e0b" * 6
PROJECT = "cmp"
CONFIG_A = {"optim": {"lr": 1e-5, "betas": [0.9, 0.99]}, "seed": 1, "model": "qwen-0.5b", "num_generations": 8}
CONFIG_B = {"optim": {"lr": 3e-5, "betas": [0.9, 0.99]}, "seed": 1, "model": "qwen-0.5b", "use_vllm": True}
CONFIG_D = {"optim": {"lr": 1e-5, "betas": [0.9, 0.95]}, "seed": 2, "model": "qwen-0.5b", "num_generations": 8}
# (run id, attempt, config, steps, trainer scalars): a run without a config; an id with a slash, on attempt 2
RUNS = (("alpha", 1, CONFIG_A, 6, ("loss", "kl", "grad_norm")), ("beta", 1, CONFIG_B, 6, ("loss", "kl")),
        ("gamma", 1, None, 4, ("loss", "entropy")), ("delta/x", 2, CONFIG_D, 5, ("loss", "kl")))
TERMS = ("judge", "format")
ROLLOUTS = 8  # per step, SDK rollouts; alpha also has traced ones (with content) at steps 1 to 3
MAX_TOKENS = 256
# the traced agent's tasks in alpha: (step, rollout id, question, model); fail-500 fails its first call (ERROR)
QUESTIONS = ((1, "t-1-a", "apple pie: what is 6*7?", "policy-7b"),
             (2, "t-2-a", 'say "banana" then: what is 6*7?', "policy-7b"),
             (2, "t-2-b", "Apple crumble: what is 6*7?", "policy-7b"),
             (3, "t-3-a", "cherry: what is 6*7?", "fail-500"))
JUDGE_FAILS = {"t-1-a": "timeout", "t-2-b": "error"}  # grader calls of the traced rollouts that failed


def publish(settings: Settings, base_url: str) -> int:
    """Every run, as a training loop sends it; returns how many ROLLOUT spans were published."""
    from tests.traced_agent import Agent, Task

    rng = random.Random(32)
    rollouts = 0
    for run, attempt, config, steps, names in RUNS:
        with contextlib.ExitStack() as stack:
            tel = stack.enter_context(TrainingTelemetry(project=PROJECT, run_id=run, attempt=attempt, settings=settings,
                                                        config=config))
            agent = None
            if run == "alpha":  # its traced rollouts record their dialogue
                stack.enter_context(Tracer(tel, content=True))
                agent = Agent(base_url)
            for step in range(steps):
                for i in range(ROLLOUTS):
                    rid = f"{run}-{step}-{i}"
                    reward = round(rng.uniform(0.0, 1.0), 3)
                    tokens = rng.randint(16, MAX_TOKENS + 40)
                    tel.rollout(step=step, rollout_id=rid, reward=reward, term_shares={"judge": reward * 0.7,
                                                                                      "format": reward * 0.3},
                                completion_tokens=min(tokens, MAX_TOKENS), max_tokens=MAX_TOKENS, sample_id=f"s{i // 2}")
                    for term in TERMS:
                        outcome = "ok" if rng.random() > 0.3 else rng.choice(("timeout", "unavailable", "error"))
                        tel.grader(step=step, rollout_id=rid, term=term, outcome=outcome, duration_s=0.25,
                                   score=round(rng.uniform(0, 1), 3) if outcome == "ok" else None)
                    rollouts += 1
                for s, rid, question, model in QUESTIONS if agent is not None else ():
                    if s == step:
                        try:
                            agent.rollout(Task(step=s, rollout_id=rid, sample_id="traced", question=question, model=model))
                        except Exception:  # fail-500: the rollout raises, its spans say ERROR
                            pass
                        rollouts += 1
                        tel.grader(step=s, rollout_id=rid, term="judge", outcome=JUDGE_FAILS.get(rid, "ok"),
                                   duration_s=0.5, score=None if rid in JUDGE_FAILS else 1.0)
                tel.step_completed(step, tokens=1000 * (step + 1) + rng.randint(0, 999), duration_s=0.5 + step / 10,
                                   mfu=round(rng.uniform(0.2, 0.6), 4),
                                   metrics={n: round(rng.uniform(-1.0, 3.0), 5) for n in names})
                time.sleep(0.3)  # the wall-clock axis has something to show
    return rollouts


def total_steps() -> int:
    return sum(r[3] for r in RUNS)


def build(settings: Settings) -> int:
    """The pipeline run over everything published; returns the ROLLOUT spans published."""
    from tests.openai_server import FakeOpenAI

    ensure_topics(settings)
    with FakeOpenAI() as fake, Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        rollouts = publish(settings, fake.base_url)
        pipeline.wait_caught_up(until=until.counts(settings, {
            f"SELECT count() FROM $db.spans FINAL WHERE project = '{PROJECT}' AND kind = 'ROLLOUT'": rollouts,
            f"SELECT count() FROM $db.step_stats FINAL WHERE project = '{PROJECT}'": total_steps(),
            f"SELECT count() FROM $db.steps FINAL WHERE project = '{PROJECT}' AND type = 'RUN_END'": len(RUNS)}))
        pipeline.stop()
    return rollouts


# -- what the tests read -------------------------------------------------------------------------

def key(run: str, attempt: int) -> str:
    """A run as the page's run= values and data-run attributes name it: each part percent-encoded."""
    return f"{PROJECT}/{quote(run, safe='')}/{attempt}"


ALL = [key(r, a) for r, a, *_ in RUNS]
LABELS = {key(r, a): f"{r} #{a}" for r, a, *_ in RUNS}
ATTEMPT = {key(r, a): (r, a) for r, a, *_ in RUNS}


def saved(settings: Settings, name: str, **params: Any) -> list[dict[str, Any]]:
    """A saved query as ``rlpulse query --saved NAME`` runs it (its own reader, read-only)."""
    args = {k: str(v) for k, v in params.items()}
    with open_reader(settings.clickhouse_dsn, owner="test") as store:
        columns, rows = queries.run_query(store.client, queries.saved_sql(name, args, store.database), args)
    return [dict(zip(columns, r)) for r in rows]


def per_run(settings: Settings, name: str, column: str, with_attempt: bool = True,
            keep: Any = lambda r: True) -> dict[str, dict[int, float]]:
    """A saved query's ``column`` by run and step, for every run of the test (rows of its project and attempt)."""
    out: dict[str, dict[int, float]] = {}
    for run, attempt, *_ in RUNS:
        found = saved(settings, name, run_id=run, **({"attempt": attempt} if with_attempt else {}))
        out[key(run, attempt)] = {int(r["step"]): r[column] for r in found
                                  if r.get("project", PROJECT) == PROJECT and r.get("attempt", attempt) == attempt
                                  and r[column] is not None and keep(r)}
    return out


def compare_url(runs: list[str], **params: Any) -> str:
    from urllib.parse import urlencode
    return "compare?" + urlencode([("run", r) for r in runs] + [(k, v) for k, vs in params.items()
                                                                   for v in (vs if isinstance(vs, list) else [vs])])


def points(page: Any, chart: str) -> dict[str, dict[int, dict[str, Any]]]:
    """Each run's points of a chart as drawn: {data-run: {step: {x, value, raw, lo, hi, title}}}."""
    found = page.locator(f'svg[data-chart="{chart}"] circle.point').evaluate_all(
        "els => els.map(e => [e.dataset.run, e.dataset.step, e.dataset.x, e.dataset.value, e.dataset.raw, "
        "e.dataset.lo || null, e.dataset.hi || null, e.querySelector('title').textContent])")
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for run, step, x, value, raw, lo, hi, title in found:
        assert int(step) not in out.get(run, {}), (chart, run, step)
        out.setdefault(run, {})[int(step)] = {"x": float(x), "value": float(value), "raw": float(raw), "title": title,
                                              "lo": None if lo is None else float(lo), "hi": None if hi is None else float(hi)}
    return out


def raw(page: Any, chart: str, field: str = "raw") -> dict[str, dict[int, float]]:
    return {run: {s: p[field] for s, p in pts.items()} for run, pts in points(page, chart).items()}


def tensorboard_ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing, written out here: debiased EMA, the first value as read."""
    out, last = [], 0.0
    for i, v in enumerate(values):
        last = last * weight + (1 - weight) * v
        out.append(last / (1 - weight ** (i + 1)))
    return out


@pytest.fixture(scope="module")
def ran(module_settings: Settings) -> Any:
    sync_playwright = playwright_or_unavailable()
    settings = module_settings
    build(settings)
    with ui_server(settings, TOKEN) as link, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
        page.goto(link)
        yield {"settings": settings, "browser": browser, "page": page, "base": link.split("?")[0]}
        browser.close()


# -- the tests -----------------------------------------------------------------------------------

def test_the_runs_page_ticks_runs_into_a_compare_url_and_links_each_search(ran: Any) -> None:
    page = ran["page"]
    page.goto(ran["base"] + f"?project={PROJECT}")
    rows = [key(r.get_attribute("data-run") or "", int(r.get_attribute("data-attempt") or 0))
            for r in page.locator("tr.run").all()]
    assert sorted(rows) == sorted(ALL)
    for run, attempt, *_ in reversed(RUNS):  # ticked in any order: the URL lists them as the table does
        page.locator(f'tr.run[data-run="{run}"][data-attempt="{attempt}"] td.pick input').check()
    with page.expect_navigation():
        page.click("form.compare-form button")
    url = urlsplit(page.url)
    assert url.path == "/compare" and parse_qs(url.query) == {"run": rows}
    assert [r.get_attribute("data-run") for r in page.locator("tr.compared").all()] == rows
    assert page.title() == f"Compare {len(RUNS)} runs"
    page.goto(ran["base"] + f"?project={PROJECT}")
    with page.expect_navigation():
        page.click('tr.run[data-run="delta/x"] td.links a.search')
    assert urlsplit(page.url).path == "/search"
    assert parse_qs(urlsplit(page.url).query) == {"project": [PROJECT], "run": ["delta/x"], "attempt": ["2"]}
    assert page.locator("p.total").get_attribute("data-total") == str(5 * ROLLOUTS)


def shot(page: Any, name: str) -> None:
    """The page's screenshot into docs/ui/ (docs/queries-and-views.md shows them), as test_ui's pages."""
    (REPO / "docs" / "ui").mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(REPO / "docs" / "ui" / f"{name}.png"), full_page=True)


def test_overlaid_figures_equal_the_saved_queries_per_run_and_step(ran: Any) -> None:
    page, settings = ran["page"], ran["settings"]
    names = ["loss", "kl", "grad_norm", "entropy"]
    assert page.goto(ran["base"] + compare_url(ALL, metric=names)).status == 200
    shot(page, "compare")
    pct = {k: {s: r for s, r in v.items()} for k, v in per_run(settings, "reward-percentiles", "p50").items()}
    full = {k: {int(r["step"]): r for r in saved(settings, "reward-percentiles", run_id=ATTEMPT[k][0], attempt=ATTEMPT[k][1])
                if r["p50"] is not None} for k in ALL}
    assert raw(page, "reward-p50") == pct
    assert raw(page, "reward-p50", "lo") == {k: {s: r["p10"] for s, r in v.items()} for k, v in full.items()}
    assert raw(page, "reward-p50", "hi") == {k: {s: r["p90"] for s, r in v.items()} for k, v in full.items()}
    assert raw(page, "clipped-ratio") == per_run(settings, "clipped-ratio-trend", "clipped_ratio")
    graded = lambda r: r["graded"] > 0  # noqa: E731 - a step without grader calls of a term has no rate
    for term in TERMS:
        assert raw(page, f"failure-rate-{term}") == per_run(settings, "term-figures", "failure_rate", with_attempt=False,
                                                            keep=lambda r, t=term: graded(r) and r["term"] == t), term
    assert raw(page, "tokens-per-s") == per_run(settings, "step-throughput", "tokens_per_s")
    assert raw(page, "mfu") == per_run(settings, "step-throughput", "mfu")
    for name in names:
        expected = per_run(settings, "step-metrics", "value", with_attempt=False, keep=lambda r, n=name: r["name"] == n)
        assert raw(page, f"metric-{name}") == {k: v for k, v in expected.items() if v}, name
    means = until.query(settings, f"SELECT run_id, attempt, step, argMax(reward_mean, emitted_at_ns) FROM $db.step_stats "
                                  f"WHERE project = '{PROJECT}' GROUP BY run_id, attempt, step") or []
    expected_means: dict[str, dict[int, float]] = {}
    for run, attempt, step, mean in means:
        expected_means.setdefault(key(run, attempt), {})[step] = mean
    assert raw(page, "reward-mean") == expected_means
    # completion length: the streams' exponential histogram, within one bucket of the exact nearest rank of what was sent
    sent = until.query(settings, f"SELECT run_id, attempt, step, arraySort(groupArray(completion_tokens)) FROM $db.spans FINAL "
                                 f"WHERE project = '{PROJECT}' AND kind = 'ROLLOUT' AND completion_tokens IS NOT NULL "
                                 "GROUP BY run_id, attempt, step") or []
    scales = dict(((r, a, s), sc) for r, a, s, sc in until.query(settings, "SELECT run_id, attempt, step, "
                  "argMax(scale, emitted_at_ns) FROM $db.completion_length_histograms GROUP BY run_id, attempt, step") or [])
    lengths = points(page, "completion-length")
    assert sorted((k, s) for k, v in lengths.items() for s in v) == sorted((key(r, a), s) for r, a, s, _ in sent)
    for run, attempt, step, tokens in sent:
        base = 2 ** (2 ** -scales[(run, attempt, step)])
        got = lengths[key(run, attempt)][step]
        for q, value in ((0.1, got["lo"]), (0.5, got["raw"]), (0.9, got["hi"])):
            exact = tokens[max(1, math.ceil(q * len(tokens))) - 1]
            assert exact / base <= value <= exact * base, (run, step, q, value, exact)
    # on the step axis every point sits at its step; the hover text says the run, the step and the value
    for run, pts in points(page, "reward-mean").items():
        for step, p in pts.items():
            assert p["x"] == step and p["value"] == p["raw"]  # no smoothing asked
            assert p["title"] == f"{LABELS[run]} at step {step}: {fmt_number(p['raw'])}"
    strips = page.locator('svg[data-chart="reward-mean"] rect.hover title').all_text_contents()
    steps = sorted({s for v in expected_means.values() for s in v})
    assert [t.split("\n")[0] for t in strips] == [f"step {s}" for s in steps]
    for step, strip in zip(steps, strips):  # one line per run that has the step, in the URL's order
        assert strip.split("\n")[1:] == [f"{LABELS[k]} at step {step}: {fmt_number(expected_means[k][step])}"
                                         for k in ALL if step in expected_means.get(k, {})]


def test_runs_are_told_apart_by_colour_and_dash_and_empty_charts_are_left_out(ran: Any) -> None:
    page = ran["page"]
    page.goto(ran["base"] + compare_url(ALL, metric=["loss", "kl"]))
    charts = page.locator("svg.chart").all()
    assert len(charts) == 2 + 1 + len(TERMS) + 3 + 2 and page.locator("svg.chart .no-data").count() == 0
    styles: dict[str, set[tuple[str | None, str | None]]] = {}
    for line in page.locator("svg.chart polyline.series").all():
        styles.setdefault(line.get_attribute("data-run") or "", set()).add(
            (line.get_attribute("stroke"), line.get_attribute("stroke-dasharray")))
    assert sorted(styles) == sorted(ALL) and all(len(s) == 1 for s in styles.values()), styles
    colours, dashes = {next(iter(s))[0] for s in styles.values()}, {next(iter(s))[1] for s in styles.values()}
    assert len(colours) == len(dashes) == len(ALL)  # each run its own colour AND its own dash
    for row in page.locator("tr.compared").all():  # the legend draws both, and names the run
        [(colour, dash)] = styles[row.get_attribute("data-run") or ""]
        swatch = row.locator("svg.swatch line")
        assert (swatch.get_attribute("stroke"), swatch.get_attribute("stroke-dasharray")) == (colour, dash)
        assert row.locator("td.label").inner_text() == LABELS[row.get_attribute("data-run") or ""]
    # steps 5 and up: only alpha and beta have them; a run without points has no line, a chart without any is not drawn
    page.goto(ran["base"] + compare_url(ALL, **{"from": 5}))
    assert {line.get_attribute("data-run") for line in page.locator("svg.chart polyline.series").all()} == {
        key("alpha", 1), key("beta", 1)}
    assert page.locator('svg[data-chart="metric-grad_norm"]').count() == 0  # not chosen: only loss is every run's
    page.goto(ran["base"] + compare_url(ALL, **{"from": 100}))
    assert page.locator("svg.chart").count() == 1
    assert page.locator('svg[data-chart="compare"] .no-data').text_content() == (
        "none of these runs has per-step figures in this step range")


def test_wall_clock_axis_and_smoothing(ran: Any) -> None:
    page, settings = ran["page"], ran["settings"]
    page.goto(ran["base"] + compare_url(ALL[:2], x="time", smooth="0.6"))
    assert page.locator('select[name="x"] option[selected]').get_attribute("value") == "time"
    assert page.locator('input[name="smooth"]').input_value() == "0.6"
    rates = {k: saved(settings, "step-throughput", run_id=ATTEMPT[k][0], attempt=ATTEMPT[k][1]) for k in ALL[:2]}
    minutes = {k: {r["step"]: (r["time_ns"] - min(x["time_ns"] for x in rs)) / 60e9 for r in rs} for k, rs in rates.items()}
    tokens = {k: {r["step"]: r["tokens_per_s"] for r in rs} for k, rs in rates.items()}
    for chart in ("tokens-per-s", "clipped-ratio"):
        got = points(page, chart)
        assert sorted(got) == sorted(ALL[:2])
        for run, pts in got.items():
            steps = sorted(pts)
            assert [pts[s]["x"] for s in steps] == pytest.approx([minutes[run][s] for s in steps], rel=1e-12, abs=1e-12)
            assert [pts[s]["value"] for s in steps] == pytest.approx(tensorboard_ema([pts[s]["raw"] for s in steps], 0.6),
                                                                     rel=1e-12)
            if chart == "tokens-per-s":
                assert {s: p["raw"] for s, p in pts.items()} == tokens[run]
                last = steps[-1]
                assert pts[last]["title"].startswith(f"{LABELS[run]} at step {last}, ")
                assert pts[last]["title"].endswith(f": {fmt_rate(pts[last]['raw'])} (smoothed: {fmt_rate(pts[last]['value'])})")
    assert page.locator('svg[data-chart="mfu"] text.x-label').text_content() == "minutes since the run’s first step"
    assert (page.locator('svg[data-chart="mfu"]').get_attribute("aria-label") or "").endswith("(EMA 0.6)")


def config_table(page: Any) -> dict[str, dict[str, str]]:
    """The configuration table as shown: {key: {data-run: cell text}}."""
    return {row.get_attribute("data-key") or "": {c.get_attribute("data-run") or "": c.inner_text()
                                                  for c in row.locator("td").all()}
            for row in page.locator("table.config-diff tr.config-key").all()}


def test_the_configuration_keys_that_differ_are_run_configs_rows(ran: Any) -> None:
    page, settings = ran["page"], ran["settings"]
    config: dict[str, dict[str, str]] = {k: {} for k in ALL}
    for run, attempt, *_ in RUNS:
        for r in saved(settings, "run-config", run_id=run):
            if (r["project"], r["attempt"]) == (PROJECT, attempt):
                config[key(run, attempt)][r["key"]] = r["value"]
    sent = [k for k in ALL if config[k]]
    assert sent == [key("alpha", 1), key("beta", 1), key("delta/x", 2)]  # gamma sent none
    every = sorted({k for k in sent for k in config[k]})
    differ = [k for k in every if len({config[run].get(k) for run in sent}) > 1]
    assert differ == ["num_generations", "optim.betas", "optim.lr", "seed", "use_vllm"]

    def expected(keys: list[str]) -> dict[str, dict[str, str]]:
        return {k: {run: config[run].get(k, "not set") if config[run] else "–" for run in ALL} for k in keys}

    page.goto(ran["base"] + compare_url(ALL))
    assert config_table(page) == expected(differ)
    assert page.locator("p.config-summary").get_attribute("data-differing") == str(len(differ))
    gamma = page.locator(f'table.config-diff th[data-run="{key("gamma", 1)}"]').inner_text()
    assert gamma.endswith("(no configuration recorded)")
    with page.expect_navigation():
        page.click("a.config-toggle")
    assert parse_qs(urlsplit(page.url).query)["config"] == ["all"]
    assert config_table(page) == expected(every)
    assert [r.get_attribute("data-key") for r in page.locator("tr.config-key.differs").all()] == differ
    page.goto(ran["base"] + compare_url([key("alpha", 1), key("gamma", 1)]))  # one run has settings: nothing to diff
    assert page.locator("table.config-diff").count() == 0
    assert page.locator("p.one-config").inner_text().startswith("Only alpha #1 sent a configuration")


# -- search --------------------------------------------------------------------------------------

def trajectories(settings: Settings) -> list[dict[str, Any]]:
    """alpha's trajectories as stored, in Python: each ROLLOUT span with its reward (else its REWARD entry's), its
    failed grader terms and its dialogue's text (every LLM span's message contents, decoded)."""
    import json

    def q(sql: str) -> list[tuple]:
        return until.query(settings, sql.replace("RUN", f"project = '{PROJECT}' AND run_id = 'alpha' AND attempt = 1")) or []

    traj = "if(rollout_id != '', rollout_id, concat('trace ', trace_id))"
    entry = dict(q(f"SELECT {traj}, reward FROM $db.spans FINAL WHERE RUN AND kind = 'REWARD' AND reward IS NOT NULL"))
    failed: dict[str, set[str]] = {}
    for k, term in q(f"SELECT {traj}, term FROM $db.spans FINAL WHERE RUN AND kind = 'GRADER' AND outcome != 'ok'"):
        failed.setdefault(k, set()).add(term)
    said: dict[str, list[str]] = {}
    for k, asked, answered in q(f"SELECT {traj}, attributes['gen_ai.input.messages'], attributes['gen_ai.output.messages'] "
                                "FROM $db.spans FINAL WHERE RUN AND kind = 'LLM'"):
        for m in json.loads(asked or "[]") + json.loads(answered or "[]"):
            said.setdefault(k, []).append(str(m.get("content") or ""))
    out = []
    for k, step, reward, status, clipped in q(f"SELECT {traj}, step, reward, toString(status), clipped FROM $db.spans FINAL "
                                              "WHERE RUN AND kind = 'ROLLOUT'"):
        out.append({"key": k, "step": step, "reward": reward if reward is not None else entry.get(k), "status": status,
                    "clipped": bool(clipped), "failed": sorted(failed.get(k, ())), "text": "\n".join(said.get(k, []))})
    return sorted(out, key=lambda t: (t["step"], t["key"]))


def matches(t: dict[str, Any], f: dict[str, str]) -> bool:
    """The page's filters, as a user reads them."""
    reward = t["reward"]
    return all((
        "min_reward" not in f or (reward is not None and reward >= float(f["min_reward"])),
        "max_reward" not in f or (reward is not None and reward <= float(f["max_reward"])),
        "status" not in f or t["status"] == f["status"],
        "failed" not in f or (bool(t["failed"]) if f["failed"] == "any" else f["failed"] in t["failed"]),
        "clipped" not in f or t["clipped"] == (f["clipped"] == "1"),
        "from" not in f or t["step"] >= int(f["from"]), "to" not in f or t["step"] <= int(f["to"]),
        "q" not in f or f["q"].lower() in t["text"].lower()))


SEARCHES = ({}, {"q": "apple"}, {"q": 'say "banana"'}, {"q": "APPLE", "failed": "judge"},
            {"failed": "judge", "from": "1", "to": "3"}, {"failed": "any", "q": "apple", "min_reward": "0.5"},
            {"status": "ERROR"}, {"clipped": "1", "max_reward": "0.5"},
            {"clipped": "0", "min_reward": "0.3", "max_reward": "0.6", "failed": "format"}, {"min_reward": "0"})


def hits(page: Any) -> list[dict[str, Any]]:
    return [{"key": r.get_attribute("data-rollout"), "step": int(r.get_attribute("data-step") or -1),
             "reward": r.locator("td.reward").inner_text(), "status": r.locator("td.status").inner_text(),
             "clipped": r.locator("td.clipped").inner_text() == "clipped", "failed": r.locator("td.failed-terms").inner_text(),
             "href": r.locator("td.rollout a").get_attribute("href")} for r in page.locator("tr.hit").all()]


def shown_hit(t: dict[str, Any]) -> dict[str, Any]:
    from urllib.parse import urlencode
    return {"key": t["key"], "step": t["step"], "reward": fmt_number(t["reward"]), "status": t["status"],
            "clipped": t["clipped"], "failed": ", ".join(t["failed"]) or "–",
            "href": "/trajectory?" + urlencode([("project", PROJECT), ("run", "alpha"), ("attempt", 1), ("rollout", t["key"])])}


@pytest.mark.parametrize("filters", SEARCHES, ids=lambda f: "&".join(f"{k}={v}" for k, v in f.items()) or "all")
def test_search_finds_what_sql_over_the_spans_finds(ran: Any, filters: dict[str, str]) -> None:
    from urllib.parse import urlencode

    page = ran["page"]
    if "truth" not in ran:
        ran["truth"] = trajectories(ran["settings"])
        assert len(ran["truth"]) == 6 * ROLLOUTS + len(QUESTIONS)
    expected = [t for t in ran["truth"] if matches(t, filters)]
    assert expected, filters  # each search finds something: a page of no hits would pass too easily
    answer = page.goto(ran["base"] + "search?" + urlencode({"project": PROJECT, "run": "alpha", **filters}))
    assert answer.status == 200
    assert page.locator("p.total").get_attribute("data-total") == str(len(expected))
    got = hits(page)
    while page.locator('.pager a[rel="next"]').count():  # every page, through the pager's links (they keep the filters)
        nxt = parse_qs(urlsplit(page.locator('.pager a[rel="next"]').first.get_attribute("href") or "").query)
        assert {k: v for k, v in nxt.items() if k != "page"} == {"project": [PROJECT], "run": ["alpha"], "attempt": ["1"],
                                                                 **{k: [v] for k, v in filters.items()}}
        with page.expect_navigation():
            page.locator('.pager a[rel="next"]').first.click()
        got += hits(page)
    assert got == [shown_hit(t) for t in expected]
    if "q" in filters:  # the match is shown, marked
        for mark in page.locator("tr.hit td.preview mark").all_inner_texts():
            assert mark.lower() == filters["q"].lower()


def test_the_search_form_keeps_what_it_was_given_and_a_hit_opens_its_trajectory(ran: Any) -> None:
    page = ran["page"]
    page.goto(ran["base"] + f"search?project={PROJECT}&run=alpha")
    shot(page, "search")
    page.fill('input[name="q"]', "apple")
    page.select_option('select[name="failed"]', "judge")
    page.fill('input[name="to"]', "1")
    with page.expect_navigation():
        page.click("form.search button")
    query = parse_qs(urlsplit(page.url).query)
    assert (query["q"], query["failed"], query["to"]) == (["apple"], ["judge"], ["1"])
    assert page.locator('input[name="q"]').input_value() == "apple"
    assert page.locator('select[name="failed"] option[selected]').get_attribute("value") == "judge"
    assert page.locator('input[name="to"]').input_value() == "1"
    assert [h["key"] for h in hits(page)] == ["t-1-a"]
    with page.expect_navigation():
        page.click('tr.hit[data-rollout="t-1-a"] td.rollout a')
    assert urlsplit(page.url).path == "/trajectory" and parse_qs(urlsplit(page.url).query)["rollout"] == ["t-1-a"]
    assert "apple pie" in page.locator(".dialogue").inner_text()


# -- errors and shared links ---------------------------------------------------------------------

@pytest.mark.parametrize(("path", "status", "message"), (
    (compare_url([f"{PROJECT}/r{i}" for i in range(9)]), 400,
     "run: at most 8 runs can be compared at once (eight colours and dash patterns tell them apart); the URL names 9"),
    (compare_url([key("alpha", 1), f"{PROJECT}/nope", key("beta", 7)]), 404,
     "not in the store: run 'nope' of project 'cmp'; run 'beta' of project 'cmp' attempt 7"),
    (compare_url([key("alpha", 1)], smooth="1"), 400,
     "smooth: expected an EMA weight from 0 to below 1 (0.6 smooths as TensorBoard's default), got '1'"),
    (compare_url(["alpha"]), 400, "run: expected PROJECT/RUN or PROJECT/RUN/ATTEMPT, each part percent-encoded, got 'alpha'"),
    (compare_url([key("alpha", 1)], x="wall"), 400, "x: one of step, time, got 'wall'"),
    ("search?project=cmp&run=nope", 404, "no run 'nope' in project 'cmp'"),
    ("search?project=cmp&run=alpha&min_reward=2&max_reward=1", 400,
     "min_reward (2) is above max_reward (1): nothing could match"),
    ("search?project=cmp&run=alpha&clipped=yes", 400, "clipped: one of (none), 1, 0, got 'yes'"),
    ("search?project=cmp&run=alpha&q=" + "x" * 201, 400, "q: at most 200 characters of text to search for, got 201"),
), ids=("9-runs", "unknown-runs", "smooth-1", "no-project", "bad-x", "search-unknown-run", "rewards-crossed", "clipped-yes",
        "long-q"))
def test_a_bad_url_says_what_is_wrong(ran: Any, path: str, status: int, message: str) -> None:
    page = ran["page"]
    answer = page.goto(ran["base"] + path)
    assert answer.status == status
    assert page.locator("p.error").inner_text() == message


@pytest.mark.parametrize("path", (
    compare_url([key("delta/x", 2), key("alpha", 1), f"{PROJECT}/gamma"], x="time", smooth="0.5", metric=["kl", "entropy"],
                config="all", **{"from": "1"}),
    "search?" + "project=cmp&run=alpha&attempt=1&failed=any&q=apple&min_reward=0.5"))
def test_a_shared_url_opens_the_same_view_in_another_profile(ran: Any, path: str) -> None:
    page = ran["page"]
    page.goto(ran["base"] + path)
    before = page.inner_text("main")
    assert page.locator("svg.chart, tr.hit").count() > 0
    other = ran["browser"].new_context(viewport={"width": 1400, "height": 1000}).new_page()  # no cookie: the token
    try:
        assert other.goto(ran["base"] + path).status == 403
        other.goto(ran["base"] + path + f"&token={TOKEN}")
        assert other.url == ran["base"] + path  # the token leaves the address bar
        assert other.inner_text("main") == before
        assert other.content().count("<circle") == page.content().count("<circle")
    finally:
        other.context.close()
