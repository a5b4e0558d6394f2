"""A small TRL ``GRPOTrainer`` job reporting to rlpulse: the two lines marked below are all it takes.

Runs on CPU in a minute, downloading nothing: a random-init Llama (2 layers, hidden size 32) over a
word-level tokenizer built here learns, for 2 steps, to answer short. Run it where TRL is installed
(``pip install trl`` and the SDK, ``pip install rlpulse``: not in the pipeline's venv, whose
faust-streaming pins an older click than huggingface_hub needs). The broker and topic prefix come
from the usual ``RLPULSE_*`` variables; start ``rlpulse streams`` and ``rlpulse sink`` to see it in
``rlpulse ui``.

    python examples/trl_grpo.py --project math --run-id grpo-tiny
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging
from trl import GRPOConfig, GRPOTrainer

WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "star"]
STEPS = 2  # optimizer steps; each trains on its own freshly generated batch
BATCH = 8  # completions per step: 2 prompts x 4 generations (GRPO compares the 4 answers of a prompt)
GENERATIONS = 4


def tiny_model(folder: str) -> PreTrainedTokenizerFast:
    """Save a tokenizer and a random-init Llama in ``folder``, as a real checkpoint would be."""
    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<unk>"] + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    llama.generation_config.pad_token_id, llama.generation_config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    llama.save_pretrained(folder)
    tok.save_pretrained(folder)
    return tok


def brevity(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The reward function (a GRADER span per completion): fewer tokens score higher."""
    return [1.0 - len(ids) / 8 for ids in completion_ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", default="examples")
    parser.add_argument("--run-id", default="trl-grpo")
    args = parser.parse_args()
    torch.set_num_threads(2)
    hf_logging.disable_progress_bar()  # TRL logs each step's figures; no bars for saving and loading a tiny model
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as folder:
        tok = tiny_model(folder)
        prompts = Dataset.from_dict({"prompt": [" ".join(WORDS[i:i + 3]) for i in range(len(WORDS) - 2)]})
        config = GRPOConfig(output_dir=folder, use_cpu=True, bf16=False, seed=0, report_to="none", save_strategy="no",
                            disable_tqdm=True, logging_steps=1, max_steps=STEPS, per_device_train_batch_size=BATCH,
                            num_generations=GENERATIONS, max_completion_length=6, learning_rate=5e-3, beta=0.0)
        trainer = GRPOTrainer(model=folder, processing_class=tok, reward_funcs=[brevity], args=config,
                              train_dataset=prompts)
        # -- rlpulse: these two lines, before train() ------------------------------------------------
        from rlpulse.producers.integrations.trl import instrument
        instrument(trainer, project=args.project, run_id=args.run_id)
        # ------------------------------------------------------------------------------------------
        trainer.train()  # RUN_END says how it ended: finished, failed (an exception) or cancelled (Ctrl-C)
    print(f"trained {STEPS} steps of {BATCH} completions for {args.project}/{args.run_id}")


if __name__ == "__main__":
    main()
