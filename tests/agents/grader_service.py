"""A grading service in a process of its own, as a REWARD entry often runs: reads ``{"headers": ...,
"answer": ...}`` on stdin (the headers ``inject()`` gave the rollout's request), continues that
rollout's trace (``continue_trace``) with a clock 30 s behind the job's, asks a judge model, and
prints ``{"score": ...}``. ``python grader_service.py OPENAI_BASE_URL RUN_ID``, RLPULSE_* settings in
the environment (the real broker).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field

import openai

from rlpulse.producers import TrainingTelemetry
from rlpulse.producers.tracing import Tracer, continue_trace, observe_processor, trace_client

SKEW_NS = 30 * 10**9


def behind() -> int:
    return time.time_ns() - SKEW_NS


@dataclass
class Reward:  # seed 000's shape
    reward_score: float
    reward_metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RewardOutput:
    reward: Reward
    status: str = "SUCCESS"
    error: str | None = None


@observe_processor(kind="REWARD", name="grade")
def grade(client: openai.OpenAI, answer: str, *, rollout_id: str) -> RewardOutput:
    verdict = client.chat.completions.create(model="judge", messages=[
        {"role": "system", "content": "You grade answers."}, {"role": "user", "content": answer}])
    score = min(len(answer), 40) / 40
    return RewardOutput(Reward(score, {"verdict_chars": float(len(verdict.choices[0].message.content or ""))}))


def main(base_url: str, run_id: str) -> None:
    request = json.loads(sys.stdin.read())
    client = trace_client(openai.OpenAI(base_url=base_url, api_key="sk-judge-0123456789", max_retries=0))
    with TrainingTelemetry(project="stacks", run_id=run_id, clock=behind) as tel, Tracer(tel, content=True, clock=behind):
        with continue_trace(request["headers"]) as context:
            out = grade(client, request["answer"], rollout_id=context.rollout_id)
    print(json.dumps({"score": out.reward.reward_score}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
