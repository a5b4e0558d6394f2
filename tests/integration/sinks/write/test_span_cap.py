"""The sink's caps on content, through the real broker, the sink and chDB.

* Spans with content written straight to the topic in several rounds, each drained by a new
  sink (``RLPULSE_SPAN_CAP=2``, ``RLPULSE_SINK_CONTENT_MAX_CHARS=100``): the first two trajectories
  of each step stay in full, a trajectory's spans are kept or capped together whichever checkpoint
  brings them, the capped ones keep every field but their content, each row counts the characters
  it lost, and a replay of every offset decides each trajectory as before. ``content-dropped`` and
  ``rlpulse retention`` report exactly that.
* The simulator through ``rlpulse streams`` and ``rlpulse sink`` with the cap on: step stats,
  reward histograms and grader failures equal the ground truth (the streams count every event),
  and the dropped counts are exactly the trajectories past the cap.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest
from aiokafka import AIOKafkaProducer

from rlpulse.cli import main as cli_main
from rlpulse.pipeline import Pipeline, rewind, wait_groups_ready
from rlpulse.producers.simulators.simulator import SimConfig, simulate
from rlpulse.schemas.catalogue import SINK_TOPICS
from rlpulse.schemas.codec import Codec
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.store.clickhouse import migrate, open_reader, open_store
from rlpulse.sinks.write.sink import drain
from tests.integration import until

pytestmark = [pytest.mark.integration, pytest.mark.full]  # ~12 s of a bound: make test-all (make test keeps its 6 minutes)
CODEC = Codec()
NOW = time.time_ns()
PROMPT = "m" * 150  # content: over the 100-character cap
NOTE = "é" * 300  # a long value under another name: content too, for a capped span
_seq = iter(range(1, 10_000))


def span(run: str, rollout: str, step: int | None, kind: str, **attributes: object) -> dict:
    seq = next(_seq)
    return dict(project="capped", run_id=run, attempt=1, stage="train", time_ns=NOW + seq, trace_id=bytes(16),
                span_id=seq.to_bytes(8, "big"), parent_span_id=None, name=kind.lower(), kind=kind,
                start_time_ns=NOW, end_time_ns=NOW + seq, status="OK", status_message="", rollout_id=rollout,
                attempt_id="a", sequence_id=seq, writer_id="w", step=step, attributes=attributes, term=None,
                outcome=None, score=None, judge_input_tokens=None, judge_output_tokens=None,
                reward=0.5 if kind == "ROLLOUT" else None, term_shares={}, completion_tokens=None, max_tokens=None,
                clipped=None, sample_id=None)


def llm(run: str, rollout: str, step: int | None) -> dict:
    return span(run, rollout, step, "LLM", **{"gen_ai.input.messages": PROMPT, "gen_ai.request.model": "policy-7b",
                                              "note": NOTE, "gen_ai.usage.output_tokens": 12})


def rollout(run: str, rollout_id: str, step: int, error: str = "") -> dict:
    record = span(run, rollout_id, step, "ROLLOUT", k="v")
    record.update(status="ERROR" if error else "OK", status_message=error)
    return record


ERROR = "E" * 150  # a status message over the cap: cut, and kept on a capped span


# Rounds of messages (run, records), each round drained by a sink of its own.
ROUNDS = [
    [("r1", [llm("r1", "a", 1), llm("r1", "b", 1)])],
    [("r1", [llm("r1", "c", 1), rollout("r1", "a", 1)]),
     ("r1", [rollout("r1", "b", 1), llm("r1", "d", 1), rollout("r1", "c", 1, ERROR), rollout("r1", "d", 1)]),
     ("r1", [llm("r1", "e", 2), llm("r1", "f", 2), llm("r1", "g", 2),
             span("r1", "ckpt", None, "CHECKPOINT", note=NOTE, **{"rlpulse.content.cut_chars": 42})])],
    [("r2", [llm("r2", "a", 1), rollout("r2", "a", 1)])],
]
KEPT = {("r1", 1): {"a", "b"}, ("r1", 2): {"e", "f"}, ("r2", 1): {"a"}}
CAPPED = {("r1", 1): {"c", "d"}, ("r1", 2): {"g"}}


async def publish(settings: Settings, messages: list[tuple[str, list[dict]]]) -> None:
    producer = AIOKafkaProducer(**settings.kafka_client_kwargs())
    await producer.start()
    try:
        for run, records in messages:
            await producer.send_and_wait(settings.topic("spans"), CODEC.encode("Span", records), key=f"capped/{run}".encode())
    finally:
        await producer.stop()


def expected_rows() -> list[tuple]:
    """(run, step, rollout, kind, capped, cut chars, attribute keys) per span, in sequence order."""
    out = []
    for messages in ROUNDS:
        for _, records in messages:
            for r in records:
                capped = r["rollout_id"] in CAPPED.get((r["run_id"], r["step"]), set())
                if r["kind"] == "LLM":
                    cut = 150 + 300 if capped else 50 + 200
                    keys = ["gen_ai.request.model", "gen_ai.usage.output_tokens"] if capped else \
                        ["gen_ai.input.messages", "gen_ai.request.model", "gen_ai.usage.output_tokens", "note"]
                elif r["kind"] == "CHECKPOINT":  # no step: never capped; its long value cut to 100
                    cut, keys = 200, ["note", "rlpulse.content.cut_chars"]
                else:
                    cut, keys = (50 if r["status_message"] else 0), ["k"]
                out.append((r["run_id"], r["step"], r["rollout_id"], r["kind"], int(capped), cut, keys))
    return out


def stored_rows(settings: Settings) -> list[tuple]:
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        rows = store.client.query(f"SELECT run_id, step, rollout_id, kind, content_capped, content_cut_chars, "
                                  f"mapKeys(attributes), attributes, reward FROM {store.database}.spans FINAL "
                                  "ORDER BY sequence_id").result_rows
        messages = store.client.query(f"SELECT status_message FROM {store.database}.spans FINAL "
                                      "WHERE status = 'ERROR'").result_rows
    assert messages == [(ERROR[:100] + "…[rlpulse sink: 50 characters cut]",)]
    for *_, attributes, _reward in rows:  # what a kept value looks like; every field but content stays
        for key, value in attributes.items():
            if key in ("gen_ai.input.messages", "note"):
                assert value in (PROMPT[:100] + "…[rlpulse sink: 50 characters cut]",
                                 NOTE[:100] + "…[rlpulse sink: 200 characters cut]"), (key, value)
    assert sum(r[-1] == 0.5 for r in rows) == 5  # every ROLLOUT row kept its reward, capped or not
    return [tuple(r[:7]) for r in rows]


def test_the_first_trajectories_of_each_step_stay_whole_and_the_rest_lose_their_content_only(
        settings: Settings, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    capped = dataclasses.replace(settings, span_cap=2, sink_content_max_chars=100)
    ensure_topics(capped)
    with open_store(capped.clickhouse_dsn, owner="test") as store:
        migrate(store)
    for messages in ROUNDS:  # a new sink each round: what it decides before comes from the table
        asyncio.run(publish(capped, messages))
        with open_store(capped.clickhouse_dsn, owner="test") as store:
            asyncio.run(drain(capped, store, timeout=120))
    expected = expected_rows()
    assert stored_rows(capped) == expected
    # Every offset again, in one checkpoint: each trajectory decided as before.
    rewind(capped, capped.sink_group, SINK_TOPICS)
    with open_store(capped.clickhouse_dsn, owner="test") as store:
        stats, _ = asyncio.run(drain(capped, store, timeout=120))
    assert stats.rows["spans"] == len(expected)
    assert stored_rows(capped) == expected

    for name, value in capped.env().items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert cli_main(["query", "--saved", "content-dropped", "--param", "run_id=r1", "--format", "json"]) == 0
    per_step = [(r["step"], r["trajectories"], r["trajectories_capped"], r["spans"], r["spans_capped"],
                 r["sink_cut_chars"], r["sdk_cut_chars"]) for r in json.loads(capsys.readouterr().out)]
    assert per_step == [(1, 4, 2, 8, 4, 2 * 250 + 2 * 450 + 50, 0),
                        (2, 3, 1, 3, 1, 2 * 250 + 450, 0),
                        (None, 1, 0, 1, 0, 200, 42)]  # no step: never capped, its long value cut
    assert cli_main(["retention", "--project", "capped"]) == 0
    shown = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(shown) if line.startswith("project "))
    # runs with something dropped, trajectories and spans capped, characters cut by the sink and the SDK
    assert shown[header + 2].split() == ["capped", "2", "3", "5", str(200 + 1450 + 950 + 250), "42"]


@pytest.mark.full  # streams and sink over the simulator (~20 s): make test-all, keeping make test within 6 minutes
def test_figures_stay_exact_under_the_cap_and_the_dropped_counts_are_the_trajectories_past_it(settings: Settings) -> None:
    cap, config = 3, SimConfig(project="capsim", runs=2, steps=3, rollouts_per_step=8, seed=11)
    settings = dataclasses.replace(settings, span_cap=cap)
    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        truth = simulate(settings, config)
        runs, steps = config.runs, config.steps
        pipeline.wait_caught_up(until=until.counts(settings, {
            "spans": truth.spans, "step_stats": runs * steps, "reward_histograms": runs * steps * (1 + len(config.terms))}))
        pipeline.stop()
    with open_reader(settings.clickhouse_dsn, owner="test") as store:
        db = store.database
        stats = {(r, s): (n, c) for r, s, n, c in store.client.query(
            f"SELECT run_id, step, rollouts, clipped FROM {db}.step_stats FINAL").result_rows}
        totals = {(r, s): n for r, s, n in store.client.query(
            f"SELECT run_id, step, count FROM {db}.reward_histograms FINAL WHERE term = 'total'").result_rows}
        failures = dict(((r, t, c), n) for r, t, c, n in store.client.query(
            f"SELECT run_id, term, cause, sum(failures) FROM {db}.grader_failures FINAL GROUP BY run_id, term, cause "
            "HAVING sum(failures) > 0").result_rows)
        dropped = store.client.query(
            f"SELECT run_id, step, uniqExactIf(rollout_id, content_capped = 1), countIf(content_capped = 1), "
            f"groupArrayDistinctIf(rollout_id, content_capped = 0) FROM {db}.spans FINAL WHERE step IS NOT NULL "
            "GROUP BY run_id, step ORDER BY run_id, step").result_rows
    per_rollout = 1 + len(config.terms) + 3  # its ROLLOUT span, a GRADER per term, LLM, TOOL, LLM under it
    assert truth.spans == runs * steps * config.rollouts_per_step * per_rollout
    run_ids = [f"capsim-run{r + 1}" for r in range(runs)]
    assert stats == {(r, s): (config.rollouts_per_step, truth.clipped[(r, s)]) for r in run_ids for s in range(steps)}
    assert totals == {(r, s): config.rollouts_per_step for r in run_ids for s in range(steps)}
    assert failures == {(r, t, c): n for (r, t, c), n in truth.failures.items()}
    past = config.rollouts_per_step - cap
    # The first three trajectories of each step (the job published them first) are the ones kept whole.
    assert [(r, s, n, spans, sorted(kept)) for r, s, n, spans, kept in dropped] == [
        (r, s, past, past * per_rollout, [f"s{s}-r{i}" for i in range(cap)]) for r in run_ids for s in range(steps)]
