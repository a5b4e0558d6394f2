"""A synthetic training workload with known ground truth, for the end-to-end drain.

Runs of one project, each with steps of rollouts; every rollout has a ROLLOUT span and one
GRADER span per term whose outcome is ok or a failure cause. The generator yields the Kafka
messages a fleet of SDK writers would have published (containers of one run's records, keyed
``project/run_id``), interleaved across runs so the streams hold every run's state at once, as
with that many concurrent jobs. :class:`Truth` counts what was generated from the records
themselves, so a bug in the generator's bookkeeping cannot hide a wrong figure downstream.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterator

from rlpulse.schemas.catalogue import engine_key, run_key

OUTCOMES = ("ok", "timeout", "unavailable", "unreadable", "ungradable")
CAUSES = OUTCOMES[1:]
NS = 1_000_000_000


@dataclass(frozen=True)
class WorkloadConfig:
    project: str = "bench"
    runs: int = 1000
    steps: int = 10
    rollouts: int = 50  # per step; each has one ROLLOUT span and one GRADER span per term
    terms: tuple[str, ...] = ("judge",)
    steps_per_container: int = 2  # one span container = this many steps of one run (200 records by default)
    span_s: float = 240.0  # a run's events spread over this many seconds of event time ...
    end_ago_s: float = 60.0  # ... ending this long before now, so every window is past its lateness
    outcome_weights: tuple[float, ...] = (0.80, 0.08, 0.05, 0.04, 0.03)  # in OUTCOMES order
    clip_rate: float = 0.1
    max_tokens: int = 1024
    seed: int = 7
    # What users send besides rollouts and graders (traced calls, trainer scalars, engine samples), as the product gets:
    traced_every: int = 5  # every n-th rollout is a traced agent's: an LLM and a TOOL span under it (0: none)
    trainer_metrics: int = 8  # scalars on each STEP event (step_completed(metrics=...)), to step_metrics
    engine_samples: bool = True  # one vLLM engine sample per run and step, on the hardware topic

    @property
    def traced_per_step(self) -> int:
        return len(range(0, self.rollouts, self.traced_every)) if self.traced_every else 0

    @property
    def events_per_run(self) -> int:
        spans = self.steps * (self.rollouts * (1 + len(self.terms)) + 2 * self.traced_per_step)
        return spans + self.steps + 2 + self.steps * self.engine_samples  # + RUN_START, RUN_END, engine samples

    @property
    def events(self) -> int:
        return self.runs * self.events_per_run


@dataclass
class Message:
    """One Kafka message: a container of ``records`` of one run, on topic ``<prefix>.<short>``."""

    short: str  # spans or steps
    key: str
    record: str  # the Avro record name: Span or Step
    records: list[dict[str, Any]]


@dataclass
class Truth:
    """What the streams must compute from the records they were given, counted from those records."""

    failures: Counter = field(default_factory=Counter)  # (run_id, term, cause) -> failed grader calls
    graded: Counter = field(default_factory=Counter)  # (run_id, term) -> grader calls
    rollouts: Counter = field(default_factory=Counter)  # (run_id, step) -> ROLLOUT spans
    clipped: Counter = field(default_factory=Counter)  # (run_id, step) -> clipped ROLLOUT spans
    events: Counter = field(default_factory=Counter)  # topic short -> records
    messages: Counter = field(default_factory=Counter)  # topic short -> containers
    kinds: Counter = field(default_factory=Counter)  # span kind -> spans
    metrics: int = 0  # trainer scalars on STEP events: rows of step_metrics

    def add(self, message: Message) -> None:
        self.messages[message.short] += 1
        self.events[message.short] += len(message.records)
        if message.short == "steps":
            self.metrics += sum(len(r["metrics"]) for r in message.records)
        if message.short != "spans":
            return
        for r in message.records:
            self.kinds[r["kind"]] += 1
            if r["kind"] == "GRADER":
                self.graded[(r["run_id"], r["term"])] += 1
                if r["outcome"] != "ok":
                    self.failures[(r["run_id"], r["term"], r["outcome"])] += 1
            elif r["kind"] == "ROLLOUT":
                self.rollouts[(r["run_id"], r["step"])] += 1
                self.clipped[(r["run_id"], r["step"])] += bool(r["clipped"])

    def step_stats(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(run_id, step) -> (rollouts, clipped)."""
        return {k: (n, self.clipped[k]) for k, n in self.rollouts.items()}

    def summary(self) -> dict[str, int]:
        return {"span_events": self.events["spans"], "step_events": self.events["steps"],
                "hardware_events": self.events["hardware"], "llm_spans": self.kinds["LLM"],
                "tool_spans": self.kinds["TOOL"], "trainer_metrics": self.metrics,
                "span_messages": self.messages["spans"], "step_messages": self.messages["steps"],
                "grader_failures": sum(self.failures.values()), "graded": sum(self.graded.values()),
                "rollouts": sum(self.rollouts.values()), "clipped": sum(self.clipped.values())}


class Writer:
    """One SDK instance's identity: a random writer_id and a sequence per topic (DESIGN, wire format)."""

    def __init__(self, rng: random.Random):
        self.writer_id = rng.randbytes(8).hex()
        self._seq = {"spans": 0, "steps": 0}

    def next(self, short: str) -> int:
        self._seq[short] += 1
        return self._seq[short]

    def last(self, short: str) -> int:
        return self._seq[short]


def _base(project: str, run_id: str, time_ns: int, writer: Writer, short: str) -> dict[str, Any]:
    seq = writer.next(short)
    base = {"project": project, "run_id": run_id, "attempt": 1, "stage": "", "time_ns": time_ns,
            "writer_id": writer.writer_id, "sequence_id": seq}
    if short == "spans":  # as the SDK writes them: publish order in writer_sequence (the start order is
        base["writer_sequence"] = seq  # the same here: each span is published as it starts)
    return base


def span_record(project: str, run_id: str, writer: Writer, *, kind: str, time_ns: int, step: int, rollout_id: str,
                trace_id: bytes, span_id: bytes, parent: bytes | None, **typed: Any) -> dict[str, Any]:
    """A Span with every field of span.avsc set (defaults where the kind has none)."""
    outcome = typed.get("outcome")
    failed = outcome not in (None, "ok")
    record = _base(project, run_id, time_ns, writer, "spans")
    record.update({
        "trace_id": trace_id, "span_id": span_id, "parent_span_id": parent,
        "name": "rollout" if kind == "ROLLOUT" else f"grader {typed.get('term')}", "kind": kind,
        "start_time_ns": time_ns - 500_000_000, "end_time_ns": time_ns, "status": "ERROR" if failed else "OK",
        "status_message": outcome if failed else "", "rollout_id": rollout_id, "attempt_id": "", "step": step,
        "attributes": {}, "term": None, "outcome": None, "score": None, "judge_input_tokens": None,
        "judge_output_tokens": None, "reward": None, "term_shares": {}, "completion_tokens": None,
        "max_tokens": None, "clipped": None, "sample_id": None, "policy_version": None, "finish_reason": None,
        "checkpoint_op": None, "checkpoint_bytes": None, "metrics": {},
    })
    record.update(typed)
    return record


def step_record(project: str, run_id: str, writer: Writer, *, type_: str, time_ns: int, step: int,
                step_count: int) -> dict[str, Any]:
    record = _base(project, run_id, time_ns, writer, "steps")
    record.update({"type": type_, "trainer": "rl", "step": step, "step_count": step_count, "tokens": 0, "spans_sent": 0,
                   "duration_s": 0.0, "throughput": 0.0, "mfu": None, "dropped_events": 0, "metrics": {},
                   "status": "finished" if type_ == "RUN_END" else None, "config": {}})
    if type_ == "STEP":
        record.update(tokens=100_000, duration_s=20.0, throughput=5000.0, mfu=0.4)
    return record


TRAINER_METRICS = ("loss", "kl", "entropy", "grad_norm", "clip_ratio/low_mean", "clip_ratio/high_mean",
                   "actor/pg_clipfrac", "learning_rate", "actor/ppo_kl", "critic/vf_loss")


def trainer_metrics(rng: random.Random, count: int) -> dict[str, float]:
    """A trainer's own scalars for one step, as TRL or verl log them."""
    names = TRAINER_METRICS[:count] + tuple(f"custom/m{i}" for i in range(count - len(TRAINER_METRICS)))
    return {name: round(rng.uniform(-1.0, 1.0), 6) for name in names}


def engine_sample(project: str, run_id: str, time_ns: int, rng: random.Random) -> dict[str, Any]:
    """One scrape of the run's vLLM engine (rlpulse engine-poller), every figure set."""
    return {"project": project, "run_id": run_id, "attempt": 1, "pod": f"{run_id}-rollout-0",
            "url": "http://127.0.0.1:8000/metrics", "engine": "0", "model_name": "policy", "time_ns": time_ns,
            "interval_s": 10.0, "requests_running": float(rng.randrange(0, 64)), "requests_waiting": float(rng.randrange(0, 8)),
            "kv_cache_usage": round(rng.random() * 0.9, 3), "preemptions_per_s": 0.0,
            "prompt_tokens_per_s": round(rng.uniform(1e3, 1e4), 1), "generation_tokens_per_s": round(rng.uniform(1e3, 1e4), 1),
            "ttft_count": rng.randrange(10, 100), "ttft_p50_s": 0.05, "ttft_p90_s": 0.12, "ttft_p99_s": 0.3, "awake": 1,
            "counter_resets": 0, "prefix_cache_queries": rng.randrange(1000, 10_000),
            "prefix_cache_hit_rate": round(rng.random(), 3), "queue_time_count": rng.randrange(10, 100),
            "queue_time_mean_s": 0.02, "queue_time_p50_s": 0.01, "queue_time_p90_s": 0.05, "itl_count": rng.randrange(1000, 5000),
            "itl_mean_s": 0.015, "itl_p50_s": 0.012, "itl_p90_s": 0.03}


def traced_spans(project: str, run_id: str, writer: Writer, rng: random.Random, step: int, rollout_id: str,
                 trace_id: bytes, parent: bytes, time_ns: int) -> list[dict[str, Any]]:
    """A traced agent's LLM call and tool call under its rollout, with GenAI attribute names (no content)."""
    llm = span_record(project, run_id, writer, kind="LLM", time_ns=time_ns - 300_000_000, step=step, rollout_id=rollout_id,
                      trace_id=trace_id, span_id=rng.randbytes(8), parent=parent, name="chat policy",
                      attributes={"gen_ai.operation.name": "chat", "gen_ai.request.model": "policy",
                                  "gen_ai.usage.input_tokens": str(rng.randrange(200, 900)),
                                  "gen_ai.usage.output_tokens": str(rng.randrange(16, 512)),
                                  "gen_ai.response.finish_reasons": "tool_calls"})
    tool = span_record(project, run_id, writer, kind="TOOL", time_ns=time_ns - 200_000_000, step=step, rollout_id=rollout_id,
                       trace_id=trace_id, span_id=rng.randbytes(8), parent=parent, name="execute_tool search",
                       attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search"})
    return [llm, tool]


def rollout_spans(project: str, run_id: str, writer: Writer, rng: random.Random, config: WorkloadConfig,
                  step: int, index: int, time_ns: int) -> list[dict[str, Any]]:
    """The GRADER spans of one rollout (one per term) followed by its ROLLOUT span, as the SDK orders them."""
    rollout_id = f"s{step}-r{index}"
    trace_id, span_id = rng.randbytes(16), rng.randbytes(8)
    out = []
    if config.traced_every and index % config.traced_every == 0:
        out += traced_spans(project, run_id, writer, rng, step, rollout_id, trace_id, span_id, time_ns)
    for term in config.terms:
        outcome = rng.choices(OUTCOMES, config.outcome_weights)[0]
        out.append(span_record(project, run_id, writer, kind="GRADER", time_ns=time_ns, step=step, rollout_id=rollout_id,
                               trace_id=trace_id, span_id=rng.randbytes(8), parent=span_id, term=term, outcome=outcome,
                               score=round(rng.random(), 3) if outcome == "ok" else 0.0,
                               judge_input_tokens=800, judge_output_tokens=40))
    clipped = rng.random() < config.clip_rate
    tokens = config.max_tokens if clipped else rng.randrange(16, config.max_tokens)
    reward = round(rng.random(), 3)
    out.append(span_record(project, run_id, writer, kind="ROLLOUT", time_ns=time_ns + 1_000_000, step=step,
                           rollout_id=rollout_id, trace_id=trace_id, span_id=span_id, parent=None, reward=reward,
                           term_shares={t: reward / len(config.terms) for t in config.terms},
                           completion_tokens=tokens, max_tokens=config.max_tokens, clipped=clipped,
                           sample_id=f"s{step}-p{index // 8}"))
    return out


def messages(config: WorkloadConfig, now_ns: int) -> Iterator[Message]:
    """The backlog: for each chunk of steps, one span and one step container per run, runs interleaved.

    Each run has its own writer; a run's events are in time and sequence order within each topic.
    """
    rng = random.Random(config.seed)
    runs = [f"r{i:05d}" for i in range(config.runs)]
    writers = {run: Writer(rng) for run in runs}
    step_ns = int(config.span_s / config.steps * NS)
    starts = {run: now_ns - int((config.end_ago_s + config.span_s) * NS) - (i % 100) * 100_000_000
              for i, run in enumerate(runs)}  # staggered by up to 10 s earlier, so the runs' windows differ
    chunks = math.ceil(config.steps / config.steps_per_container)
    for chunk in range(chunks):
        first = chunk * config.steps_per_container
        chunk_steps = range(first, min(first + config.steps_per_container, config.steps))
        for run in runs:
            writer, start, key = writers[run], starts[run], run_key(config.project, run)
            spans: list[dict[str, Any]] = []
            steps: list[dict[str, Any]] = []
            hardware: list[dict[str, Any]] = []
            if chunk == 0:
                steps.append(step_record(config.project, run, writer, type_="RUN_START", time_ns=start, step=-1, step_count=0))
            for step in chunk_steps:
                step_start = start + step * step_ns
                for i in range(config.rollouts):
                    t = step_start + (i + 1) * step_ns // (config.rollouts + 2)
                    spans.extend(rollout_spans(config.project, run, writer, rng, config, step, i, t))
                steps.append(step_record(config.project, run, writer, type_="STEP", time_ns=step_start + step_ns - 1,
                                         step=step, step_count=step + 1))
                steps[-1]["metrics"] = trainer_metrics(rng, config.trainer_metrics)
                if config.engine_samples:
                    hardware.append(engine_sample(config.project, run, step_start + step_ns // 2, rng))
            if chunk == chunks - 1:
                end = step_record(config.project, run, writer, type_="RUN_END", time_ns=start + config.steps * step_ns,
                                  step=-1, step_count=config.steps)
                end["spans_sent"] = writer.last("spans")  # as the SDK's RUN_END says: its spans are all in then
                steps.append(end)
            yield Message("spans", key, "Span", spans)
            yield Message("steps", key, "Step", steps)
            if hardware:  # keyed as the engine-poller keys them; one container a chunk
                sample = hardware[0]
                yield Message("hardware", engine_key(sample["pod"], sample["url"], sample["engine"]), "EngineSample", hardware)


class LiveRuns:
    """Live load for the latency phase: runs publishing spans stamped with the current time.

    Each call to :meth:`spans` gives the next run (round robin) a container of ``per_message``
    records whose ``time_ns`` is ``now_ns``, so event-to-row latency is measured from it.
    """

    def __init__(self, config: WorkloadConfig, runs: int, per_message: int):
        self.config = config
        self.rng = random.Random(config.seed + 1)
        self.runs = [f"live{i:04d}" for i in range(runs)]
        self.writers = {run: Writer(self.rng) for run in self.runs}
        self.step = {run: 0 for run in self.runs}
        self.index = {run: 0 for run in self.runs}
        self.per_message = per_message
        self._next = 0

    def _step_message(self, run: str, type_: str, now_ns: int, step: int = -1) -> Message:
        record = step_record(self.config.project, run, self.writers[run], type_=type_, time_ns=now_ns, step=step,
                             step_count=self.step[run])
        return Message("steps", run_key(self.config.project, run), "Step", [record])

    def starts(self, now_ns: int) -> list[Message]:
        return [self._step_message(run, "RUN_START", now_ns) for run in self.runs]

    def ends(self, now_ns: int) -> list[Message]:
        return [self._step_message(run, "RUN_END", now_ns) for run in self.runs]

    def spans(self, now_ns: int) -> list[Message]:
        """The next run's span container; with a STEP message when that run completes a step."""
        run = self.runs[self._next]
        self._next = (self._next + 1) % len(self.runs)
        writer, out = self.writers[run], []
        records: list[dict[str, Any]] = []
        while len(records) < self.per_message:
            records.extend(rollout_spans(self.config.project, run, writer, self.rng, self.config, self.step[run],
                                         self.index[run], now_ns))
            self.index[run] += 1
            if self.index[run] == self.config.rollouts:
                self.index[run] = 0
                self.step[run] += 1
                out.append(self._step_message(run, "STEP", now_ns, self.step[run] - 1))
        return [Message("spans", run_key(self.config.project, run), "Span", records), *out]
