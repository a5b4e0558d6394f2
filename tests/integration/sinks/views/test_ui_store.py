"""``rlpulse ui``'s reads on a real ClickHouse engine, without a browser (the fast tier; the browser test
is tests/integration/sinks/views/test_ui.py): a run written by bench/ui_bench.py's loader into a chDB store, every
page answered over HTTP, and the two saved queries the run page reads its own way giving the same rows."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from bench.ui_bench import PER_SAMPLE, PROJECT, RUN, load, pages, settle
from rlpulse.sinks.views import ui_data
from rlpulse.sinks.store.clickhouse import migrate, open_reader, open_store
from rlpulse.sinks.views.trajectories import SAMPLE_SQL
from rlpulse.sinks.views.ui_server import UiServer

pytestmark = pytest.mark.integration

STEPS, ROLLOUTS = 12, 32


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"chdb://{tmp_path_factory.mktemp('ui') / 'store'}"
    with open_store(url, owner="test") as store:
        migrate(store)
        load(store, STEPS, ROLLOUTS)
        settle(store)
    return url


def fetch(server: UiServer, path: str) -> tuple[int, str]:
    request = urllib.request.Request(server.url.rstrip("/") + path, headers={"Authorization": f"token {server.token}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_every_page_answers(store_url: str) -> None:
    with UiServer(lambda: open_reader(store_url, owner="test"), store_url) as server:
        for name, path in pages(STEPS).items():
            status, body = fetch(server, path)
            assert status == 200, (name, body[:300])
        _, step = fetch(server, pages(STEPS)["step"])
        assert step.count('<section class="group"') == ROLLOUTS // PER_SAMPLE
        assert step.count('<a class="card') == ROLLOUTS
        run = f"/run?project={PROJECT}&run={RUN}&attempt=1"
        _, chosen = fetch(server, run + "&metric=kl&metric=no-such-metric")
        assert 'data-series="kl" data-points="12"' in chosen and "no-such-metric" not in chosen.split("<h2>Per step")[1]
        _, default = fetch(server, run)  # none chosen: the first three by name, each a chart
        assert [n for n in ("grad_norm", "kl", "loss") if f'data-series="{n}" data-points="12"' in default] == [
            "grad_norm", "kl", "loss"]
        assert fetch(server, f"/step?project={PROJECT}&run={RUN}&attempt=1&step={STEPS + 5}")[0] == 404
        assert fetch(server, f"/trajectory?project={PROJECT}&run={RUN}&attempt=1&rollout=nope")[0] == 404


def test_the_run_page_reads_what_the_saved_queries_give(store_url: str) -> None:
    with open_store(store_url, owner="test") as store:
        rows = [{k: r[k] for k in ("step", "term", "cause", "failures", "graded")}
                for r in ui_data.saved(store, "failures-by-step", run_id=RUN)]
        assert rows and ui_data.failures_by_step(store, PROJECT, RUN, 1) == rows
        [status] = ui_data.saved(store, "run-status")
        assert ui_data.run_status(store, PROJECT, RUN, 1) == status
        assert ui_data.run_status(store, PROJECT, "another", 1) is None


def test_the_step_page_groups_each_sample_with_its_rollouts(store_url: str) -> None:
    with open_store(store_url, owner="test") as store:
        rollouts = ui_data.step_rollouts(store, PROJECT, RUN, 1, 3)
        groups = ui_data.groups(rollouts)
        truth = store.client.query(
            f"SELECT {SAMPLE_SQL} AS s, count(), "
            "groupArray(reward) FROM rlpulse.spans WHERE run_id = {r:String} AND step = 3 AND kind = 'ROLLOUT' "
            "GROUP BY s ORDER BY s", parameters={"r": RUN}).result_rows
    assert [(g.sample, len(g.rollouts)) for g in groups] == [(s, n) for s, n, _ in truth]
    for g, (_, _, rewards) in zip(groups, truth):
        assert sorted(r.reward for r in g.rollouts) == sorted(rewards)
        assert all(len(r.graders) == 2 for r in g.rollouts)
