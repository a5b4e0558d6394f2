"""A real TRL ``GRPOTrainer`` job on CPU, instrumented as a user would: two lines (marked below).

Run in the trainer venv (``tests/trainers/trainer_venv.py``), never in the pipeline's: it imports
the SDK, TRL, transformers and torch only. Nothing is downloaded: the model is a random-init
Llama (hidden size 32, 2 layers) over a word-level tokenizer built here, with EOS and pad tokens,
saved to a temporary folder that the trainer loads it from (and its KL reference model, beta > 0).
The broker and topics come from the ``RLPULSE_*`` variables the caller sets (``Settings.load``).

Each generation is the 16 prompts x 4 completions of at most ``MAX_COMPLETION`` tokens; a
generation feeds ``STEPS_PER_GENERATION`` optimizer steps, so TRL logs a batch's figures at every
other step. A completion that has not ended on EOS by the limit is truncated (TRL's
``completions/clipped_ratio``); with 8 words besides EOS, about a third end on their own.

The two reward functions fail on purpose, by a plan fixed by ``global_step`` and the completion's
index, with every cause: a ``GraderFailure`` raised for a whole call or returned for one
completion, None and NaN (ungradable), and a plain exception (error). At one step a function's
failure meets the other's for the same completions: those are unscorable (TRL leaves them out of
``reward``). The job counts what it did itself and writes, to the JSON file named on its command
line, ``trainer.state.log_history`` and per generation (keyed by ``global_step`` when generated):
the completions scored and, per reward function, the failures by cause; under ``arguments``, the names
of its ``GRPOConfig.to_dict()`` (the run's settings, which the integration sends); and, under ``texts``, what TRL
gave its reward functions (``prompts``, ``completions``, ``completion_ids``) with the prompts' ids as
TRL tokenizes a plain-text prompt (``processing_class(text=prompts)``). The integration publishes
each rollout's prompt and completion (content on, token ids too), which the test compares with those.

    python trl_grpo_job.py OUT.json --project P --run-id R
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections import Counter, defaultdict
from typing import Any

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from rlpulse.producers.integrations.trl import GraderFailure

WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "star"]
SPECIAL = ["<pad>", "<eos>", "<unk>"]
MAX_COMPLETION = 6
NUM_GENERATIONS = 4
STEPS_PER_GENERATION = 2
MAX_STEPS = 10
PROMPTS = 16
HUB_TOKEN = "hf_rlpulse_job_token"  # a token the run's settings must never carry (nothing is pushed: push_to_hub is off)

# What the job did, per generation (global_step when generated): completions scored, failures by function and cause.
RECORD: dict[int, dict[str, Any]] = defaultdict(lambda: {"rollouts": 0, "failures": defaultdict(Counter)})
TEXTS: dict[int, dict[str, Any]] = {}  # per generation: what TRL gave the reward functions


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def model(tok: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    llama = LlamaForCausalLM(config)
    llama.generation_config.pad_token_id = tok.pad_token_id
    llama.generation_config.eos_token_id = tok.eos_token_id
    return llama


def prompts() -> Dataset:
    return Dataset.from_dict({"prompt": [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(3)) for i in range(PROMPTS)]})


def _note(step: int, term: str, outcomes: list[str]) -> None:
    for outcome in outcomes:
        if outcome != "ok":
            RECORD[step]["failures"][term][outcome] += 1


def length_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]], trainer_state: Any,
                  **_: Any) -> list[Any]:
    """A short answer scores higher: 1 - tokens / 8 (exact in float32). Fails: the whole call at
    global_step 2 (unavailable); completion 3 of each 16 times out, completion 7 is None."""
    k = trainer_state.global_step
    RECORD[k]["rollouts"] = len(completion_ids)
    TEXTS[k] = {"prompts": list(prompts), "completions": list(completions),
                "completion_ids": [[int(t) for t in ids] for ids in completion_ids]}
    if k == 2:
        _note(k, "length_reward", ["unavailable"] * len(completion_ids))
        raise GraderFailure("unavailable", "the length service is down")
    values: list[Any] = []
    for i, ids in enumerate(completion_ids):
        if i % 16 == 3:
            values.append(GraderFailure("timeout"))
        elif i % 16 == 7:
            values.append(None)
        else:
            values.append(1.0 - len(ids) / 8)
    _note(k, "length_reward", ["timeout" if isinstance(x, GraderFailure) else "ungradable" if x is None else "ok"
                               for x in values])
    return values


def judge_reward(completions: list[str], completion_ids: list[list[int]], trainer_state: Any, **_: Any) -> list[Any]:
    """A judge: the share of words that name a colour. Fails: raises at global_step 4 (error);
    completion 5 of each 16 is unreadable; at global_step 6 completion 7 times out (with
    length_reward's None there: unscorable); at global_step 8 completion 9 is NaN (ungradable)."""
    k = trainer_state.global_step
    if k == 4:
        _note(k, "judge_reward", ["error"] * len(completion_ids))
        raise RuntimeError("the judge crashed")
    values: list[Any] = []
    outcomes = []
    for i, text in enumerate(completions):
        words = text.split()
        if i % 16 == 5:
            values.append(GraderFailure("unreadable"))
            outcomes.append("unreadable")
        elif k == 6 and i % 16 == 7:
            values.append(GraderFailure("timeout"))
            outcomes.append("timeout")
        elif k == 8 and i % 16 == 9:
            values.append(math.nan)
            outcomes.append("ungradable")
        else:
            values.append(sum(w in ("red", "green", "blue") for w in words) / max(len(words), 1))
            outcomes.append("ok")
    _note(k, "judge_reward", outcomes)
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSON file to write: log_history and the job's record")
    parser.add_argument("--project", default="trl-job")
    parser.add_argument("--run-id", default="grpo")
    args = parser.parse_args()
    started = time.monotonic()
    torch.set_num_threads(2)
    tok = tokenizer()
    with tempfile.TemporaryDirectory(prefix="trl-job-") as output_dir:
        config = GRPOConfig(
            output_dir=output_dir, use_cpu=True, bf16=False, seed=0, report_to="none", save_strategy="no",
            disable_tqdm=True, logging_steps=1, max_steps=MAX_STEPS, learning_rate=5e-3, beta=0.04,
            per_device_train_batch_size=32, steps_per_generation=STEPS_PER_GENERATION, num_generations=NUM_GENERATIONS,
            max_completion_length=MAX_COMPLETION, temperature=1.0, reward_weights=[1.0, 0.5], log_completions=False,
            hub_token=HUB_TOKEN,
        )
        # saved and named by its folder, as a user names a checkpoint: TRL loads its KL reference model from it
        model_dir = f"{output_dir}/tiny-llama"
        model(tok).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        trainer = GRPOTrainer(model=model_dir, processing_class=tok, reward_funcs=[length_reward, judge_reward],
                              args=config, train_dataset=prompts())
        # -- the integration: these two lines ------------------------------------------------------------
        from rlpulse.producers.integrations.trl import instrument
        instrument(trainer, project=args.project, run_id=args.run_id, content=True, token_ids=True)
        # ------------------------------------------------------------------------------------------------
        trainer.train()
    record = {str(k): {"rollouts": r["rollouts"], "failures": {t: dict(c) for t, c in r["failures"].items()}}
              for k, r in sorted(RECORD.items())}
    texts = {str(k): {**t, "prompt_ids": [list(ids) for ids in tok(text=t["prompts"])["input_ids"]]}
             for k, t in sorted(TEXTS.items())}
    with open(args.out, "w") as out:
        json.dump({"log_history": trainer.state.log_history, "generations": record, "texts": texts,
                   "arguments": sorted(config.to_dict()), "hub_token": HUB_TOKEN,
                   "config": {"num_generations": NUM_GENERATIONS, "steps_per_generation": STEPS_PER_GENERATION,
                              "max_steps": MAX_STEPS, "max_completion_length": MAX_COMPLETION,
                              "reward_funcs": ["length_reward", "judge_reward"], "reward_weights": [1.0, 0.5]},
                   "seconds": time.monotonic() - started}, out, indent=1, allow_nan=True)


if __name__ == "__main__":
    main()
