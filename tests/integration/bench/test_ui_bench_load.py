"""bench/ui_bench.py on small runs in a real chDB store: what the loader writes is what the compare and search pages
read (a configuration of 30 settings of which 3 differ, per-term step figures, rollout metrics, dialogues holding
the searched word), and a page that does not answer 200 is recorded as failed while the others are timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.ui_bench import RUN, all_pages, ui_figures
from bench.ui_load import CONTENT_ROLLOUTS, PROJECT, QUERY_WORD, load, run_id
from rlpulse.base.settings import Settings
from rlpulse.sinks.store.clickhouse import migrate, open_store
from rlpulse.sinks.views import ui_data

pytestmark = [pytest.mark.integration, pytest.mark.full]

STEPS, ROLLOUTS = 6, 16


def scalar(store: object, sql: str) -> object:
    return store.client.query(sql).result_rows[0][0]  # type: ignore[attr-defined]


def test_the_loaded_runs_hold_what_the_new_pages_read(tmp_path: Path) -> None:
    with open_store(f"chdb://{tmp_path / 'store'}", owner="test") as store:
        migrate(store)
        assert load(store, STEPS, ROLLOUTS, run_id(0), 0) == STEPS * ROLLOUTS * 3 + STEPS * CONTENT_ROLLOUTS * 3
        assert load(store, STEPS, ROLLOUTS, run_id(1), 1, spans=False) == 0
        configs = [{r["key"]: r["value"] for r in ui_data.saved(store, "run-config", run_id=run_id(i))} for i in (0, 1)]
        assert [len(c) for c in configs] == [30, 30]
        assert {k for k in configs[0] if configs[0][k] != configs[1][k]} == {"optimizer.learning_rate", "seed",
                                                                             "rollout.temperature"}
        terms = store.client.query(
            "SELECT run_id, term, count(), countIf(judge_input_tokens > 0) FROM rlpulse.step_term_stats "
            "GROUP BY run_id, term ORDER BY run_id, term").result_rows
        assert terms == [(run_id(0), "format", STEPS, 0), (run_id(0), "judge", STEPS, STEPS),
                         (run_id(1), "format", STEPS, 0), (run_id(1), "judge", STEPS, STEPS)]
        # the runs differ: run 1's reward mean and loss above run 0's at every step
        above = store.client.query(
            "SELECT countIf(b.reward_mean > a.reward_mean) FROM rlpulse.step_stats a JOIN rlpulse.step_stats b "
            f"ON a.step = b.step WHERE a.run_id = '{run_id(0)}' AND b.run_id = '{run_id(1)}'").result_rows[0][0]
        assert above == STEPS
        assert scalar(store, f"SELECT count() FROM rlpulse.spans WHERE run_id = '{run_id(1)}'") == 0
        assert scalar(store, "SELECT groupUniqArray(arraySort(mapKeys(metrics))) FROM rlpulse.spans "
                             "WHERE kind = 'ROLLOUT'") == [["accuracy", "tool_calls", "turns"]]
        asked = store.client.query(
            "SELECT rollout_id, name, attributes['gen_ai.input.messages'], attributes['gen_ai.output.messages'] "
            "FROM rlpulse.spans WHERE kind = 'LLM' ORDER BY rollout_id, name").result_rows
        assert len(asked) == STEPS * CONTENT_ROLLOUTS * 2
        for _, _, sent, said in asked:  # valid JSON chat messages, as the trajectory page parses them
            assert [m["role"] for m in json.loads(sent)] == ["system", "user"]
            assert [m["role"] for m in json.loads(said)] == ["assistant"]
        with_word = [r for r, _, sent, _ in asked if QUERY_WORD in sent]
        assert 0 < len(with_word) < STEPS * CONTENT_ROLLOUTS * 2  # some dialogues to find, not all


def test_a_page_that_does_not_answer_200_is_failed_and_the_others_timed(tmp_path: Path) -> None:
    figures = ui_figures(Settings(home=tmp_path), STEPS, ROLLOUTS, repeat=2, runs=2, span_runs=1)
    assert (figures["ui_runs"], figures["ui_span_runs"], figures["ui_spans"]) == (2, 1, STEPS * ROLLOUTS * 3 + STEPS * 24)
    assert "spans of 1 run(s) of 2" in figures["ui_note"]
    names = list(all_pages(STEPS, 2))
    assert [n for n in names if f"ui_{n}_status" not in figures] == []
    failed = {n for n in names if figures[f"ui_{n}_status"] != 200}
    assert set(figures["ui_failed_pages"]) == failed
    for name in names:
        assert figures[f"ui_{name}_bytes"] > 0
        timed = figures[f"ui_{name}_s_max"]
        assert (timed is None) == (name in failed), name
    # the first run's pages were built before this bench: they answer
    assert not failed & {"runs", "run", "run_metrics", "step", "step_filtered", "trajectory"}
    assert figures["ui_within_target"] is (not failed and all(figures[f"ui_{n}_s_max"] <= 1.0 for n in names))
    assert not list(tmp_path.glob("ui-bench-*"))  # the store is removed
    assert RUN == run_id(0) and PROJECT == "bench"
