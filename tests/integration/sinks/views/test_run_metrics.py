"""The saved query rollout-metrics on a real ClickHouse engine (chDB), without a browser: seed 000's
rollout_metrics / reward_metrics per step, kind and name, a span stored twice counted once, and the run
page drawing exactly its rows (the browser test, test_ui.py, checks the same through the whole pipeline)."""

from __future__ import annotations

import re
import statistics
import time
import urllib.request

import pytest

from rlpulse.sinks.store.clickhouse import migrate, open_reader, open_store
from rlpulse.sinks.views.run_metrics_data import entry_metrics
from rlpulse.sinks.views.ui_data import saved
from rlpulse.sinks.views.ui_server import UiServer

pytestmark = [pytest.mark.integration, pytest.mark.full]

NS = 1_000_000_000
T0 = time.time_ns() - 3600 * NS  # recent: the raw tables' TTL drops older rows
# (step, rollout, turns, exact): two rollouts at step 0, three at step 1
ROLLOUTS = [(0, "a", 2.0, 1.0), (0, "b", 4.0, 0.0), (1, "c", 1.0, 1.0), (1, "d", 3.0, 1.0), (1, "e", 8.0, 0.0)]


def _span(seq: int, **fields: object) -> dict[str, object]:
    base: dict[str, object] = {"project": "p", "run_id": "r", "attempt": 1, "stage": "train", "trace_id": f"t{seq}",
                               "span_id": f"s{seq}", "name": "entry", "kind": "ROLLOUT", "start_time_ns": T0 + seq * NS,
                               "end_time_ns": T0 + seq * NS + NS // 2, "status": "OK", "rollout_id": f"r{seq}",
                               "sequence_id": seq, "step": 0, "metrics": {}}
    return {**base, **fields}


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"chdb://{tmp_path_factory.mktemp('metrics') / 'store'}"
    rows = []
    for i, (step, rid, turns, exact) in enumerate(ROLLOUTS):
        rows.append(_span(2 * i + 1, step=step, rollout_id=rid, metrics={"turns": turns}))
        rows.append(_span(2 * i + 2, step=step, rollout_id=rid, kind="REWARD", name="reward", metrics={"exact": exact}))
    rows.append(rows[0])  # a replayed copy of rollout a's entry: one event
    rows.append(_span(50, kind="LLM", metrics={"turns": 100.0}))  # not an entry span
    rows.append(_span(51, project="other", metrics={"turns": 100.0}))  # another project's run of the same id
    rows.append(_span(52, attempt=2, metrics={"turns": 100.0}))  # another attempt
    rows.append(_span(53, step=None, metrics={"turns": 100.0}))  # no step
    rows.append(_span(54, step=1, metrics={}))  # an entry without metrics counts in none
    with open_store(url, owner="test") as store:
        migrate(store)
        columns = list(rows[0])
        # two inserts, so the copy sits in another part until a merge (FINAL is what removes it)
        for part in (rows[:-6], rows[-6:]):
            store.client.insert("rlpulse.spans", [[r[c] for c in columns] for r in part], column_names=columns)
        store.client.insert("rlpulse.steps", [["p", "r", 1, "train", T0 + s * NS, "STEP", "rl", s, s + 1, "w", s + 1]
                                              for s in (0, 1)],
                            column_names=["project", "run_id", "attempt", "stage", "time_ns", "type", "trainer", "step",
                                          "step_count", "writer_id", "sequence_id"])
    return url


def _truth() -> list[dict[str, object]]:
    out = []
    for step in (0, 1):
        for kind, name, col in (("REWARD", "exact", 3), ("ROLLOUT", "turns", 2)):
            values = [r[col] for r in ROLLOUTS if r[0] == step]
            out.append({"project": "p", "attempt": 1, "step": step, "kind": kind, "name": name, "rollouts": len(values),
                        "mean": statistics.fmean(values), "std": statistics.pstdev(values), "min": min(values),
                        "max": max(values)})
    return out


def test_the_saved_query_gives_mean_spread_min_max_per_step_kind_and_name(store_url: str) -> None:
    with open_store(store_url, owner="test") as store:
        rows = [r for r in saved(store, "rollout-metrics", run_id="r") if (r["project"], r["attempt"]) == ("p", 1)]
        others = [r for r in saved(store, "rollout-metrics", run_id="r") if (r["project"], r["attempt"]) != ("p", 1)]
        mine = entry_metrics(store, "p", "r", 1)
    assert len(rows) == 4
    for got, want in zip(rows, _truth()):
        assert {k: got[k] for k in ("project", "attempt", "step", "kind", "name", "rollouts", "min", "max")} == {
            k: want[k] for k in ("project", "attempt", "step", "kind", "name", "rollouts", "min", "max")}
        assert got["mean"] == pytest.approx(want["mean"]) and got["std"] == pytest.approx(want["std"])
    assert {(r["project"], r["attempt"]) for r in others} == {("other", 1), ("p", 2)}  # the page leaves them out
    assert [(m.step, m.kind, m.name, m.rollouts, m.mean, m.std, m.min, m.max) for m in mine] == [
        (r["step"], r["kind"], r["name"], r["rollouts"], r["mean"], r["std"], r["min"], r["max"]) for r in rows]


def test_the_run_page_draws_each_metric_from_the_query_rows(store_url: str) -> None:
    with open_store(store_url, owner="test") as store:
        rows = [r for r in saved(store, "rollout-metrics", run_id="r") if (r["project"], r["attempt"]) == ("p", 1)]
    with UiServer(lambda: open_reader(store_url, owner="test"), store_url) as server:
        request = urllib.request.Request(server.url.rstrip("/") + "/run?project=p&run=r&attempt=1",
                                         headers={"Authorization": f"token {server.token}"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            page = answer.read().decode()
    for kind, name in (("ROLLOUT", "turns"), ("REWARD", "exact")):
        svg = re.search(rf'<svg class="chart" data-chart="{kind.lower()}-metric-{name}".*?</svg>', page, re.S).group(0)
        dots = re.findall(r'<circle class="point" data-series="(\w+)" data-x="(\d+)" data-value="([^"]+)"', svg)
        assert sorted((s, int(x), float(v)) for s, x, v in dots) == sorted(
            (q, r["step"], float(r[q])) for r in rows if (r["kind"], r["name"]) == (kind, name) for q in ("mean", "min", "max"))
    assert 'class="chart empty"' not in page and "no-data" not in page
    assert re.search(r'<p class="muted not-drawn" data-charts="[^"]*GPU utilisation', page)
