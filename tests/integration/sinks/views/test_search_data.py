"""The run-wide search of ``rlpulse ui`` (``search_data.search``) on a real ClickHouse engine (chDB): a
trajectory is one hit however many ROLLOUT spans its key has (a retried rollout, a span sent again under a
new sequence id, a replayed copy), with the figures of the latest one, as the step page shows it."""

from __future__ import annotations

import json
import time

import pytest

from rlpulse.sinks.store.clickhouse import migrate, open_reader, open_store
from rlpulse.sinks.views.search_data import Search, search

pytestmark = [pytest.mark.integration, pytest.mark.full]

NS = 1_000_000_000
T0 = time.time_ns() - 3600 * NS  # recent: the raw tables' TTL drops older rows


def _rollout(seq: int, rollout_id: str, reward: float, step: int = 0, **fields: object) -> dict[str, object]:
    return {"project": "p", "run_id": "r", "attempt": 1, "stage": "train", "trace_id": f"t{seq}", "span_id": f"s{seq}",
            "name": "rollout", "kind": "ROLLOUT", "start_time_ns": T0 + seq * NS, "end_time_ns": T0 + seq * NS + NS // 2,
            "status": "OK", "rollout_id": rollout_id, "sequence_id": seq, "step": step, "reward": reward, **fields}


def test_a_trajectory_sent_twice_is_one_hit_with_its_latest_figures(tmp_path) -> None:
    url = f"chdb://{tmp_path / 'store'}"
    rows = [_rollout(1, "a", 0.2), _rollout(2, "b", 0.9, step=1), _rollout(3, "a", 0.7)]  # "a" retried: 0.7 stands
    with open_store(url, owner="test") as store:
        migrate(store)
        columns = list(rows[0])
        for part in (rows, rows[:1]):  # and a replayed copy of the first, in another part until a merge
            store.client.insert("rlpulse.spans", [[r[c] for c in columns] for r in part], column_names=columns)
    with open_reader(url, owner="test") as store:
        found = search(store, Search("p", "r", 1))
        assert (found.total, [(h.key, h.step, h.reward) for h in found.hits]) == (2, [("a", 0, 0.7), ("b", 1, 0.9)])
        # a filter reads the figures of the trajectory as shown: "a" is at 0.7, not at its first try's 0.2
        assert [h.key for h in search(store, Search("p", "r", 1, max_reward=0.5)).hits] == []
        assert [h.key for h in search(store, Search("p", "r", 1, min_reward=0.6, max_reward=0.8)).hits] == ["a"]
        # a page past the last (a URL kept from before) shows the last one; nothing matching is page 1 of 1
        late = search(store, Search("p", "r", 1, page=9))
        assert (late.total, late.page, late.pages, [h.key for h in late.hits]) == (2, 1, 1, ["a", "b"])
        none = search(store, Search("p", "r", 1, min_reward=2.0, page=3))
        assert (none.total, none.page, none.pages, none.hits) == (0, 1, 1, [])


def test_text_is_found_in_what_was_said_never_in_the_json_around_it(tmp_path) -> None:
    url = f"chdb://{tmp_path / 'store'}"
    said = {"a": ([{"role": "user", "content": 'Say "hi"\nthen stop'}], [{"role": "assistant", "content": "Café"}]),
            "b": ([{"role": "user", "content": [{"type": "text", "text": "a Heliotrope field"}]}],
                  [{"role": "assistant", "content": "ok"}])}
    rows = [_rollout(1, "a", 0.5), _rollout(2, "b", 0.5)]
    for seq, (rid, (sent, reply)) in enumerate(said.items(), start=10):
        rows.append({**_rollout(seq, rid, 0.0), "kind": "LLM", "name": "chat", "reward": None,
                     "attributes": {"gen_ai.input.messages": json.dumps(sent), "gen_ai.output.messages": json.dumps(reply)}})
    with open_store(url, owner="test") as store:
        migrate(store)
        columns = sorted({c for r in rows for c in r})
        store.client.insert("rlpulse.spans", [[r.get(c, {} if c == "attributes" else None) for c in columns] for r in rows],
                            column_names=columns)
    with open_reader(url, owner="test") as store:
        def keys(q: str) -> list[str]:
            return [h.key for h in search(store, Search("p", "r", 1, q=q)).hits]

        assert keys("role") == [] and keys("content") == [] and keys("assistant") == []  # the JSON's own words
        assert keys('"hi"\nthen') == ["a"] and keys("café") == ["a"] and keys("heliotrope") == ["b"]
        assert search(store, Search("p", "r", 1, q="HELIOTROPE")).hits[0].preview == "a Heliotrope field\nok"


def test_a_run_with_spans_and_no_step_events_is_searched_at_its_latest_attempt(tmp_path) -> None:
    from rlpulse.sinks.views.ui_search import search_page

    url = f"chdb://{tmp_path / 'store'}"
    rows = [_rollout(1, "a", 0.5), {**_rollout(2, "b", 0.25), "attempt": 2}]
    with open_store(url, owner="test") as store:
        migrate(store)
        columns = list(rows[0])
        store.client.insert("rlpulse.spans", [[r[c] for c in columns] for r in rows], column_names=columns)
    with open_reader(url, owner="test") as store:
        title, crumbs, body = search_page(store, {"project": ["p"], "run": ["r"]})
        assert crumbs[1][0] == "p/r/2" and 'data-total="1"' in body and ">b<" in body
