"""verl's and OpenRLHF's rollouts with their prompts and completions (content on), run through the frameworks' own code.

Neither framework imports here (torch, Ray, GPUs), so the methods that hand the rollouts on are read from
their released sources (``tests.framework_sources``: verl 0.9.1, OpenRLHF 0.11.2) and run unchanged on
stand-in trainers, with numpy arrays in place of torch tensors (the calls they make: ``sum(dim)``,
``cpu()``, ``tolist()``, ``unsqueeze``):

* verl: ``_log_rollout_data``, ``_dump_generations`` and ``_write_generations`` of the legacy
  ``RayPPOTrainer`` (``verl.trainer.ppo.ray_trainer``: a ``DataProto`` batch) and of the v1
  ``PPOTrainer`` (``verl.trainer.ppo.v1.trainer_base``: transfer-queue keys ``{uid}_{session}_{index}``);
* OpenRLHF: ``BasePPOTrainer.train_step`` and ``save_logs_and_checkpoints`` (``openrlhf.trainer.ppo_trainer``),
  fed ``Experience`` rows shaped as its ``SamplesGenerator._process_response_into_experience`` builds them and
  micro-batched as ``RemoteExperienceMaker.split_rollout_samples`` does (``index``, right padding).

Every test reads the exact records an ``InMemoryTransport`` received.
"""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rlpulse.producers.integrations import openrlhf, verl
from rlpulse.producers.sdk.memory import InMemoryTransport
from rlpulse.producers.sdk.telemetry import TrainingTelemetry
from rlpulse.base.settings import Settings
from tests.framework_sources import SITE, framework_sources
from tests.unit.producers.integrations.test_integration_verl import verl_tracking_module  # noqa: F401 (a fixture)

np = pytest.importorskip("numpy")
pytestmark = pytest.mark.full

SETTINGS = Settings.load({"RLPULSE_TOPIC_PREFIX": "mem", "RLPULSE_HEARTBEAT_INTERVAL": "1h"})
WORDS = ["<pad>", "<eos>", "red", "green", "blue", "cat", "dog", "sun", "moon", "star", "Q:", "A:"]
PAD, EOS = 0, 1


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def of(transport: InMemoryTransport, kind: str) -> list[dict]:
    return [s for s in transport.records("spans") if s["kind"] == kind]


class Tensor(np.ndarray):
    """A numpy array answering the torch calls the frameworks' methods make."""

    def sum(self, dim: Any = None, axis: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        return np.asarray(self).sum(axis=dim if dim is not None else axis, **kwargs).view(Tensor)

    def cpu(self) -> Tensor:
        return self

    def unsqueeze(self, dim: int) -> Tensor:
        return np.expand_dims(np.asarray(self), dim).view(Tensor)

    def to_padded_tensor(self, padding: int) -> Tensor:  # transfer_queue's nested tensors: already padded here
        return self


def tensor(rows: Any, dtype: Any = None) -> Tensor:
    return np.array(rows, dtype=dtype).view(Tensor)


class Tokenizer:
    pad_token_id, eos_token_id = PAD, EOS

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> Any:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if ids and isinstance(ids[0], list):  # a batch (OpenRLHF decodes sequences[0].unsqueeze(0))
            return [self.decode(row, skip_special_tokens) for row in ids]
        return " ".join(WORDS[t] for t in ids if not (skip_special_tokens and t in (PAD, EOS)))

    def batch_decode(self, rows: Any, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(row, skip_special_tokens) for row in rows]


def framework_class(name: str, relative: str, cls: str, methods: tuple[str, ...], namespace: dict[str, Any]) -> type:
    """A class holding ``methods`` of ``cls`` as the framework's released source defines them."""
    framework_sources(name)
    source = SITE / relative
    if not source.exists():
        pytest.skip(f"{name}'s source is not at {source}")
    tree = ast.parse(source.read_text(), str(source))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    body = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name in methods]
    assert sorted(n.name for n in body) == sorted(methods), f"{cls} of {source} lacks some of {methods}"
    made = ast.ClassDef(name=cls, bases=[], keywords=[], body=body, decorator_list=[], type_params=[])
    module = ast.fix_missing_locations(ast.Module(body=[made], type_ignores=[]))
    scope = {"__name__": f"framework_{name}", **namespace}
    exec(compile(module, str(source), "exec", flags=0x1000000), scope)  # annotations stay strings (CO_FUTURE_ANNOTATIONS)
    return scope[cls]


@contextlib.contextmanager
def marked_timer(name: str, timing_raw: dict, color: str | None = None) -> Any:
    start = time.perf_counter()
    yield
    timing_raw[name] = time.perf_counter() - start


DUMP = ("_log_rollout_data", "_dump_generations", "_write_generations", "_init_dump_executor", "_shutdown_dump_executor")

# -- verl ---------------------------------------------------------------------------------------------
PROMPTS = [[10, 2, 5], [10, 3]]  # per sample: "Q: red cat", "Q: green"
RESPONSES = [[[11, 4, EOS], [11, 6, 7, 8]], [[11, 2, EOS], [9]]]  # per sample, its two responses
UIDS = ["4e1d8a10-0000-4000-8000-00000000000a", "4e1d8a10-0000-4000-8000-00000000000b"]


def verl_rows() -> list[tuple[int, list[int], list[int], float]]:
    """(sample, prompt ids, response ids, score) per rollout, interleaved as verl repeats a batch."""
    return [(s, PROMPTS[s], r, 1.0 - len(r) / 4) for s in range(2) for r in RESPONSES[s]]


def legacy_batch() -> Any:
    """A ``DataProto`` as the legacy trainer hands ``_log_rollout_data``: prompts left-padded, responses right-padded."""
    rows = verl_rows()
    width, length = max(len(p) for _, p, _, _ in rows), max(len(r) for _, _, r, _ in rows)
    prompts = [[PAD] * (width - len(p)) + p for _, p, _, _ in rows]
    responses = [r + [PAD] * (length - len(r)) for _, _, r, _ in rows]
    mask = [[0] * (width - len(p)) + [1] * len(p) + [1] * len(r) + [0] * (length - len(r)) for _, p, r, _ in rows]
    scores = [[0.0] * (len(r) - 1) + [score] + [0.0] * (length - len(r)) for _, _, r, score in rows]
    tensors = {"prompts": tensor(prompts), "responses": tensor(responses), "attention_mask": tensor(mask),
               "token_level_scores": tensor(scores)}
    non_tensor = {"uid": np.array([UIDS[s] for s, *_ in rows], dtype=object),
                  "reward_model": np.array([{"ground_truth": "blue"} for _ in rows], dtype=object)}

    class DataProto:
        batch, non_tensor_batch = tensors, non_tensor

        def __len__(self) -> int:
            return len(rows)

        def __iter__(self) -> Any:
            return iter(SimpleNamespace(non_tensor_batch={k: v[i] for k, v in non_tensor.items()}) for i in range(len(rows)))

    return DataProto()


def verl_trainer(cls: type, tmp_path: Path, step: int = 3) -> Any:
    trainer = cls()
    trainer.tokenizer = Tokenizer()
    trainer.config = SimpleNamespace(trainer=SimpleNamespace(rollout_data_dir=str(tmp_path / "rollouts")),
                                     actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(response_length=4)))
    trainer.global_steps = step
    trainer._init_dump_executor()
    return trainer


def legacy_class() -> type:
    return framework_class("verl", "verl/trainer/ppo/ray_trainer.py", "RayPPOTrainer", DUMP,
                           {"os": os, "json": json, "marked_timer": marked_timer, "ThreadPoolExecutor": ThreadPoolExecutor})


def v1_class(batch_keys: list[str]) -> type:
    rows = verl_rows()
    width, length = max(len(p) for _, p, _, _ in rows), max(len(r) for _, _, r, _ in rows)

    def kv_batch_get(keys: list[str], partition_id: str, select_fields: list[str]) -> dict[str, Any]:
        assert keys == batch_keys and partition_id == "train"
        return {"uid": np.array(keys, dtype=object),
                "prompts": tensor([[PAD] * (width - len(p)) + p for _, p, _, _ in rows]),
                "responses": tensor([r + [PAD] * (length - len(r)) for _, _, r, _ in rows]),
                "rm_scores": tensor([[0.0] * (len(r) - 1) + [sc] + [0.0] * (length - len(r)) for _, _, r, sc in rows]),
                "reward_model": np.array([{"ground_truth": "blue"} for _ in rows], dtype=object)}

    return framework_class("verl", "verl/trainer/ppo/v1/trainer_base.py", "PPOTrainer", DUMP,
                           {"os": os, "json": json, "np": np, "marked_timer": marked_timer,
                            "ThreadPoolExecutor": ThreadPoolExecutor, "tq": SimpleNamespace(kv_batch_get=kv_batch_get)})


def check_verl_spans(transport: InMemoryTransport, step: int, sample_ids: list[str], model: str | None,
                     tokens: bool) -> None:
    rows, tok = verl_rows(), Tokenizer()
    rollouts, llms = of(transport, "ROLLOUT"), of(transport, "LLM")
    assert [r["rollout_id"] for r in rollouts] == [s["rollout_id"] for s in llms] == [f"s{step}-{i}" for i in range(4)]
    for i, ((_, prompt, response, score), rollout, llm) in enumerate(zip(rows, rollouts, llms)):
        assert (rollout["step"], rollout["reward"], rollout["sample_id"]) == (step, score, sample_ids[i])
        assert (rollout["completion_tokens"], rollout["max_tokens"], rollout["clipped"]) == (
            (len(response), 4, len(response) >= 4) if tokens else (None, 4, None))
        assert (llm["parent_span_id"], llm["trace_id"], llm["step"], llm["name"]) == (
            rollout["span_id"], rollout["trace_id"], step, "verl.generate")
        want = {"gen_ai.operation.name": "text_completion",
                "gen_ai.input.messages": dumps([{"role": "user", "content": tok.decode(prompt, True)}]),
                "gen_ai.output.messages": dumps([{"role": "assistant", "content": tok.decode(response, True)}])}
        if model:
            want["gen_ai.request.model"] = model
        if tokens:
            want.update({"gen_ai.usage.input_tokens": len(prompt), "gen_ai.usage.output_tokens": len(response)})
        assert llm["attributes"] == want, i


def test_verl_legacy_trainer_dump_gives_each_rollout_its_text(tmp_path):
    Trainer = legacy_class()
    verl.register_trainer(Trainer)
    verl.register_trainer(Trainer)  # twice: patched once
    transport = InMemoryTransport()
    with TrainingTelemetry("p", "r", settings=SETTINGS, transport=transport) as tel:
        backend = verl.attach(SimpleNamespace(logger={}), tel, content=True, model="Qwen/Qwen2.5-0.5B")
        trainer = verl_trainer(Trainer, tmp_path)
        trainer._log_rollout_data(legacy_batch(), {"acc": [1.0, 0.0, 1.0, 0.0]}, {}, str(tmp_path / "rollouts"))
        # a validation dump (verl's _validate calls _dump_generations itself): not a training rollout
        trainer._dump_generations(inputs=["x"], outputs=["y"], gts=[None], scores=[1.0], reward_extra_infos_dict={},
                                  dump_path=str(tmp_path / "val"))
        trainer._shutdown_dump_executor()
        backend.finish()
    check_verl_spans(transport, 3, [UIDS[s] for s, *_ in verl_rows()], "Qwen/Qwen2.5-0.5B", tokens=True)
    tok = Tokenizer()  # verl's own file, as it was: what the spans say
    dumped = [json.loads(line) for line in (tmp_path / "rollouts" / "3.jsonl").read_text().splitlines()]
    assert [(d["input"], d["output"], d["score"], d["step"]) for d in dumped] == [
        (tok.decode(p, True), tok.decode(r, True), score, 3) for _, p, r, score in verl_rows()]
    assert (tmp_path / "val" / "3.jsonl").exists()


def test_verl_v1_trainer_dump_gives_each_rollout_its_text_and_sample(tmp_path):
    keys = [f"{UIDS[s]}_0_{i}" for i, (s, *_) in enumerate(verl_rows())]
    Trainer = v1_class(keys)
    verl.register_trainer(Trainer)
    transport = InMemoryTransport()
    with TrainingTelemetry("p", "r", settings=SETTINGS, transport=transport) as tel:
        backend = verl.attach(SimpleNamespace(logger={}), tel, content=True)
        trainer = verl_trainer(Trainer, tmp_path, step=5)
        trainer._log_rollout_data(SimpleNamespace(keys=keys, partition_id="train"), {}, str(tmp_path / "rollouts"))
        trainer._shutdown_dump_executor()
        backend.finish()
    check_verl_spans(transport, 5, [UIDS[s] for s, *_ in verl_rows()], None, tokens=False)
    assert len((tmp_path / "rollouts" / "5.jsonl").read_text().splitlines()) == 4


def test_verl_token_ids_and_content_off(tmp_path, monkeypatch):
    Trainer = legacy_class()
    verl.register_trainer(Trainer)
    transport = InMemoryTransport()
    with TrainingTelemetry("p", "r", settings=SETTINGS, transport=transport) as tel:
        backend = verl.attach(SimpleNamespace(logger={}), tel, content=True, token_ids=True)
        verl_trainer(Trainer, tmp_path)._log_rollout_data(legacy_batch(), {}, {}, str(tmp_path / "a"))
        backend.finish()
    assert [(json.loads(s["attributes"]["rlpulse.prompt_token_ids"]), json.loads(s["attributes"]["rlpulse.response_token_ids"]))
            for s in of(transport, "LLM")] == [(p, r) for _, p, r, _ in verl_rows()]
    monkeypatch.delenv("RLPULSE_TRACE_CONTENT", raising=False)
    off = InMemoryTransport()
    with TrainingTelemetry("p", "r", settings=SETTINGS, transport=off) as tel:
        backend = verl.attach(SimpleNamespace(logger={}), tel)
        assert backend.completions is None
        trainer = verl_trainer(Trainer, tmp_path)
        trainer._log_rollout_data(legacy_batch(), {}, {}, str(tmp_path / "b"))
        trainer._shutdown_dump_executor()
        backend.finish()
    assert {s["kind"] for s in off.records("spans")} == set() and (tmp_path / "b" / "3.jsonl").exists()


def test_verl_install_sends_the_text_through_the_tracking_backend_it_builds(verl_tracking_module, tmp_path, monkeypatch):  # noqa: F811
    transport = InMemoryTransport()
    verl.install(content=True, content_limit=300, transport=transport, settings=SETTINGS)
    tracking_module = verl_tracking_module()
    config = {"actor_rollout_ref": {"model": {"path": "Qwen/Qwen2.5-0.5B"}}, "trainer": {"logger": ["rlpulse"]}}
    tracking = tracking_module.Tracking(project_name="math", experiment_name="ppo-7", default_backend=["rlpulse"],
                                        config=config)
    assert tracking.logger["rlpulse"].completions.content_limit == 300
    Trainer = legacy_class()
    verl.register_trainer(Trainer)  # what install's import hook does once verl imports its trainer module
    trainer = verl_trainer(Trainer, tmp_path)
    trainer._log_rollout_data(legacy_batch(), {}, {}, str(tmp_path / "rollouts"))
    tracking.log(data={"timing_s/step": 2.0}, step=3)
    tracking.finish(exit_code=0)
    trainer._shutdown_dump_executor()
    check_verl_spans(transport, 3, [UIDS[s] for s, *_ in verl_rows()], "Qwen/Qwen2.5-0.5B", tokens=True)
    assert {(s["project"], s["run_id"]) for s in transport.records("spans")} == {("math", "ppo-7")}


def test_verl_a_score_that_is_not_finite_leaves_its_rollout_out(tmp_path, caplog):
    Trainer = legacy_class()
    verl.register_trainer(Trainer)
    transport = InMemoryTransport()
    batch = legacy_batch()
    batch.batch["token_level_scores"][1, :] = np.nan
    with TrainingTelemetry("p", "r", settings=SETTINGS, transport=transport) as tel:
        backend = verl.attach(SimpleNamespace(logger={}), tel, content=True)
        verl_trainer(Trainer, tmp_path)._log_rollout_data(batch, {}, {}, str(tmp_path / "r"))
        assert backend.completions is not None and backend.completions.refused == 1
        backend.finish()
    assert [s["rollout_id"] for s in of(transport, "LLM")] == ["s3-0", "s3-2", "s3-3"]
    assert "reward must be a finite number" in caplog.text


# -- OpenRLHF -----------------------------------------------------------------------------------------
N = 2  # --rollout.n_samples_per_prompt
OPENRLHF_PROMPTS = ["Q: red cat", "Q: blue"]  # the dataset's texts (chat template applied by OpenRLHF's PromptDataset)
OPENRLHF_RESPONSES = [[[11, 4, EOS], [11, 6, 7]], [[11, 2, 3, EOS], [5, EOS]]]


def prompt_ids(text: str) -> list[int]:
    return [WORDS.index(w) for w in text.split()]


def sample_experience(prompt: str, response: list[int], reward: float, truncated: bool) -> SimpleNamespace:
    """One rollout as ``SamplesGenerator._process_response_into_experience`` builds it (B = 1)."""
    observation = prompt_ids(prompt) + response
    mask = [0] * len(observation)
    for k in range(len(prompt_ids(prompt)), len(observation)):  # action_ranges: the response
        mask[k] = 1
    return SimpleNamespace(sequences=tensor([observation]), attention_mask=tensor([[1] * len(observation)]),
                           action_mask=tensor([mask[1:]]), prompts=[prompt], labels=["blue"], index=None,
                           rewards=tensor([reward]), response_length=tensor([len(response)]), truncated=tensor([truncated]),
                           info={"reward": tensor([reward])})


def concat(items: list[SimpleNamespace]) -> SimpleNamespace:
    """``Experience.concat_experiences``: tensors right-padded (sequences with the pad id, others 0), lists chained."""
    def pad(rows: list[Tensor], value: int) -> Tensor:
        width = max(r.shape[-1] for r in rows)
        return tensor([list(r[0]) + [value] * (width - r.shape[-1]) for r in rows])

    return SimpleNamespace(
        sequences=pad([e.sequences for e in items], PAD), attention_mask=pad([e.attention_mask for e in items], 0),
        action_mask=pad([e.action_mask for e in items], 0), prompts=[p for e in items for p in e.prompts],
        labels=[x for e in items for x in e.labels], index=[i for e in items for i in e.index],
        rewards=tensor([float(e.rewards[0]) for e in items]), response_length=tensor([int(e.response_length[0]) for e in items]),
        truncated=tensor([bool(e.truncated[0]) for e in items]),
        info={"reward": tensor([float(e.info["reward"][0]) for e in items])})


class ExperienceMaker:
    """``RemoteExperienceMaker.make_experience_batch`` as far as the rollouts go: ``index`` set, micro-batches of 2
    in a balanced (not the original) order, as ``split_rollout_samples`` makes them with dynamic batching."""

    def make_experience_batch(self, rollout_samples: list[Any]) -> list[Any]:
        for i, sample in enumerate(rollout_samples):
            sample.index = [i]
        order = [[3, 0], [1, 2]]
        return [concat([rollout_samples[i] for i in part]) for part in order]


class SamplesGenerator:
    def __init__(self, rewards: list[float]):
        self.rewards, self.calls = rewards, []

    def generate_samples(self, **_: Any) -> tuple[list[Any], None, int, bool]:
        start = time.time_ns()
        samples = [sample_experience(OPENRLHF_PROMPTS[p], r, self.rewards[2 * p + k], r[-1] != EOS)
                   for p in range(2) for k, r in enumerate(OPENRLHF_RESPONSES[p])]
        self.calls.append((start, time.time_ns()))
        return samples, None, 2, False


def openrlhf_class(base: type = object) -> type:
    framework_sources("openrlhf")
    methods = framework_class("openrlhf", "openrlhf/trainer/ppo_trainer.py", "BasePPOTrainer",
                              ("train_step", "save_logs_and_checkpoints"),
                              {"time": time, "ray": SimpleNamespace(get=lambda refs: refs), "logger": logging.getLogger("o"),
                               "balance_experiences": lambda e, a: e})

    class BasePPOTrainer(base):  # type: ignore[misc, valid-type]
        """The attributes OpenRLHF's trainer has that its own train_step and save_logs_and_checkpoints touch."""

        train_step = methods.train_step
        save_logs_and_checkpoints = methods.save_logs_and_checkpoints

        def __init__(self, rewards: list[float] | None = None, fail: bool = False):
            self.args = SimpleNamespace(
                train=SimpleNamespace(dynamic_batch_enable=False), rollout=SimpleNamespace(n_samples_per_prompt=N, batch_size=2),
                actor=SimpleNamespace(model_name_or_path="OpenRLHF/Llama-3-8b-sft"), critic=SimpleNamespace(freezing_steps=0),
                logger=SimpleNamespace(logging_steps=1, wandb=SimpleNamespace(project="math", run_name="ppo-1")),
                ckpt=SimpleNamespace(save_steps=float("inf")))
            self.tokenizer, self.experience_maker = Tokenizer(), ExperienceMaker()
            self.samples_generator = SamplesGenerator(rewards or [1.0, 0.0, 0.5, 0.25])
            self.actor_model_group = SimpleNamespace(async_run_method_batch=lambda **_: [])
            self.critic_model_group, self.vllm_engines, self.wandb_logger = None, None, None
            self.tensorboard_logger = SimpleNamespace(log_train=lambda s, d: self.seen.append(dict(d)), close=lambda: None)
            self.seen: list[dict] = []
            self.fail = fail

        def _compute_rollout_stats(self, experiences: list[Any]) -> dict[str, float]:
            return {"rollout/num_samples": float(sum(len(e.prompts) for e in experiences))}

        def ppo_train(self, global_steps: int) -> dict[str, float]:
            if self.fail:
                raise RuntimeError("CUDA out of memory")
            return {"policy_loss": 0.125}

        def fit(self, steps: int) -> None:
            """PPOTrainer.fit's loop: generate, train_step, logs."""
            global_step = 0
            for _ in range(steps):
                rollout_samples, _, _, _ = self.samples_generator.generate_samples()
                status, global_step = self.train_step(rollout_samples, global_step)
                status["timing/step_total"] = sum(v for k, v in status.items() if k.startswith("timing/"))
                self.save_logs_and_checkpoints(global_step, status, {"global_step": global_step})
            self.tensorboard_logger.close()

    return BasePPOTrainer


def test_openrlhf_each_rollout_of_train_step_has_its_prompt_and_completion():
    Trainer = openrlhf_class()
    transport = InMemoryTransport()
    with TrainingTelemetry("p", "r", settings=SETTINGS, transport=transport) as tel:
        trainer = Trainer()
        logger = openrlhf.attach(trainer, tel, content=True)
        trainer.fit(steps=2)
        assert logger.completions is not None and logger.completions.published == 8
    tok = Tokenizer()
    rollouts, llms = of(transport, "ROLLOUT"), of(transport, "LLM")
    assert len(rollouts) == len(llms) == 8
    for step in (1, 2):
        start, end = trainer.samples_generator.calls[step - 1]
        for i in range(4):
            p, k = divmod(i, N)
            response, reward = OPENRLHF_RESPONSES[p][k], [1.0, 0.0, 0.5, 0.25][i]
            [rollout] = [r for r in rollouts if r["rollout_id"] == f"s{step}-{i}"]
            [llm] = [s for s in llms if s["rollout_id"] == f"s{step}-{i}"]
            assert (rollout["step"], rollout["reward"], rollout["sample_id"], rollout["completion_tokens"]) == (
                step, reward, f"s{step}-p{p}", len(response))
            assert rollout["finish_reason"] == ("stop" if response[-1] == EOS else "length")
            assert (llm["parent_span_id"], llm["trace_id"], llm["name"]) == (rollout["span_id"], rollout["trace_id"],
                                                                             "openrlhf.generate")
            assert llm["start_time_ns"] <= start <= end <= llm["end_time_ns"] < start + 10**9  # generate_samples' time
            assert llm["attributes"] == {
                "gen_ai.operation.name": "text_completion", "gen_ai.request.model": "OpenRLHF/Llama-3-8b-sft",
                "gen_ai.usage.input_tokens": len(prompt_ids(OPENRLHF_PROMPTS[p])), "gen_ai.usage.output_tokens": len(response),
                "gen_ai.response.finish_reasons": rollout["finish_reason"],
                "gen_ai.input.messages": dumps([{"role": "user", "content": OPENRLHF_PROMPTS[p]}]),
                "gen_ai.output.messages": dumps([{"role": "assistant", "content": tok.decode(response, True)}])}
    # OpenRLHF's own generated_samples still reaches its tracker: the first micro-batch's first row, prompt and completion
    assert trainer.seen[0]["generated_samples"] == [tok.decode(prompt_ids(OPENRLHF_PROMPTS[1]) + OPENRLHF_RESPONSES[1][1],
                                                               True), 0.25]


def test_openrlhf_token_ids_content_off_and_a_failed_step(monkeypatch):
    Trainer = openrlhf_class()
    transport = InMemoryTransport()
    with TrainingTelemetry("p", "r", settings=SETTINGS, transport=transport) as tel:
        trainer = Trainer(rewards=[1.0, float("nan"), 0.5, 0.25])
        logger = openrlhf.attach(trainer, tel, content=True, token_ids=True)
        trainer.fit(steps=1)
        assert logger.completions is not None and logger.completions.refused == 1  # the NaN reward's rollout
    llms = of(transport, "LLM")
    assert [s["rollout_id"] for s in llms] == ["s1-3", "s1-0", "s1-2"]  # in the micro-batches' order; s1-1 left out
    assert [json.loads(s["attributes"]["rlpulse.response_token_ids"]) for s in llms] == [
        OPENRLHF_RESPONSES[1][1], OPENRLHF_RESPONSES[0][0], OPENRLHF_RESPONSES[1][0]]
    assert json.loads(llms[0]["attributes"]["rlpulse.prompt_token_ids"]) == prompt_ids(OPENRLHF_PROMPTS[1])

    monkeypatch.delenv("RLPULSE_TRACE_CONTENT", raising=False)
    off = InMemoryTransport()
    with TrainingTelemetry("p", "r", settings=SETTINGS, transport=off) as tel:
        trainer = Trainer()
        assert openrlhf.attach(trainer, tel).completions is None
        trainer.fit(steps=1)
        assert "make_experience_batch" not in vars(trainer.experience_maker)  # content off: OpenRLHF's own, untouched
    assert off.records("spans") == []

    failed = InMemoryTransport()
    tel = TrainingTelemetry("p", "r", settings=SETTINGS, transport=failed)
    tel.start()
    trainer = Trainer(fail=True)
    openrlhf.attach(trainer, tel, owns_telemetry=True, content=True)
    with pytest.raises(RuntimeError):
        trainer.fit(steps=1)
    assert failed.records("spans") == [] and failed.records("steps")[-1]["status"] == "failed"


def test_openrlhf_install_passes_the_content_options_to_attach_only():
    class Base:
        pass

    Trainer = openrlhf_class(Base)
    transport = InMemoryTransport()
    openrlhf.register(Trainer, dict(transport=transport, settings=SETTINGS, content=True, content_limit=512))
    trainer = Trainer()
    logger = trainer.tensorboard_logger
    assert isinstance(logger, openrlhf.OpenRLHFLogger) and logger.completions is not None
    assert logger.completions.content_limit == 512
    trainer.fit(steps=1)
    assert len(of(transport, "LLM")) == 4
    assert {(s["project"], s["run_id"]) for s in transport.records("spans")} == {("math", "ppo-1")}
    assert [r["type"] for r in transport.records("steps") if r["type"] != "HEARTBEAT"] == ["RUN_START", "STEP", "RUN_END"]
    assert sys.modules.get("openrlhf") is None  # OpenRLHF's source was read, never imported
