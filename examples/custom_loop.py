"""A hand-written training loop reporting to rlpulse with the SDK's three calls.

Needs a Kafka broker (``rlpulse services up``); to see figures, the pipeline too (``rlpulse streams``
and ``rlpulse sink``, or ``make demo`` once). The broker, topic prefix and the rest come from the
usual ``RLPULSE_*`` variables (``RLPULSE_KAFKA_BOOTSTRAP``, ``RLPULSE_TOPIC_PREFIX``, ...).

    python examples/custom_loop.py --project my-project --run-id my-run
"""

from __future__ import annotations

import argparse
import random

from rlpulse import TrainingTelemetry

STEPS = 3  # optimizer steps
ROLLOUTS = 4  # completions sampled per step
MAX_TOKENS = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", default="examples")
    parser.add_argument("--run-id", default="custom-loop")
    args = parser.parse_args()
    rng = random.Random(0)
    # Leaving the block flushes what is buffered and sends RUN_END ("failed" if the loop raised).
    with TrainingTelemetry(project=args.project, run_id=args.run_id, trainer="rl") as tel:
        for step in range(STEPS):
            for i in range(ROLLOUTS):
                rollout_id = f"s{step}-r{i}"
                tokens = rng.randint(20, MAX_TOKENS)  # stands for your policy's generate()
                score = round(rng.random(), 3)  # stands for your reward function or judge
                # One GRADER span per reward term; a failed call says why (timeout, unavailable, ...).
                tel.grader(step=step, rollout_id=rollout_id, term="judge", outcome="ok", score=score, duration_s=0.2)
                # One ROLLOUT span per completion: completion_tokens == max_tokens counts as clipped.
                tel.rollout(step=step, rollout_id=rollout_id, reward=score, term_shares={"judge": score},
                            completion_tokens=tokens, max_tokens=MAX_TOKENS, sample_id=f"prompt-{step}-{i // 2}")
            loss = 1.0 / (step + 1)  # stands for your optimizer step
            # The step is done: step_count goes up (the stall alert watches it); metrics are its scalars.
            tel.step_completed(step=step, tokens=ROLLOUTS * MAX_TOKENS, duration_s=1.5,
                               metrics={"loss": loss, "kl": 0.01 * step, "lr": 1e-5})
    print(f"published {STEPS} steps of {ROLLOUTS} rollouts each for {args.project}/{args.run_id}")


if __name__ == "__main__":
    main()
