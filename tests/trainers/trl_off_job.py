"""The reward functions of ``trl_grpo_job.py`` (written the integration's way: ``GraderFailure``
returned and raised, None, NaN, a plain exception) in a real TRL ``GRPOTrainer`` on CPU, three ways:

* ``plain``: no ``instrument`` at all, as a user who turned rlpulse off by deleting the line: TRL
  takes the returned ``GraderFailure`` as a reward and fails (the job records how);
* ``off``: ``instrument(trainer, ..., enabled=False)``: telemetry off, the judge kept;
* ``on``: ``instrument(trainer, ...)`` into an ``InMemoryTransport`` (no broker).

Run in the trainer venv (``tests/trainers/trainer_venv.py``). Writes, to the JSON file named on its
command line, how training ended (``error``: the exception's type and text, or None), TRL's
``log_history``, and for ``on`` the count of GRADER spans published. The model, tokenizer and prompts
are ``trl_grpo_job``'s; ``MAX_STEPS`` is smaller.

    python trl_off_job.py OUT.json plain|off|on
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer

import trl_grpo_job as job

MAX_STEPS = 6  # generations at global_step 0, 2 (length_reward raises GraderFailure) and 4 (judge_reward raises RuntimeError)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("mode", choices=("plain", "off", "on"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    tok = job.tokenizer()
    result: dict[str, Any] = {"mode": args.mode, "error": None}
    with tempfile.TemporaryDirectory(prefix="trl-off-job-") as output_dir:
        config = GRPOConfig(
            output_dir=output_dir, use_cpu=True, bf16=False, seed=0, report_to="none", save_strategy="no",
            disable_tqdm=True, logging_steps=1, max_steps=MAX_STEPS, learning_rate=5e-3, beta=0.04,
            per_device_train_batch_size=32, steps_per_generation=job.STEPS_PER_GENERATION,
            num_generations=job.NUM_GENERATIONS, max_completion_length=job.MAX_COMPLETION, temperature=1.0,
            reward_weights=[1.0, 0.5], log_completions=False)
        model_dir = f"{output_dir}/tiny-llama"
        job.model(tok).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        trainer = GRPOTrainer(model=model_dir, processing_class=tok, reward_funcs=[job.length_reward, job.judge_reward],
                              args=config, train_dataset=job.prompts())
        transport = None
        if args.mode != "plain":
            from rlpulse.producers import InMemoryTransport
            from rlpulse.producers.integrations.trl import instrument

            transport = InMemoryTransport() if args.mode == "on" else None
            hooks = instrument(trainer, project="trl-off", run_id=args.mode, enabled=args.mode == "on", transport=transport)
            result["instrument_returned"] = type(hooks).__name__
        try:
            trainer.train()
        except Exception as exc:  # noqa: BLE001 - what TRL raised is the record
            result["error"] = [type(exc).__name__, str(exc)[:300]]
        result["log_history"] = trainer.state.log_history
        if transport is not None:
            result["grader_spans"] = sum(1 for s in transport.records("spans") if s["kind"] == "GRADER")
    with open(args.out, "w") as out:
        json.dump(result, out, indent=1, allow_nan=True)


if __name__ == "__main__":
    main()
