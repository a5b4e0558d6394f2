"""The Avro records of one writer, built from the arguments its calls queued.

These run on the sender's thread: a call only checks and queues its arguments (see
``rlpulse.producers.sdk.telemetry``), because building the record costs more than the call itself.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any
from collections.abc import Callable

from rlpulse.producers.sdk.sequence import StartSequence

SPAN_NULLS: dict[str, Any] = dict(writer_sequence=0, parent_span_id=None, status_message="", attempt_id="", step=None,
                  attributes={}, term=None, outcome=None, score=None, judge_input_tokens=None, judge_output_tokens=None,
                  reward=None, term_shares={}, completion_tokens=None, max_tokens=None, clipped=None, sample_id=None,
                  policy_version=None, finish_reason=None, checkpoint_op=None, checkpoint_bytes=None)


def span_id(text: str) -> bytes:
    """Deterministic 8-byte id, so a rollout's children can name it as their parent."""
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def trace_id(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def random_span_id() -> bytes:
    # The module's generator: reseeded in a forked child, and ~15x cheaper than os.urandom's syscall.
    return random.getrandbits(64).to_bytes(8, "big")


class Records:
    """Record builders of one writer: ``build(sequence_id, args)`` for each kind of call.

    ``span_base`` and ``step_base`` are the writer's identity fields, shared with it (a forked
    child changes its ``writer_id`` in place); ``dropped`` reads the writer's drop count.
    """

    def __init__(self, run_id: str, attempt: int, span_base: dict[str, Any], step_base: dict[str, Any],
                 dropped: Callable[[], int], starts: Callable[[], StartSequence]):
        self.run_id, self.attempt = run_id, attempt
        self.span_base, self.step_base, self.dropped = span_base, step_base, dropped
        self.starts = starts  # the writer's start-order clock (a forked child's writer gets a new one)

    def rollout(self, seq: int, a: tuple) -> dict[str, Any]:
        now, step, rollout_id, reward, shares, completion_tokens, max_tokens, clipped, sample_id, duration_s, attrs = a[:11]
        version, finish = a[11:]
        ids = f"{self.run_id}/{self.attempt}/{rollout_id}"
        start = now - int(duration_s * 1e9)
        return {**self.span_base, "writer_sequence": seq, "sequence_id": self.starts().at(start), "time_ns": now,
                "trace_id": trace_id(ids), "span_id": span_id(f"{ids}/rollout"), "name": "rollout", "kind": "ROLLOUT",
                "start_time_ns": start, "end_time_ns": now, "rollout_id": rollout_id,
                "step": step, "attributes": attrs or {}, "reward": reward, "term_shares": shares,
                "completion_tokens": completion_tokens, "max_tokens": max_tokens, "clipped": clipped,
                "sample_id": sample_id, "policy_version": version, "finish_reason": finish}

    def grader(self, seq: int, a: tuple) -> dict[str, Any]:
        start, end, step, rollout_id, term, outcome, score, input_tokens, output_tokens = a
        ids = f"{self.run_id}/{self.attempt}/{rollout_id}"
        ok = outcome == "ok"
        # The span's own end is its event time: windows count a grading when it happened, not
        # when it was published.
        return {**self.span_base, "writer_sequence": seq, "sequence_id": self.starts().at(start), "time_ns": end,
                "trace_id": trace_id(ids), "span_id": random_span_id(), "parent_span_id": span_id(f"{ids}/rollout"),
                "name": f"grader {term}",
                "kind": "GRADER", "start_time_ns": start, "end_time_ns": end,
                "status": "OK" if ok else "ERROR", "status_message": "" if ok else outcome, "rollout_id": rollout_id,
                "step": step, "term": term, "outcome": outcome,
                "score": score if ok else None,  # a failed score is no score (TRL leaves it out of the mean)
                "judge_input_tokens": input_tokens, "judge_output_tokens": output_tokens}

    def span(self, seq: int, fields: dict[str, Any]) -> dict[str, Any]:
        # publish_span left out the writer's own fields (identity, writer_id, writer_sequence); a traced
        # span brings the sequence_id its tracer took when it started, any other gets its start time's
        return {**self.span_base, **fields, "writer_sequence": seq,
                "sequence_id": fields.get("sequence_id") or self.starts().at(fields["start_time_ns"])}

    def step(self, seq: int, a: tuple) -> dict[str, Any]:
        now, type_, step, step_count, tokens, duration_s, mfu, spans_sent, metrics, status, config = a
        return {**self.step_base, "sequence_id": seq, "time_ns": now, "type": type_, "step": step, "spans_sent": spans_sent,
                "metrics": metrics, "status": status, "config": config,
                "step_count": step_count, "tokens": tokens, "duration_s": duration_s,
                "throughput": tokens / duration_s if duration_s > 0 else 0.0, "mfu": mfu,
                "dropped_events": self.dropped()}
