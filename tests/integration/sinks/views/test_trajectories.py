"""The Trajectories section of ``rlpulse report RUN --html``: known spans in a chDB store, the
real CLI, the page as headless Chromium builds it (``--dump-dom``), checked element by element;
then the same view from the SDK's own spans (the simulator) through the broker and the sink."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from rlpulse.producers.simulators.simulator import SimConfig, simulate
from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.store.clickhouse import migrate, open_store
from tests.conftest import unavailable

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[4]
CHROMIUM = "/usr/bin/chromium"
MS = 1_000_000
HOSTILE = "<script>alert(1)</script>"


# -- the seeded store ---------------------------------------------------------------------------

def _span(t0: int, sid: str, parent: str | None, name: str, kind: str, start_ms: int, end_ms: int, seq: int,
          rollout: str, trace: str, **extra) -> dict:
    row = {"project": "p", "run_id": "runT", "attempt": 1, "stage": "", "writer_id": "w", "trace_id": trace,
           "span_id": sid, "parent_span_id": parent, "name": name, "kind": kind, "start_time_ns": t0 + start_ms * MS,
           "end_time_ns": t0 + end_ms * MS, "status": "OK", "status_message": "", "rollout_id": rollout,
           "sequence_id": seq, "step": 2, "attributes": {}, "sample_id": None}
    row.update(extra)
    return row


def _seed(store_url: str) -> None:
    """Sample p-a at step 2 of runT: r0 (LLM -> TOOL -> LLM chain, two graders), r1 (ERROR, a
    hostile span name, an orphan), r2 (clipped; its sample only in an attribute, a child linked by
    trace only); replayed rows; decoys in another sample, step and run."""
    t0 = time.time_ns() - 3600 * 10**9
    r0 = dict(rollout="r0", trace="aa00")
    rows = [
        _span(t0, "R0", None, "rollout", "ROLLOUT", 0, 5000, 10, **r0, reward=0.75, completion_tokens=300,
              max_tokens=1024, clipped=False, sample_id="p-a"),
        _span(t0, "L1", "R0", "plan", "LLM", 100, 1300, 1, **r0,
              attributes={"gen_ai.request.model": "policy-7b", "gen_ai.usage.input_tokens": "812",
                          "gen_ai.usage.output_tokens": "96"}),
        _span(t0, "T1", "L1", "search", "TOOL", 400, 650, 2, **r0, attributes={"tool.name": "web_search"}),
        _span(t0, "L2", "T1", "summarise", "LLM", 500, 620, 3, **r0),
        _span(t0, "G1", "R0", "grader judge", "GRADER", 3000, 4500, 4, **r0, term="judge", outcome="ok", score=0.9),
        _span(t0, "G2", "R0", "grader format", "GRADER", 3100, 3130, 5, **r0, status="ERROR",
              status_message="timeout", term="format", outcome="timeout", score=0.0),
    ]
    rows.append(dict(rows[0]))  # a replayed copy (same key): FINAL reads one
    rows.append({**rows[1], "sequence_id": 99})  # the same span exported twice: one row per span_id
    r1 = dict(rollout="r1", trace="bb11")
    rows += [
        _span(t0, "R1", None, "rollout", "ROLLOUT", 0, 2000, 20, **r1, status="ERROR", status_message="sandbox crashed",
              reward=0.0, completion_tokens=40, max_tokens=1024, clipped=False, sample_id="p-a"),
        _span(t0, "X1", "R1", HOSTILE, "TOOL", 10, 20, 21, **r1),
        _span(t0, "O1", "ffffffffffffffff", "retry", "LLM", 50, 80, 22, **r1),
    ]
    rows += [
        _span(t0, "R2", None, "rollout", "ROLLOUT", 0, 900, 30, rollout="r2", trace="cc22", reward=0.25,
              completion_tokens=1024, max_tokens=1024, clipped=True, attributes={"rlpulse.sample_id": "p-a"}),
        _span(t0, "C2", "R2", "generate", "LLM", 0, 800, 31, rollout="", trace="cc22", step=None),
    ]
    rows += [  # decoys
        _span(t0, "R3", None, "rollout", "ROLLOUT", 0, 100, 40, rollout="r3", trace="dd33", reward=1.0, sample_id="p-b"),
        _span(t0, "R4", None, "rollout", "ROLLOUT", 0, 100, 41, rollout="r0", trace="ee44", step=1, reward=0.5,
              sample_id="p-a"),
        _span(t0, "K4", "R4", "step-1 call", "LLM", 0, 50, 42, rollout="r0", trace="ee44", step=1),
        {**rows[0], "run_id": "other", "span_id": "Z0"},
        {**rows[1], "run_id": "other", "span_id": "Z1", "parent_span_id": "Z0", "name": "other run's call"},
    ]
    with open_store(store_url, owner="test") as store:
        migrate(store)
        columns = sorted({c for r in rows for c in r})
        store.client.insert(f"{store.database}.spans", [[r.get(c) for c in columns] for r in rows],
                            column_names=columns)


# -- reading the dumped DOM ---------------------------------------------------------------------

VOID = {"meta", "br", "img", "input", "hr", "link", "col", "area", "base", "wbr", "source"}


class Node:
    def __init__(self, tag: str, attrs: dict[str, str | None], parent: Node | None):
        self.tag, self.attrs, self.parent, self.children, self.texts = tag, attrs, parent, [], []

    def text(self) -> str:
        return "".join(t if isinstance(t, str) else t.text() for t in self.texts)

    def walk(self):
        for c in self.children:
            yield c
            yield from c.walk()

    def find(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> list[Node]:
        return [n for n in self.walk() if (tag is None or n.tag == tag)
                and (cls is None or cls in (n.attrs.get("class") or "").split())
                and all(n.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())]

    def span_named(self, name: str) -> Node:
        [hit] = [n for n in self.find(cls="span") if _name(n) == name]
        return hit


def _name(node: Node) -> str:
    """The name shown on a span element's own line (not its descendants')."""
    line = node.children[0] if node.tag == "details" else node
    return next(c.text() for c in line.children if "name" in (c.attrs.get("class") or "").split())


def _field(node: Node, cls: str) -> str:
    line = node.children[0] if node.tag == "details" else node
    return next(c.text() for c in line.children if cls in (c.attrs.get("class") or "").split())


class Dom(HTMLParser):
    def __init__(self, page: str):
        super().__init__(convert_charrefs=True)
        self.root = self.at = Node("#root", {}, None)
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs), self.at)
        self.at.children.append(node)
        self.at.texts.append(node)
        if tag not in VOID:
            self.at = node

    def handle_endtag(self, tag):
        node = self.at
        while node is not self.root and node.tag != tag:
            node = node.parent
        if node is not self.root:
            self.at = node.parent

    def handle_data(self, data):
        self.at.texts.append(data)


def _chromium(out: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", *extra, out.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _report(store_url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RLPULSE_CLICKHOUSE_URL": store_url, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "rlpulse.cli", "report", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def _table(dom: Node) -> list[tuple[str, ...]]:
    return [tuple(td.text() for td in row.find("td")) for row in dom.find("tr", cls="trajectory-row")]


# -- tests ---------------------------------------------------------------------------------------

@pytest.mark.full  # a browser: make test-all
def test_trajectories_of_one_sample_in_headless_chromium(tmp_path: Path) -> None:
    if not Path(CHROMIUM).exists():
        unavailable(f"{CHROMIUM} is missing: apt-get install chromium, or make browser (headless Chromium renders the page)")
    store_url = f"chdb://{tmp_path / 'ch'}"
    _seed(store_url)
    out = tmp_path / "report.html"
    done = _report(store_url, "runT", "--html", str(out))
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    assert not re.search(r"""(src|href)\s*=|<link|<script|url\(|@import""", page, re.I), "the page must load nothing"

    dumped = _chromium(out, tmp_path / "profile-dom", "--dump-dom")
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom = Dom(dumped.stdout).root
    [section] = dom.find("section", id="trajectories")
    assert section.find("p", cls="choice")[0].text() == (
        "Showing step 2 (the latest step with rollouts; choose another with --step N); sample p-a (the first by id "
        "of the step's 2 samples; choose another with --sample ID).")
    assert section.find("p", cls="other-samples")[0].text() == "Other samples of step 2 (rollouts): p-b (1)"
    assert section.find("h3")[0].text() == "Step 2, sample p-a: 3 trajectories"
    # rollout, reward, status, completion tokens, spans (replayed rows and decoys not counted)
    assert _table(section) == [("r0", "0.75", "OK", "300", "6"), ("r1", "0", "ERROR", "40", "3"),
                               ("r2", "0.25", "OK, clipped", "1024", "2")]

    trajectories = {t.attrs["data-rollout"]: t for t in section.find("details", cls="trajectory")}
    assert sorted(trajectories) == ["r0", "r1", "r2"]
    r0 = trajectories["r0"]
    assert r0.children[0].text() == "rollout r0 · reward 0.75 · OK · 300 completion tokens"
    rollout = r0.span_named("rollout")
    assert rollout.parent is r0 and rollout.tag == "details"
    plan, search, summarise = r0.span_named("plan"), r0.span_named("search"), r0.span_named("summarise")
    # the chain nests: the TOOL inside its LLM parent's <details>, the second LLM inside the TOOL's
    assert plan.tag == search.tag == "details" and plan.parent is rollout
    assert search.parent is plan and search.attrs["data-kind"] == "TOOL"
    assert summarise.parent is search and summarise.attrs["class"] == "span leaf"
    # siblings in start-time order: plan (100 ms), grader judge (3000 ms), grader format (3100 ms)
    assert [_name(c) for c in rollout.children[1:]] == ["plan", "grader judge", "grader format"]
    assert {_name(s): _field(s, "dur") for s in r0.find(cls="span")} == {
        "rollout": "5.00 s", "plan": "1.20 s", "search": "250.0 ms", "summarise": "120.0 ms",
        "grader judge": "1.50 s", "grader format": "30.0 ms"}
    assert _field(plan, "keys") == "model policy-7b · tokens 812 in / 96 out"
    assert _field(search, "keys") == "tool web_search"
    judge, fmt = r0.span_named("grader judge"), r0.span_named("grader format")
    assert (_field(judge, "status"), _field(judge, "keys")) == ("OK", "term judge · outcome ok · score 0.9")
    assert (_field(fmt, "status"), _field(fmt, "keys")) == (
        "ERROR", "term format · outcome timeout · score 0 · message timeout")
    assert "step-1 call" not in r0.text() and "other run's call" not in section.text()

    r1 = trajectories["r1"]
    assert r1.children[0].text() == "rollout r1 · reward 0 · ERROR · 40 completion tokens"
    assert _field(r1.span_named("rollout"), "keys") == "reward 0 · completion tokens 40 / 1024 · message sandbox crashed"
    hostile = r1.span_named(HOSTILE)  # shown as text, never run: the page has no <script> element
    assert hostile.parent is r1.span_named("rollout") and not dom.find("script")
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dumped.stdout
    orphan = r1.span_named("retry")  # its parent was never stored: under the rollout's entry, marked, not dropped
    assert orphan.parent is r1.span_named("rollout") and orphan.attrs["data-orphan"] == "true"
    assert _field(orphan, "orphan") == "parent ffffffffffffffff not found"
    assert [p.text() for p in r1.find("p", cls="tree-note")] == [
        "1 span(s) whose parent is missing are shown under the rollout"]

    r2 = trajectories["r2"]
    assert r2.children[0].text() == "rollout r2 · reward 0.25 · OK, clipped · 1024 completion tokens"
    assert r2.span_named("generate").parent is r2.span_named("rollout")  # linked by trace id alone

    artefact = Path(os.environ.get("RLPULSE_TEST_ARTIFACTS", REPO / "test-artifacts")) / "html-report" / "trajectories.png"
    artefact.parent.mkdir(parents=True, exist_ok=True)
    png = tmp_path / "trajectories.png"
    shot = _chromium(out, tmp_path / "profile-shot", f"--screenshot={png}", "--window-size=1200,4200")
    assert shot.returncode == 0 and png.exists() and png.stat().st_size > 20_000, shot.stderr[-2000:]
    shutil.copyfile(png, artefact)

    # --sample alone: the latest step that has it
    done = _report(store_url, "runT", "--html", str(tmp_path / "pb.html"), "--sample", "p-b")
    assert done.returncode == 0, done.stderr
    dom = Dom((tmp_path / "pb.html").read_text()).root
    assert dom.find("p", cls="choice")[0].text() == (
        "Showing step 2 (the latest step with rollouts of this sample; choose another with --step N).")
    assert _table(dom) == [("r3", "1", "OK", "", "1")]
    assert dom.find("p", cls="other-samples")[0].text() == "Other samples of step 2 (rollouts): p-a (3)"

    # --step/--sample choose another group: step 1's r0 is another rollout with another tree
    other = tmp_path / "step1.html"
    done = _report(store_url, "runT", "--html", str(other), "--step", "1", "--sample", "p-a")
    assert done.returncode == 0, done.stderr
    dom = Dom(other.read_text()).root
    assert dom.find("p", cls="choice")[0].text() == "Step 1, sample p-a."
    assert _table(dom) == [("r0", "0.5", "OK", "", "2")]
    assert _name(dom.find("details", cls="trajectory")[0].span_named("step-1 call")) == "step-1 call"


def test_bad_step_or_sample_is_a_clear_error(tmp_path: Path) -> None:
    store_url = f"chdb://{tmp_path / 'ch'}"
    _seed(store_url)
    out = tmp_path / "r.html"
    cases = [
        (("runT", "--html", str(out), "--step", "2", "--sample", "nope"),
         "rlpulse report: step 2 of run runT attempt 1 has no rollouts of sample nope; its samples: p-a, p-b"),
        (("runT", "--html", str(out), "--step", "7"),
         "rlpulse report: run runT attempt 1 has no rollouts at step 7; its 2 steps with rollouts run from 1 to 2"),
        (("runT", "--html", str(out), "--sample", "nope", "--attempt", "1"),
         "rlpulse report: run runT attempt 1 has no rollouts of sample nope at any step"),
        (("runT", "--step", "1"), "rlpulse report: RUN and --html go together: rlpulse report RUN --html out.html"),
        (("--step", "1"), "rlpulse report: --step and --sample choose the trajectories of the HTML page: "
                          "rlpulse report RUN --html out.html --step N --sample ID"),
    ]
    for args, message in cases:
        done = _report(store_url, *args)
        assert (done.returncode, done.stderr.strip().splitlines()[-1]) == (2, message), (args, done.stderr)
    assert not out.exists()  # a refused choice writes no page


def test_no_sample_ids_no_rollouts_and_the_cap(tmp_path: Path) -> None:
    from rlpulse.sinks.views.trajectory_html import render_section

    store_url = f"chdb://{tmp_path / 'ch'}"
    _seed(store_url)
    with open_store(store_url, owner="test") as store:
        t0 = time.time_ns()
        rows = [_span(t0, f"N{i}", None, "rollout", "ROLLOUT", 0, 10, i, rollout=f"n{i}", trace=f"ff{i}", step=0,
                      reward=0.5 * i) for i in range(2)]
        rows += [  # n2: no reward on its ROLLOUT span; its REWARD entry span (seed 000, OpenTelemetry) has it
            _span(t0, "N2", None, "process", "ROLLOUT", 0, 10, 2, rollout="n2", trace="ff2", step=0),
            _span(t0, "W2", None, "score", "REWARD", 10, 20, 3, rollout="n2", trace="ff2", step=None, reward=0.8)]
        rows = [{**r, "run_id": "runN"} for r in rows]
        columns = sorted({c for r in rows for c in r})
        store.client.insert(f"{store.database}.spans", [[r.get(c) for c in columns] for r in rows],
                            column_names=columns)
        dom = Dom(render_section(store, "runN", 1)).root
        assert dom.find("h3")[0].text() == "Step 0, sample no sample id: 3 trajectories"
        assert _table(dom) == [("n0", "0", "OK", "", "1"), ("n1", "0.5", "OK", "", "1"), ("n2", "0.8", "OK", "", "2")]
        assert not dom.find("p", cls="other-samples")
        dom = Dom(render_section(store, "nobody", 1)).root
        assert dom.find("p", cls="choice")[0].text() == "Run nobody, attempt 1 has no rollouts."
        dom = Dom(render_section(store, "runT", 1, cap=3)).root
        r0 = dom.find("details", cls="trajectory", data_rollout="r0")[0]
        assert [_name(s) for s in r0.find(cls="span")] == ["rollout", "plan", "search"]  # tree order
        assert [p.text() for p in r0.find("p", cls="tree-note")] == ["3 more not shown (the first 3 in tree order are)"]


def test_simulated_sdk_trajectories_through_the_sink(settings: Settings) -> None:
    """The SDK path: the simulator's rollouts, graders and LLM/TOOL children, through Kafka and the
    sink; the page written by ``rlpulse report`` while the sink runs (its read endpoint serves it)."""
    ensure_topics(settings)
    config = SimConfig(project="simt", runs=1, steps=2, rollouts_per_step=4, rollouts_per_sample=2)
    out = settings.home / "sim.html"
    with Pipeline(settings) as pipeline:
        pipeline.start(("sink",))
        wait_groups_ready(settings, (settings.sink_group,), pipeline)
        truth = simulate(settings, config)
        pipeline.wait_caught_up(0)
        done = subprocess.run([sys.executable, "-m", "rlpulse.cli", "report", "simt-run1", "--html", str(out)],
                              env={**settings_env(settings), "PYTHONPATH": str(REPO)}, cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        pipeline.stop()
    assert done.returncode == 0, done.stderr
    assert truth.undelivered == 0 and truth.spans == 2 * 4 * (1 + 2 + 3)  # rollout, 2 graders, 3 children
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        rewards = dict(store.client.query(
            f"SELECT rollout_id, reward FROM {store.database}.spans FINAL WHERE run_id = 'simt-run1' "
            "AND kind = 'ROLLOUT' AND sample_id = 'p1-0'").result_rows)
    dom = Dom(out.read_text()).root
    [section] = dom.find("section", id="trajectories")
    assert section.find("h3")[0].text() == "Step 1, sample p1-0: 2 trajectories"
    assert section.find("p", cls="other-samples")[0].text() == "Other samples of step 1 (rollouts): p1-1 (2)"
    assert [(row[0], row[1], row[4]) for row in _table(section)] == [
        (r, f"{rewards[r]:g}", "6") for r in ("s1-r0", "s1-r1")]
    for trajectory in section.find("details", cls="trajectory"):
        [rollout] = [c for c in trajectory.children if "span" in (c.attrs.get("class") or "").split()]
        spans = [(c.attrs["data-kind"], _name(c)) for c in rollout.children[1:]]
        # the agent's calls first, then the graders (which of the two starts first is drawn)
        assert spans[:3] == [("LLM", "turn 1"), ("TOOL", "search"), ("LLM", "turn 2")]
        assert sorted(spans[3:]) == [("GRADER", "grader format"), ("GRADER", "grader judge")]
        assert re.fullmatch(r"model sim-policy · tokens \d+ in / \d+ out", _field(rollout.children[1], "keys"))
        assert not trajectory.find(data_orphan="true")
