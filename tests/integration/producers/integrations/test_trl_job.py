"""A real TRL ``GRPOTrainer`` job, instrumented in two lines, through the whole pipeline: per step,
ClickHouse equals what TRL logged (``trainer.state.log_history``) and what the job recorded.

The job (``tests/trainers/trl_grpo_job.py``) runs on CPU in its own venv holding only the SDK and
TRL's stack (``.venv-trl``, built by ``tests/trainers/trainer_venv.py`` when missing or stale: about
100 s and 6 GB the first time); ``rlpulse streams`` and ``rlpulse sink`` run from ours. Under
``CI=true`` a venv that cannot be built fails the test; elsewhere it skips, saying why.

Steps follow ``rlpulse.producers.integrations.trl``: a batch generated at ``global_step == k`` is
step ``k + 1`` with policy version ``k + 1``. TRL logs a batch's figures at that step
(TRL 1.16's module ``trl.trainer.grpo_trainer``), and the test computes the same from the rows:

* ``completions/clipped_ratio``: ``mean(ids[-1] not in eos_and_pad)`` over the batch's
  completions -> ``countIf(clipped) / count()`` of its ROLLOUT spans, and ``step_stats.clipped_ratio``.
* ``completions/mean_length`` (``min_length``, ``max_length``): over ``len(completion_ids)`` ->
  ``avg(completion_tokens)`` and ``step_stats.completion_mean`` (min, max).
* ``reward``: ``nanmean(rewards)`` where ``rewards = nansum(rewards_per_func * reward_weights)``
  with the rows every function failed set to NaN -> ``avg(reward)`` over the ROLLOUT spans with
  at least one ``ok`` GRADER span (a failed term is in ``term_shares`` at 0.0, as seed 001 counts
  it, so the terms do not tell; a rollout whose every grader failed is unscorable).
* ``reward_std``: TRL's ``nanstd``, the sample standard deviation (Bessel's correction, n - 1) over
  the same rows -> ``stddevSamp(reward)`` over them; ``step_stats.reward_std`` is the population
  one over every rollout, a different figure, so it is not compared.
* ``rewards/<func>/mean`` and ``/std``: ``nanmean`` and ``nanstd`` of the function's raw values ->
  ``avg(score)`` and ``stddevSamp(score)`` of its ``ok`` GRADER spans.
* Failures by cause: the job counts its own, per function and cause -> GRADER spans by outcome.
* Every number TRL logged (``log_history``, less ``step``): one ``step_metrics`` row each, exact.

TRL computes the batch figures in float32 tensors (``rewards_per_func`` is float32; means are
``.float().mean()``) and logs them as Python floats; rlpulse keeps the reward functions' float64
values. Those figures are compared within 1e-6 relative, far above float32 rounding (6e-8 per
operation) and far below any real difference (a single rollout of 64 moves a mean by 1e-2).
Counts and the scalars rlpulse stores as TRL logged them are compared exactly.

The run's settings are the job's ``GRPOConfig`` (its ``to_dict()``): the saved query ``run-config`` has
one row per name it holds (nested ones dotted), the values the job set, and its ``hub_token`` as ``***``.

The job turns content on (``instrument(..., content=True, token_ids=True)``) and writes what TRL gave its
reward functions. Each rollout's LLM span (``trl.generate``, child of its ROLLOUT span) carries exactly
that prompt and completion, the completion's ids and the prompt's (as TRL tokenizes it);
``rlpulse export messages`` gives one row per rollout, ``[user prompt, assistant completion]``, and
``export triplets`` the ids, checked against the usage counts; and in a real browser (``rlpulse ui``,
Debian's chromium) every card of each step page previews that prompt and completion, and each card of
the first step opens a trajectory whose dialogue is that prompt and that completion.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.schemas.enums import FAILURE_CAUSES
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.read.queries import run_query, saved_sql
from rlpulse.sinks.store.clickhouse import open_reader
from tests.conftest import unavailable
from tests.integration import until
from rlpulse.sinks.views.ui_data import PREVIEW
from tests.integration.sinks.views.browser import CHROMIUM, playwright_or_unavailable, ui_server
from tests.trainers import trainer_venv

pytestmark = [pytest.mark.integration, pytest.mark.full]

JOB = Path(__file__).resolve().parents[3] / "trainers" / "trl_grpo_job.py"
REPO = Path(__file__).resolve().parents[4]
PROJECT, RUN = "trl-itest", "grpo-1"
REL = 1e-6  # float32 figures of TRL against float64 rows (see the module docstring)


@pytest.fixture(scope="module")
def trainer_python() -> Path:
    try:
        return trainer_venv.ensure(log=lambda line: print(f"trainer venv: {line}"))
    except (trainer_venv.VenvError, OSError) as exc:
        unavailable(f"the trainer venv {trainer_venv.VENV} could not be built "
                    f"(`python tests/trainers/trainer_venv.py` builds it): {exc}")


def close(got: float | None, want: float | None) -> bool:
    if want is None or got is None:
        return want is None and (got is None or math.isnan(got))  # TRL logs None where it has no valid value
    return math.isclose(got, want, rel_tol=REL, abs_tol=1e-12)


def run_job(settings: Settings, python: Path, workdir: Path, artifacts: Path) -> dict[str, Any]:
    out = workdir / "job.json"
    env = {k: val for k, val in settings_env(settings).items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # from its own folder, as a user runs it: nothing of this checkout is on its path but the installed SDK
    done = subprocess.run([str(python), str(JOB), str(out), "--project", PROJECT, "--run-id", RUN], cwd=workdir, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    (artifacts / "job.log").write_text(done.stdout)
    assert done.returncode == 0, f"the TRL job failed ({done.returncode}):\n{done.stdout[-6000:]}"
    (artifacts / "job.json").write_text(out.read_text())
    return json.loads(out.read_text())


RUN_SQL = f"project = '{PROJECT}' AND run_id = '{RUN}'"


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@pytest.fixture(scope="module")
def ran(module_settings: Settings, trainer_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The job through the whole pipeline, once for the module; the pipeline stopped, its store left to read."""
    settings = module_settings
    artifacts = Path(os.environ.get("RLPULSE_TEST_ARTIFACTS", REPO / "test-artifacts")) / "test_trl_job"
    artifacts.mkdir(parents=True, exist_ok=True)
    ensure_topics(settings)
    run = RUN_SQL
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        job = run_job(settings, trainer_python, tmp_path_factory.mktemp("trl-job"), artifacts)
        generations = {int(k) + 1: g for k, g in job["generations"].items()}  # step = global_step at generation + 1
        rollouts = sum(g["rollouts"] for g in generations.values())
        pipeline.wait_caught_up(timeout=300, until=until.counts(settings, {
            f"SELECT count() FROM $db.spans FINAL WHERE {run} AND kind = 'ROLLOUT'": rollouts,
            f"SELECT count() FROM $db.spans FINAL WHERE {run} AND kind = 'GRADER'": 2 * rollouts,
            f"SELECT count() FROM $db.spans FINAL WHERE {run} AND kind = 'LLM'": rollouts,
            f"SELECT count() FROM $db.steps FINAL WHERE {run} AND type = 'RUN_END'": 1,
            f"SELECT sum(rollouts) FROM $db.step_stats FINAL WHERE {run}": rollouts}))
        pipeline.stop()
    # what TRL gave its reward functions, per rollout id (step = global_step + 1; one process: index i in the batch)
    texts = {f"s{int(k) + 1}-{i}": {"step": int(k) + 1, "prompt": t["prompts"][i], "completion": t["completions"][i],
                                    "completion_ids": t["completion_ids"][i], "prompt_ids": t["prompt_ids"][i]}
             for k, t in job["texts"].items() for i in range(len(t["prompts"]))}
    assert len(texts) == rollouts
    return {"settings": settings, "job": job, "generations": generations, "rollouts": rollouts, "texts": texts,
            "artifacts": artifacts}


def rows_of(settings: Settings, sql: str) -> list[tuple]:
    got = until.query(settings, sql)
    assert got is not None, f"the store could not be read for {sql}"
    return got


@pytest.mark.timeout(1800)  # the first build of the trainer venv downloads about 3 GB
def test_a_trl_grpo_job_in_clickhouse_equals_what_trl_logged(ran: dict[str, Any]) -> None:
    settings, job, generations, run = ran["settings"], ran["job"], ran["generations"], RUN_SQL

    def rows(sql: str) -> list[tuple]:
        return rows_of(settings, sql)

    logged: dict[int, dict[str, Any]] = {}  # step -> what TRL logged at it (a later log of a step overrides)
    for entry in job["log_history"]:
        logged.setdefault(entry["step"], {}).update({k: val for k, val in entry.items() if k != "step"})
    batch_steps = sorted(s for s, e in logged.items() if "completions/clipped_ratio" in e)
    assert batch_steps == sorted(generations) and len(batch_steps) >= 4, (batch_steps, sorted(generations))

    # -- rollouts, clipped ratio, lengths, rewards: per step ------------------------------------------
    spans = {r[0]: r[1:] for r in rows(f"""
        SELECT r.step, count(), countIf(r.clipped), countIf(r.clipped != (r.finish_reason = 'length')),
               avg(r.completion_tokens), min(r.completion_tokens), max(r.completion_tokens),
               avgIf(r.reward, g.ok > 0), stddevSampIf(r.reward, g.ok > 0),
               countIf(r.policy_version != r.step), uniqExact(r.sample_id), countIf(g.ok = 0)
        FROM (SELECT * FROM $db.spans FINAL WHERE {run} AND kind = 'ROLLOUT') AS r
        LEFT JOIN (SELECT rollout_id, countIf(outcome = 'ok') AS ok FROM $db.spans FINAL
                   WHERE {run} AND kind = 'GRADER' GROUP BY rollout_id) AS g ON g.rollout_id = r.rollout_id
        GROUP BY r.step ORDER BY r.step""")}
    stats = {r[0]: r[1:] for r in rows(f"""
        SELECT step, rollouts, clipped_ratio, completion_mean, completion_min, completion_max, staleness_max, reward_mean
        FROM $db.step_stats FINAL WHERE {run} ORDER BY step""")}
    assert sorted(spans) == sorted(stats) == batch_steps
    unscorable = 0
    for step in batch_steps:
        trl, (n, clipped, disagree, mean_len, min_len, max_len, reward, reward_std, off_policy, groups, none) = \
            logged[step], spans[step]
        s_rollouts, s_clipped, s_mean, s_min, s_max, staleness, s_reward = stats[step]
        where = f"step {step}"
        assert n == s_rollouts == generations[step]["rollouts"], where
        assert disagree == 0 and off_policy == 0 and staleness == 0, where  # clipped iff finish_reason length; staleness 0
        assert groups == n // job["config"]["num_generations"], where  # one sample_id per prompt group
        assert close(clipped / n, trl["completions/clipped_ratio"]) and close(s_clipped, trl["completions/clipped_ratio"]), where
        assert close(mean_len, trl["completions/mean_length"]) and close(s_mean, trl["completions/mean_length"]), where
        assert (min_len, max_len) == (s_min, s_max) == (trl["completions/min_length"], trl["completions/max_length"]), where
        assert close(reward, trl["reward"]), (where, reward, trl["reward"])
        assert close(reward_std, trl["reward_std"]), (where, reward_std, trl["reward_std"])
        if none == 0:  # every rollout scored: the pipeline's own mean is TRL's
            assert close(s_reward, trl["reward"]), where
        unscorable += none
    assert unscorable > 0, "the job's plan makes some completions unscorable (every reward function failed)"
    # EOS exactly at the length limit is a stop, not a truncation (TRL's rule, not completion_tokens >= max_tokens);
    # the seeded job has such completions (TRL's completions/max_terminated_length reaches the limit)
    limit = job["config"]["max_completion_length"]
    assert rows(f"SELECT countIf(completion_tokens = {limit} AND NOT clipped) > 0 FROM $db.spans FINAL "
                f"WHERE {run} AND kind = 'ROLLOUT'") == [(True,)]

    # -- grader calls: each reward function's mean and std, failures by cause, the call's own timing ----
    terms = rows(f"""
        SELECT step, term, avgIf(score, outcome = 'ok'), stddevSampIf(score, outcome = 'ok'),
               countIf(score IS NOT NULL AND outcome != 'ok'), uniqExact(start_time_ns, end_time_ns),
               min(end_time_ns - start_time_ns)
        FROM $db.spans FINAL WHERE {run} AND kind = 'GRADER' GROUP BY step, term ORDER BY step, term""")
    assert len(terms) == 2 * len(batch_steps)
    for step, term, mean, std, failed_scores, calls, shortest in terms:
        assert close(mean, logged[step][f"rewards/{term}/mean"]), (step, term, mean)
        assert close(std, logged[step][f"rewards/{term}/std"]), (step, term, std)
        assert failed_scores == 0  # a failed score is NULL
        assert calls == 1 and shortest > 0, (step, term)  # one reward call scores the batch: its start and end
    failures = rows(f"""
        SELECT step, term, outcome, count() FROM $db.spans FINAL
        WHERE {run} AND kind = 'GRADER' AND outcome != 'ok' GROUP BY step, term, outcome ORDER BY step, term, outcome""")
    expected = sorted((step, term, cause, n) for step, g in generations.items()
                      for term, causes in g["failures"].items() for cause, n in causes.items())
    assert failures == expected
    assert {cause for *_, cause, _ in failures} == set(FAILURE_CAUSES)  # the plan fails with every cause

    # -- every scalar TRL logged: step_metrics ---------------------------------------------------------
    want = {(step, name): float(val) for step, entry in logged.items() for name, val in entry.items()
            if isinstance(val, (int, float)) and not isinstance(val, bool) and math.isfinite(val)}
    got = {(step, name): value for step, name, value in rows(
        f"SELECT step, name, value FROM $db.step_metrics WHERE {run} ORDER BY step, name")}
    assert got == want
    assert any(name.startswith("clip_ratio/") for _, name in got)  # PPO's ratio clipping, beside the truncation ratio

    # -- steps and the run's end -----------------------------------------------------------------------
    completed = rows(f"SELECT step FROM $db.steps FINAL WHERE {run} AND type = 'STEP' ORDER BY step")
    assert [s for (s,) in completed] == list(range(1, job["config"]["max_steps"] + 1))
    assert rows(f"SELECT status FROM $db.steps FINAL WHERE {run} AND type = 'RUN_END'") == [("finished",)]


@pytest.mark.timeout(1800)
def test_the_runs_settings_are_the_jobs_grpo_config(ran: dict[str, Any]) -> None:
    settings, job = ran["settings"], ran["job"]
    store = open_reader(settings.clickhouse_dsn, owner="test")
    try:
        columns, rows = run_query(store.client, saved_sql("run-config", {"run_id": RUN}, store.database), {"run_id": RUN})
    finally:
        store.close()
    assert columns == ["project", "run_id", "attempt", "key", "value"]
    assert {(project, run_id, attempt) for project, run_id, attempt, _, _ in rows} == {(PROJECT, RUN, 1)}
    got = {key: value for _, _, _, key, value in rows}
    assert {key.split(".")[0] for key in got} == set(job["arguments"])  # every argument, nothing else
    assert {k: got[k] for k in ("learning_rate", "num_generations", "per_device_train_batch_size", "steps_per_generation",
                                "max_completion_length", "max_steps", "beta", "seed", "reward_weights", "hub_token")} == {
        "learning_rate": "0.005", "num_generations": "4", "per_device_train_batch_size": "32", "steps_per_generation": "2",
        "max_completion_length": "6", "max_steps": "10", "beta": "0.04", "seed": "0", "reward_weights": "[1.0,0.5]",
        "hub_token": "***"}
    assert not [k for k, value in got.items() if job["hub_token"] in value]
    # on the run's one RUN_START: the integration hands them over before training starts
    assert rows_of(settings, f"SELECT length(config) > 0 FROM $db.steps FINAL WHERE {RUN_SQL} AND type = 'RUN_START'") \
        == [(True,)]


# -- each rollout's prompt and completion ----------------------------------------------------------------

@pytest.mark.timeout(1800)
def test_each_rollout_has_one_llm_span_with_the_prompt_and_completion_trl_gave(ran: dict[str, Any]) -> None:
    settings, texts = ran["settings"], ran["texts"]
    rollouts = {r[0]: r[1:] for r in rows_of(settings, f"""
        SELECT rollout_id, step, span_id, trace_id, finish_reason FROM $db.spans FINAL
        WHERE {RUN_SQL} AND kind = 'ROLLOUT'""")}
    llms = rows_of(settings, f"""
        SELECT rollout_id, step, name, status, parent_span_id, trace_id, start_time_ns, end_time_ns,
               attributes['gen_ai.input.messages'], attributes['gen_ai.output.messages'],
               attributes['gen_ai.usage.input_tokens'], attributes['gen_ai.usage.output_tokens'],
               attributes['gen_ai.response.finish_reasons'], attributes['gen_ai.request.model'],
               attributes['rlpulse.prompt_token_ids'], attributes['rlpulse.response_token_ids'],
               attributes['rlpulse.content.cut_chars']
        FROM $db.spans FINAL WHERE {RUN_SQL} AND kind = 'LLM' ORDER BY rollout_id""")
    assert sorted(r[0] for r in llms) == sorted(rollouts) == sorted(texts)  # one LLM span per rollout, no other
    first_grading = dict(rows_of(settings, f"SELECT step, min(start_time_ns) FROM $db.spans FINAL "
                                           f"WHERE {RUN_SQL} AND kind = 'GRADER' GROUP BY step"))
    for (rollout_id, step, name, status, parent, trace, start, end, sent, got, n_in, n_out, reason, model, p_ids, r_ids,
         cut) in llms:
        want, (r_step, r_span, r_trace, r_reason) = texts[rollout_id], rollouts[rollout_id]
        where = rollout_id
        assert (step, name, status, parent, trace) == (r_step, "trl.generate", "OK", r_span, r_trace), where
        assert step == want["step"] and reason == r_reason, where
        assert sent == dumps([{"role": "user", "content": want["prompt"]}]), where  # exactly what TRL gave
        assert got == dumps([{"role": "assistant", "content": want["completion"]}]), where
        assert (int(n_in), int(n_out)) == (len(want["prompt_ids"]), len(want["completion_ids"])), where
        assert (json.loads(p_ids), json.loads(r_ids)) == (want["prompt_ids"], want["completion_ids"]), where
        assert model.endswith("tiny-llama") and cut == "", where
        assert start < end <= first_grading[step], where  # TRL's generation, timed, before the batch was scored


@pytest.mark.timeout(1800)
def test_export_messages_gives_each_rollouts_prompt_and_completion(ran: dict[str, Any], tmp_path: Path) -> None:
    settings, texts = ran["settings"], ran["texts"]
    rlpulse = Path(sys.executable).with_name("rlpulse")  # the console script, as a user runs it
    env = {**settings_env(settings), "PYTHONPATH": str(REPO)}

    def export(what: str) -> list[dict[str, Any]]:
        out = tmp_path / f"{what}.jsonl"
        done = subprocess.run([str(rlpulse), "export", what, "--project", PROJECT, "--run", RUN, "--output", str(out)],
                              env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        (ran["artifacts"] / out.name).write_text(out.read_text())
        return [json.loads(line) for line in out.read_text().splitlines()]

    rewards = {r[0]: (r[1], r[2], r[3]) for r in rows_of(settings, f"""
        SELECT rollout_id, step, sample_id, reward FROM $db.spans FINAL WHERE {RUN_SQL} AND kind = 'ROLLOUT'""")}
    messages = export("messages")
    assert sorted(m["rollout_id"] for m in messages) == sorted(texts)  # one row per rollout
    for m in messages:
        want = texts[m["rollout_id"]]
        assert m["messages"] == [{"role": "user", "content": want["prompt"]},
                                 {"role": "assistant", "content": want["completion"]}], m["rollout_id"]
        assert (m["step"], m["sample_id"], m["reward"]) == rewards[m["rollout_id"]], m["rollout_id"]
        assert (m["calls"], m["input_tokens"], m["output_tokens"]) == (1, len(want["prompt_ids"]), len(want["completion_ids"]))
    triplets = export("triplets")
    assert sorted(t["rollout_id"] for t in triplets) == sorted(texts)  # the grader spans are no turns
    for t in triplets:
        want = texts[t["rollout_id"]]
        assert (t["turn"], t["final"], t["grader_call"], t["token_ids"]) == (0, True, False, "ok"), t["rollout_id"]
        assert (t["prompt_ids"], t["response_ids"]) == (want["prompt_ids"], want["completion_ids"]), t["rollout_id"]
        assert (t["prompt"], t["response"]) == ([{"role": "user", "content": want["prompt"]}],
                                                {"role": "assistant", "content": want["completion"]}), t["rollout_id"]


@pytest.mark.timeout(1800)
def test_the_step_pages_show_each_rollouts_prompt_and_completion(ran: dict[str, Any]) -> None:
    sync_playwright = playwright_or_unavailable()
    settings, texts = ran["settings"], ran["texts"]
    steps = sorted({t["step"] for t in texts.values()})
    token = "trl-ui-token"
    with ui_server(settings, token) as link, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        page.goto(link)
        base = link.split("?")[0]
        seen = 0
        for step in steps:
            page.goto(f"{base}step?project={PROJECT}&run={RUN}&attempt=1&step={step}")
            cards = {c.get_attribute("data-rollout"): c.get_attribute("href") for c in page.locator("a.card").all()}
            assert sorted(cards) == sorted(r for r, t in texts.items() if t["step"] == step), step
            if step == steps[0]:
                page.screenshot(path=str(ran["artifacts"] / "step.png"), full_page=True)
            for rollout_id in sorted(cards):  # each card previews its task and its completion (PREVIEW characters)
                want, card = texts[rollout_id], page.locator(f'a.card[data-rollout="{rollout_id}"]')
                for part in ("prompt", "completion"):
                    shown = card.locator(f".{part}").all_inner_texts()
                    assert shown == ([want[part][:PREVIEW]] if want[part] else []), (rollout_id, part)
                seen += 1
            if step != steps[0]:
                continue
            for rollout_id, href in sorted(cards.items()):  # the first step's cards open their whole dialogue
                page.goto(base + href.lstrip("/"))  # the card's own link: its trajectory
                want = texts[rollout_id]
                msgs = page.locator(".dialogue .msg").all()
                assert [m.get_attribute("data-role") for m in msgs] == ["user", "assistant"], rollout_id
                shown = [m.locator("pre").all_inner_texts() for m in msgs]  # an empty text has no <pre>
                assert shown == [[want["prompt"]] if want["prompt"] else [],
                                 [want["completion"]] if want["completion"] else []], rollout_id
        page.screenshot(path=str(ran["artifacts"] / "trajectory.png"), full_page=True)
        browser.close()
    assert seen == len(texts)
