"""The TRL integration's mapping, without TRL: a stand-in trainer calls the hooks and the reward
functions as TRL 1.16's ``GRPOTrainer`` does (module ``trl.trainer.grpo_trainer``: the reward functions'
keyword arguments, None to NaN, the weighted ``nansum``; transformers' ``Trainer``: ``global_step``
raised before ``on_step_end``, then ``log`` appending to ``log_history`` before ``on_log``), and
what the SDK sent is read back from an ``InMemoryTransport``. The real trainer is
``tests/integration/producers/integrations/test_trl_job.py``'s.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import subprocess
import sys
from types import SimpleNamespace
from typing import Any
from collections.abc import Callable

import pytest

from rlpulse.producers import InMemoryTransport, TrainingTelemetry
from rlpulse.producers.integrations.trl import GraderFailure, instrument

EOS, PAD = 1, 0


class PrinterCallback:
    """transformers' PrinterCallback, added before ours: it pops total_flos from the logs it is given."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **_: Any) -> None:
        (logs or {}).pop("total_flos", None)


class FakeGRPO:
    """What the integration touches of a ``GRPOTrainer``, in TRL's order; ``batches``: per generation, the completions' ids."""

    def __init__(self, reward_funcs: list[Callable], batches: list[list[list[int]]], weights: list[float] | None = None,
                 steps_per_generation: int = 1, num_generations: int = 2, process_index: int = 0, num_processes: int = 1,
                 fail: BaseException | None = None, args: Any = None):
        self.reward_funcs = list(reward_funcs)
        self.reward_func_names = [f.__name__ for f in reward_funcs]
        self.reward_weights = weights or [1.0] * len(reward_funcs)
        self.num_generations, self.steps_per_generation = num_generations, steps_per_generation
        self.accelerator = SimpleNamespace(process_index=process_index, num_processes=num_processes)
        self.model = SimpleNamespace(training=True)
        self.eos_token_ids = [EOS]
        self._tokenizer = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
        self.state = SimpleNamespace(global_step=0, log_history=[], num_input_tokens_seen=0)
        self.callbacks: list[Any] = [PrinterCallback()]
        self.batches, self.fail = batches, fail
        self.args = args if args is not None else SimpleNamespace()  # the TrainingArguments the callbacks get
        self.trl_rewards: list[list[float]] = []  # per generation: TRL's weighted nansum per completion
        self.returned: list[list[list[Any]]] = []  # per generation, per reward function: what TRL was given

    def add_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def _event(self, name: str, **kwargs: Any) -> None:
        for callback in self.callbacks:
            if hasattr(callback, name):
                getattr(callback, name)(self.args, self.state, SimpleNamespace(), **kwargs)

    def log(self, logs: dict[str, Any]) -> None:
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self._event("on_log", logs=logs)

    def train(self) -> None:
        self._event("on_train_begin")
        for n in range(len(self.batches) * self.steps_per_generation):
            self._event("on_step_begin")
            figures = self._generate_and_score(self.batches[n // self.steps_per_generation]) \
                if n % self.steps_per_generation == 0 else {}
            if self.fail is not None and n == 1:
                raise self.fail
            self.state.global_step += 1
            self._event("on_step_end")
            self.log({"loss": 0.5 - n / 64, "grad_norm": 1.25, **figures})
        self.log({"train_runtime": 1.5, "total_flos": 0.0, "train_loss": 0.25})
        self._event("on_train_end")

    def _generate_and_score(self, completion_ids: list[list[int]]) -> dict[str, Any]:
        n = len(completion_ids)
        prompts = [f"prompt {i // self.num_generations}" for i in range(n)]
        completions = [" ".join(map(str, ids)) for ids in completion_ids]
        self.state.num_input_tokens_seen += sum(map(len, completion_ids))
        per_func, returned = [], []
        for func in self.reward_funcs:
            out = func(prompts=prompts, completions=completions, completion_ids=completion_ids, trainer_state=self.state,
                       log_extra=lambda *a: None, log_metric=lambda *a: None, answer=["x"] * n)
            returned.append(list(out))
            per_func.append([math.nan if r is None else float(r) for r in out])
        rewards = []
        for i in range(n):
            row = [w * f[i] for w, f in zip(self.reward_weights, per_func)]
            rewards.append(math.nan if all(math.isnan(x) for x in row) else sum(x for x in row if not math.isnan(x)))
        self.trl_rewards.append(rewards)
        self.returned.append(returned)
        valid = [r for r in rewards if not math.isnan(r)]
        clipped = [ids[-1] not in (EOS, PAD) for ids in completion_ids]
        return {"reward": sum(valid) / len(valid) if valid else None, "completions/clipped_ratio": sum(clipped) / n,
                "completions/mean_length": sum(map(len, completion_ids)) / n}


def run(trainer: FakeGRPO) -> tuple[list[dict], list[dict]]:
    transport = InMemoryTransport()
    instrument(trainer, project="p", run_id="r", transport=transport)
    trainer.train()
    return transport.records("spans"), transport.records("steps")


def of(spans: list[dict], kind: str) -> list[dict]:
    return [s for s in spans if s["kind"] == kind]


def score(prompts: list[str], completion_ids: list[list[int]], **_: Any) -> list[float]:
    return [len(ids) / 4 for ids in completion_ids]


def judge(prompts: list[str], completion_ids: list[list[int]], trainer_state: Any, **_: Any) -> list[Any]:
    """Completion 0 of each call is ungradable, completion 1 times out; every other scores 1.0."""
    return [None, GraderFailure("timeout")] + [1.0] * (len(prompts) - 2)


# ids: EOS at the limit of 4 (stopped), cut at the limit (clipped), ended on pad (stopped), short and stopped
BATCH = [[5, 6, 7, EOS], [5, 6, 7, 8], [5, 6, PAD], [5, EOS]]


def test_the_module_imports_without_transformers_trl_or_torch() -> None:
    code = ("import sys, rlpulse.producers.integrations.trl; "
            "assert not {'transformers', 'trl', 'torch'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_batch_is_the_step_after_the_global_step_it_was_generated_at_and_its_policy_version() -> None:
    trainer = FakeGRPO([score, judge], [BATCH, BATCH], weights=[1.0, 0.5], steps_per_generation=2)
    spans, steps = run(trainer)
    rollouts = of(spans, "ROLLOUT")
    # generated at global_step 0 and 2: steps 1 and 3; steps 2 and 4 train on them again and have none
    assert sorted({r["step"] for r in rollouts}) == [1, 3]
    assert all(r["policy_version"] == r["step"] for r in rollouts)  # staleness 0: synchronous GRPO
    first = sorted((r for r in rollouts if r["step"] == 1), key=lambda r: r["rollout_id"])
    assert [r["rollout_id"] for r in first] == ["s1-0", "s1-1", "s1-2", "s1-3"]
    assert [r["sample_id"] for r in first] == ["s1-p0", "s1-p0", "s1-p1", "s1-p1"]  # num_generations = 2 per prompt
    assert [r["completion_tokens"] for r in first] == [4, 4, 3, 2]
    # TRL's truncation: the last token neither EOS nor pad; EOS exactly at the limit is not clipped
    assert [r["finish_reason"] for r in first] == ["stop", "length", "stop", "stop"]
    assert [r["clipped"] for r in first] == [False, True, False, False]
    # reward: TRL's weighted nansum; terms: each function's weighted value, a failed one 0.0 (seed 001)
    assert [r["term_shares"] for r in first] == [{"score": 1.0, "judge": 0.0}, {"score": 1.0, "judge": 0.0},
                                                 {"score": 0.75, "judge": 0.5}, {"score": 0.5, "judge": 0.5}]
    assert [r["reward"] for r in first] == trainer.trl_rewards[0]
    step_events = [s for s in steps if s["type"] == "STEP"]
    assert [s["step"] for s in step_events] == [1, 2, 3, 4] and step_events[-1]["step_count"] == 4


def test_grader_outcomes_scores_and_the_calls_own_timing() -> None:
    def flaky(prompts: list[str], completion_ids: list[list[int]], trainer_state: Any, **_: Any) -> list[Any]:
        """Generation 0: raises; 1: GraderFailure('unavailable') raised; 2: NaN, inf, a GraderFailure, a score."""
        k = trainer_state.global_step
        if k == 0:
            raise RuntimeError("judge down")
        if k == 1:
            raise GraderFailure("unavailable")
        return [math.nan, math.inf, GraderFailure("unreadable"), 0.25]

    trainer = FakeGRPO([score, flaky], [BATCH, BATCH, BATCH])
    spans, _ = run(trainer)
    graders = [g for g in of(spans, "GRADER") if g["term"] == "flaky"]
    by_step: dict[int, list[tuple]] = {}
    for g in sorted(graders, key=lambda g: g["rollout_id"]):
        by_step.setdefault(g["step"], []).append((g["outcome"], g["score"]))
    assert by_step == {1: [("error", None)] * 4, 2: [("unavailable", None)] * 4,
                       3: [("ungradable", None), ("unreadable", None), ("unreadable", None), ("ok", 0.25)]}
    # what TRL got back: None (NaN) for a failure, the value itself otherwise (NaN and inf pass through)
    assert [gen[1] for gen in trainer.returned[:2]] == [[None] * 4, [None] * 4]
    nan, *rest = trainer.returned[2][1]
    assert math.isnan(nan) and rest == [math.inf, None, 0.25]
    # a failed term counts as zero for its term (seed 001) and adds nothing to the reward (TRL's nansum)
    third = [r for r in sorted(of(spans, "ROLLOUT"), key=lambda r: r["rollout_id"]) if r["step"] == 3]
    assert [r["term_shares"] for r in third] == [
        {"score": 1.0, "flaky": 0.0}, {"score": 1.0, "flaky": 0.0}, {"score": 0.75, "flaky": 0.0}, {"score": 0.5, "flaky": 0.25}]
    assert [r["reward"] for r in third] == [1.0, 1.0, 0.75, 0.75]
    # a grader span carries its call's start and end, shared by the call's completions
    for step in (1, 2, 3):
        calls = {(g["start_time_ns"], g["end_time_ns"]) for g in graders if g["step"] == step}
        assert len(calls) == 1 and all(start <= end for start, end in calls)


def test_every_scalar_trl_logs_is_published_and_what_is_not_a_number_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    trainer = FakeGRPO([judge], [[[5, EOS], [5, 6]]])  # judge fails both: TRL logs reward None
    with caplog.at_level(logging.WARNING, logger="rlpulse.producers.integrations.trl"):
        spans, steps = run(trainer)
    step, summary = [s for s in steps if s["type"] in ("STEP", "METRICS")]
    assert step["type"] == "STEP" and step["step"] == 1
    assert step["metrics"] == {"loss": 0.5, "grad_norm": 1.25, "completions/clipped_ratio": 0.5, "completions/mean_length": 2.0}
    # the train summary, logged at the same step: a METRICS event; total_flos too, though a callback before ours popped it
    assert summary["type"] == "METRICS" and summary["step"] == 1
    assert summary["metrics"] == {"train_runtime": 1.5, "total_flos": 0.0, "train_loss": 0.25}
    assert [r.getMessage() for r in caplog.records if "reward" in r.getMessage()] == [
        "TRL logged reward=None: not a finite number under a usable name, so not published "
        "(later skips of this name are counted, not logged)",
        "TRL values not published (not finite numbers): reward x1"]
    unscorable = of(spans, "ROLLOUT")  # both completions: every function failed; reward 0.0, as TRL's nansum
    assert [(r["term_shares"], r["reward"]) for r in unscorable] == [({"judge": 0.0}, 0.0), ({"judge": 0.0}, 0.0)]


def test_more_scalars_than_one_event_holds_go_in_several() -> None:
    transport = InMemoryTransport()
    trainer = FakeGRPO([score], [])
    hooks = instrument(trainer, project="p", run_id="r", transport=transport)
    hooks.on_train_begin(None, trainer.state, None)
    trainer.state.global_step = 1
    hooks.on_step_end(None, trainer.state, None)
    logs = {f"m/{i}": float(i) for i in range(300)}
    trainer.log(logs)
    hooks.close()
    events = [s for s in transport.records("steps") if s["type"] in ("STEP", "METRICS")]
    assert [(e["type"], len(e["metrics"])) for e in events] == [("STEP", 256), ("METRICS", 44)]
    assert {k: val for e in events for k, val in e["metrics"].items()} == logs


@pytest.mark.parametrize(("error", "status"), [(None, "finished"), (RuntimeError("nan loss"), "failed"),
                                               (KeyboardInterrupt(), "cancelled")])
def test_run_end_says_how_training_ended(error: BaseException | None, status: str) -> None:
    trainer = FakeGRPO([score], [BATCH, BATCH], fail=error)
    transport = InMemoryTransport()
    instrument(trainer, project="p", run_id="r", transport=transport)
    if error is None:
        trainer.train()
    else:
        with pytest.raises(type(error)):
            trainer.train()
    ends = [s for s in transport.records("steps") if s["type"] == "RUN_END"]
    assert [e["status"] for e in ends] == [status]
    assert len(of(transport.records("spans"), "ROLLOUT")) == 8  # what was scored is published, whatever followed


def test_a_second_rank_publishes_its_own_rollouts_and_no_steps() -> None:
    trainer = FakeGRPO([score], [BATCH], process_index=1, num_processes=2)
    spans, steps = run(trainer)
    # its completions follow rank 0's in the gathered batch (TRL's process_slice): indices 4-7, prompt groups 2-3
    assert sorted(r["rollout_id"] for r in of(spans, "ROLLOUT")) == ["s1-4", "s1-5", "s1-6", "s1-7"]
    assert sorted({r["sample_id"] for r in of(spans, "ROLLOUT")}) == ["s1-p2", "s1-p3"]
    # its grader calls, held for their step, go out when it completes the step here too
    assert sorted(g["rollout_id"] for g in of(spans, "GRADER")) == ["s1-4", "s1-5", "s1-6", "s1-7"]
    assert steps == []  # no RUN_START, STEP, METRICS, heartbeat or RUN_END: rank 0 speaks for the run


def test_an_async_reward_function_stays_async_and_is_recorded() -> None:
    async def remote_judge(prompts: list[str], completion_ids: list[list[int]], **_: Any) -> list[Any]:
        await asyncio.sleep(0)
        return [0.5, GraderFailure("timeout")]

    transport = InMemoryTransport()
    trainer = FakeGRPO([remote_judge], [])
    # each call published when made: called here outside any step, its step never completes
    instrument(trainer, project="p", run_id="r", transport=transport, grader_calls="call")
    wrapped = trainer.reward_funcs[0]
    assert inspect.iscoroutinefunction(wrapped)  # TRL runs it with asyncio.gather only if it is
    got = asyncio.run(wrapped(prompts=["a", "a"], completion_ids=[[5, EOS], [5, 6]], trainer_state=trainer.state))
    assert got == [0.5, None]
    trainer.train()  # no batches: starts and ends the run, publishing what is pending
    outcomes = sorted((g["rollout_id"], g["outcome"], g["score"]) for g in of(transport.records("spans"), "GRADER"))
    assert outcomes == [("s1-0", "ok", 0.5), ("s1-1", "timeout", None)]


def test_evaluation_batches_are_not_rollouts_and_a_wrong_length_is_left_to_trl() -> None:
    def short(prompts: list[str], **_: Any) -> list[float]:
        return [1.0]

    transport = InMemoryTransport()
    trainer = FakeGRPO([score, short], [])
    instrument(trainer, project="p", run_id="r", transport=transport)
    trainer.model.training = False
    assert trainer.reward_funcs[0](prompts=["a"], completion_ids=[[5, EOS]], trainer_state=trainer.state) == [0.5]
    trainer.model.training = True
    assert trainer.reward_funcs[1](prompts=["a", "b"], completion_ids=[[5], [6]], trainer_state=trainer.state) == [1.0]
    trainer.train()
    spans = transport.records("spans")
    assert of(spans, "GRADER") == [] and [r["rollout_id"] for r in of(spans, "ROLLOUT")] == ["s1-0", "s1-1"]


def test_a_grader_failure_names_a_known_cause() -> None:
    assert GraderFailure("timeout").cause == "timeout"
    with pytest.raises(ValueError, match="cause must be one of"):
        GraderFailure("flaky")


def test_what_cannot_be_recorded_is_logged_and_training_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    trainer = FakeGRPO([score], [BATCH])
    trainer.reward_func_names = ["x" * 300]  # longer than the SDK takes for a term
    with caplog.at_level(logging.ERROR, logger="rlpulse.producers.integrations.trl"):
        spans, steps = run(trainer)
    assert "rlpulse could not record a call of reward function xxx" in caplog.text
    assert of(spans, "GRADER") == [] and trainer.returned == [[[1.0, 1.0, 0.75, 0.5]]]  # TRL got its scores
    assert [s["status"] for s in steps if s["type"] == "RUN_END"] == ["finished"]


@pytest.mark.parametrize("mode", ["step", "call"])
def test_grader_calls_go_out_with_their_step_and_those_of_the_step_that_crashed_do_not(mode: str) -> None:
    """Seed 001: the job reports the calls for a step when it reports that step; a job that stops does
    not count the calls of the step it never completed. TRL's default is "step"; "call" is today's."""
    trainer = FakeGRPO([score, judge], [BATCH, BATCH], fail=RuntimeError("judge refused the credentials"))
    transport = InMemoryTransport()
    hooks = instrument(trainer, project="p", run_id="r", transport=transport,
                       **({} if mode == "step" else {"grader_calls": "call"}))
    with pytest.raises(RuntimeError):
        trainer.train()  # step 1 completes; step 2's batch is scored, then the step raises
    graders = of(transport.records("spans"), "GRADER")
    rollouts = of(transport.records("spans"), "ROLLOUT")
    assert sorted({r["step"] for r in rollouts}) == [1, 2]  # the rollouts of both steps, as before
    if mode == "step":
        assert sorted({g["step"] for g in graders}) == [1] and len(graders) == 2 * len(BATCH)
        held = hooks.tel.held_graders
        assert held is not None and (held.held, held.published, held.discarded, held.dropped) == (0, 8, 8, 0)
    else:
        assert sorted({g["step"] for g in graders}) == [1, 2] and len(graders) == 4 * len(BATCH)
        assert hooks.tel.held_graders is None


class Arguments:
    """What the integration reads of TRL's ``GRPOConfig``: ``to_dict()``, which transformers' ``TrainingArguments``
    writes with each ``*_token`` value replaced by ``<FIELD_NAME>``."""

    def to_dict(self) -> dict[str, Any]:
        return {"learning_rate": 5e-3, "num_generations": 4, "per_device_train_batch_size": 32, "hub_token": "<HUB_TOKEN>",
                "report_to": ["none"], "accelerator_config": {"split_batches": False}}


ARGUMENTS = {"learning_rate": "0.005", "num_generations": "4", "per_device_train_batch_size": "32", "hub_token": "***",
             "report_to": '["none"]', "accelerator_config.split_batches": "false"}


def run_starts(steps: list[dict]) -> list[tuple[int, dict]]:
    return [(s["step_count"], s["config"]) for s in steps if s["type"] == "RUN_START"]


def test_the_trainers_arguments_ride_the_run_start() -> None:
    _, steps = run(FakeGRPO([score], [BATCH], args=Arguments()))
    assert run_starts(steps) == [(0, ARGUMENTS)]
    assert all(s["config"] == {} for s in steps if s["type"] != "RUN_START")


def test_a_started_telemetry_gets_them_on_a_second_run_start_and_its_own_settings_are_kept() -> None:
    transport = InMemoryTransport()
    with TrainingTelemetry("p", "r", transport=transport) as tel:
        tel.step_completed(0)
        instrument(FakeGRPO([score], [BATCH], args=Arguments()), project="p", run_id="r", telemetry=tel).trainer.train()
    assert run_starts(transport.records("steps")) == [(0, {}), (1, ARGUMENTS)]
    transport = InMemoryTransport()
    with TrainingTelemetry("p", "r", transport=transport, config={"recipe": "mine"}) as tel:
        instrument(FakeGRPO([score], [BATCH], args=Arguments()), project="p", run_id="r", telemetry=tel).trainer.train()
    assert run_starts(transport.records("steps")) == [(0, {"recipe": "mine"})]


def test_arguments_that_cannot_be_read_are_logged_and_training_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def to_dict(self) -> dict:
            return {1: "not a name"}

    _, steps = run(FakeGRPO([score], [BATCH], args=Broken()))
    assert run_starts(steps) == [(0, {})] and [s["type"] for s in steps][-1] == "RUN_END"
    assert "could not read TRL" in caplog.text


@pytest.mark.full  # the fast tier is at its time limit
def test_telemetry_off_keeps_the_judge_and_gives_trl_what_it_gives_instrumented(monkeypatch, caplog) -> None:
    """``instrument(..., enabled=False)``: the reward functions give TRL exactly what they give it
    instrumented, and nothing is made that could publish (no telemetry, no callback, ``train`` left as it is)."""
    def flaky(prompts: list[str], completion_ids: list[list[int]], trainer_state: Any, **_: Any) -> list[Any]:
        k = trainer_state.global_step
        if k == 0:
            raise RuntimeError("judge down")
        if k == 1:
            raise GraderFailure("unavailable")
        return [math.nan, math.inf, GraderFailure("unreadable"), 0.25]

    async def judge_async(prompts: list[str], **_: Any) -> list[Any]:
        return [GraderFailure("timeout")] + [0.5] * (len(prompts) - 1)

    on = FakeGRPO([score, flaky, judge], [BATCH, BATCH, BATCH])
    run(on)
    made: list[Any] = []
    monkeypatch.setattr(TrainingTelemetry, "__init__", lambda *a, **k: made.append(a))  # would fail the test below
    off = FakeGRPO([score, flaky, judge], [BATCH, BATCH, BATCH])
    train = off.train
    assert instrument(off, project="p", run_id="r", enabled=False) is None
    assert off.train == train and len(off.callbacks) == 1 and made == []
    off.train()
    same = [[[("nan" if isinstance(x, float) and math.isnan(x) else x) for x in f] for f in gen] for gen in off.returned]
    assert same == [[[("nan" if isinstance(x, float) and math.isnan(x) else x) for x in f] for f in gen] for gen in on.returned]
    assert not any(isinstance(x, GraderFailure) for gen in off.returned for f in gen for x in f)
    assert [math.isnan(r) for r in off.trl_rewards[0]] == [math.isnan(r) for r in on.trl_rewards[0]]
    assert "reward function flaky raised RuntimeError: judge down; its 4 scores are NaN for TRL (rlpulse telemetry is off)" \
        in caplog.text
    # async stays async (TRL gathers those), and gives TRL None for a GraderFailure
    holder = SimpleNamespace(reward_funcs=[judge_async], reward_func_names=["judge_async"])
    instrument(holder, project="p", run_id="r", enabled=False)
    assert inspect.iscoroutinefunction(holder.reward_funcs[0])
    assert asyncio.run(holder.reward_funcs[0](prompts=["a", "b"])) == [None, 0.5]
