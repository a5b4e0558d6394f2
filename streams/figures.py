"""The figures of one step and of one grader window, as accumulators a run's state holds.

Each accumulator takes spans one at a time (``add``), round-trips through plain JSON types
(``to_dict`` / ``from_dict``: a Faust table value travels through a changelog topic), and turns
into the Avro records the streams publish. Semantics are those of seed 001: what each figure is
and when it is emitted is in docs/figures-and-alerts.md ("The figures").
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from rlpulse.schemas.enums import FAILURE_CAUSES as CAUSES  # grader failure causes (seed 001)
from rlpulse.streams import compiled
from rlpulse.streams.histograms import REWARD_BOUNDS, ExpHistogram, RewardHistogram

NS = 1_000_000_000
UNKNOWN_CAUSE = "unknown"  # an outcome outside the contract still counts as a failure, under this cause
_SORTED_CAUSES: dict[tuple[str, ...], tuple[frozenset[str], list[str]]] = {}  # CAUSES -> (as a set, sorted)
_DURATION_QS = (0.5, 0.9, 0.99)  # the grader-call duration percentiles a window and a step's term report
MAX_SAMPLES = 4096  # distinct sample ids kept per step; more are counted in samples_dropped, not kept
MAX_TERMS = 64  # the SDK's cap on distinct reward terms per run; more are counted in terms_dropped
MAX_NAME = 256  # the SDK's cap on ids and names; a longer term or sample id from another writer is not kept
MAX_JUDGE_TOKENS = 2**40  # a judge's tokens in one reply beyond this are not a count: left out of the sums
MAX_SUM = 2**63 - 1  # an Avro long


class StepFigures:
    """Rollouts of one (attempt, step): clipped ratio, reward and length histograms, sample groups."""

    __slots__ = ("rollouts", "failed", "clipped", "reward_sum", "reward_sumsq", "completions", "completion_sum",
                 "completion_min", "completion_max", "hist", "lengths", "samples", "samples_dropped",
                 "terms_dropped", "end_ns", "last_ns", "closed", "dirty", "stale_n", "stale_sum", "stale_max", "graders",
                 "_body")

    def __init__(self) -> None:
        self.rollouts = self.clipped = self.completions = self.completion_sum = 0
        self.failed = 0  # ROLLOUT spans of the step with status ERROR: attempted, not scored, in no reward figure
        self.reward_sum = self.reward_sumsq = 0.0
        self.completion_min: int | None = None
        self.completion_max: int | None = None
        self.hist: dict[str, RewardHistogram] = {}
        # the step's grader calls per term (GRADER spans that name the step): durations, causes, tokens
        self.graders: dict[str, GraderWindow] = {}
        self.lengths = ExpHistogram()
        self.samples: dict[str, list] = {}  # sample_id -> [n, min, max, sum, sum of squares]
        self.samples_dropped = self.terms_dropped = 0
        # staleness (step - policy_version) of the rollouts that name the policy that generated them
        self.stale_n = self.stale_sum = 0
        self.stale_max: int | None = None
        self.end_ns: int | None = None  # event time the step ended: its STEP event, or a later step's first rollout
        self.last_ns = 0  # event time of its latest rollout: when an alert about the step was first seen
        self.closed = False  # emitted as complete (the alert rules have seen it)
        self.dirty = False  # changed since it was emitted
        # ``encode``'s JSON of everything but the fields runs.py sets (end, closed, dirty) and the
        # grader calls, kept until the next rollout: a run's state is written once per message, and
        # most messages leave most of a run's steps unchanged.
        self._body: orjson.Fragment | None = None

    @staticmethod
    def invalid(span: dict[str, Any]) -> str | None:
        """Why a ROLLOUT span cannot be counted (None if it can), checked before anything is changed.

        The SDK refuses these at the call; another writer's record must not crash the worker
        or leave a step half-updated.
        """
        reward = span["reward"]
        if not -math.inf < reward < math.inf:  # NaN fails both comparisons
            return f"reward {reward!r} is not finite"
        shares = span.get("term_shares")
        # one C-level sum instead of a Python loop: NaN or an infinity in any share makes it non-finite
        if shares and not -math.inf < sum(shares.values()) < math.inf:
            return f"term_shares {shares!r} are not all finite"
        tokens = span.get("completion_tokens")
        if tokens is not None and tokens < 0:
            return f"completion_tokens {tokens} is negative"
        version = span.get("policy_version")
        if version is not None and version < 0:  # the SDK's bound; keeps step - version an Avro long
            return f"policy_version {version} is negative"
        return None

    def add(self, span: dict[str, Any]) -> None:
        self.add_many([span])

    def add_many(self, spans: list[dict[str, Any]]) -> None:
        """The ROLLOUT spans of one message for this step, in their order (each checked: ``invalid``).

        Every figure comes out as if they were added one at a time (the same sums, bit for bit,
        the histograms' terms created in the order first seen), in one loop over the spans and
        one batch add per histogram."""
        if compiled.LOOPS is not None:  # this method line for line, in C (streams/_loops.pyx)
            compiled.LOOPS.step_add_many(self, spans, RewardHistogram, MAX_TERMS, MAX_NAME, MAX_SAMPLES)
            return
        self._body = None
        hist = self.hist
        if "total" not in hist:
            hist["total"] = RewardHistogram()
        rewards: list[float] = []
        # each histogram's values in the order they come (a term named "total" shares the rewards' list)
        shares_of: dict[str, list[float]] = {"total": rewards}
        lengths: list[int] = []
        last_ns, clipped, total, squares = self.last_ns, 0, self.reward_sum, self.reward_sumsq
        lo, hi, tokens_sum = self.completion_min, self.completion_max, self.completion_sum
        samples = self.samples
        for span in spans:
            t = span["time_ns"]
            if t > last_ns:
                last_ns = t
            reward = float(span["reward"])
            if span.get("clipped"):
                clipped += 1
            total += reward
            squares += reward * reward
            rewards.append(reward)
            shares = span.get("term_shares")
            if shares:
                for term, share in shares.items():
                    values = shares_of.get(term)
                    if values is None:
                        if term not in hist:
                            if len(hist) > MAX_TERMS or len(term) > MAX_NAME:
                                self.terms_dropped += 1
                                continue
                            hist[term] = RewardHistogram()
                        values = shares_of[term] = []
                    values.append(float(share))
            tokens = span.get("completion_tokens")
            if tokens is not None:
                tokens_sum += tokens
                if lo is None or tokens < lo:
                    lo = tokens
                if hi is None or tokens > hi:
                    hi = tokens
                lengths.append(tokens)
            version = span.get("policy_version")
            if version is not None:
                stale = span["step"] - version
                self.stale_n += 1
                self.stale_sum += stale
                if self.stale_max is None or stale > self.stale_max:
                    self.stale_max = stale
            sample = span.get("sample_id")
            if sample is not None:
                group = samples.get(sample)
                if group is None:
                    if len(samples) >= MAX_SAMPLES or len(sample) > MAX_NAME:
                        self.samples_dropped += 1
                    else:
                        samples[sample] = [1, reward, reward, reward, reward * reward]
                else:
                    group[0] += 1
                    if reward < group[1]:
                        group[1] = reward
                    if reward > group[2]:
                        group[2] = reward
                    group[3] += reward
                    group[4] += reward * reward
        self.last_ns, self.rollouts, self.clipped = last_ns, self.rollouts + len(spans), self.clipped + clipped
        self.reward_sum, self.reward_sumsq = total, squares
        self.completions += len(lengths)
        self.completion_sum, self.completion_min, self.completion_max = tokens_sum, lo, hi
        for term, values in shares_of.items():
            hist[term].add_many(values)
        if lengths:
            self.lengths.add_many(lengths)
        if self.closed:
            self.dirty = True

    def add_failed(self, span: dict[str, Any]) -> None:
        """A rollout that raised or returned a failed status: counted as attempted, kept out of every reward figure."""
        self._body = None
        if span["time_ns"] > self.last_ns:
            self.last_ns = span["time_ns"]
        self.failed += 1
        if self.closed:
            self.dirty = True

    def grader_calls(self, term: str) -> GraderWindow:
        """The step's grader calls of ``term`` (a term the run keeps), for the GRADER spans naming the step."""
        calls = self.graders.get(term)
        if calls is None:
            calls = self.graders[term] = GraderWindow()
        if self.closed:
            self.dirty = True
        return calls

    def to_dict(self) -> dict[str, Any]:
        return {"rollouts": self.rollouts, "failed": self.failed, "clipped": self.clipped, "reward_sum": self.reward_sum,
                "reward_sumsq": self.reward_sumsq, "completions": self.completions, "completion_sum": self.completion_sum,
                "completion_min": self.completion_min, "completion_max": self.completion_max,
                "hist": {t: h.to_dict() for t, h in self.hist.items()}, "lengths": self.lengths.to_dict(),
                "samples": self.samples, "samples_dropped": self.samples_dropped, "terms_dropped": self.terms_dropped,
                "end_ns": self.end_ns, "last_ns": self.last_ns, "closed": self.closed, "dirty": self.dirty,
                "stale": [self.stale_n, self.stale_sum, self.stale_max],
                "graders": {t: w.to_dict() for t, w in self.graders.items()}}

    def encode(self) -> list[Any]:
        """The state as a run's changelog carries it (``to_dict``'s values in lists, no key names;
        ``decode`` reads it back): about half the bytes, and a step no rollout changed since the
        last write costs a copy of its bytes."""
        if self._body is None:
            self._body = orjson.Fragment(orjson.dumps([
                self.rollouts, self.failed, self.clipped, self.reward_sum, self.reward_sumsq, self.completions,
                self.completion_sum, self.completion_min, self.completion_max,
                {t: h.encode() for t, h in self.hist.items()}, self.lengths.encode(), self.samples,
                self.samples_dropped, self.terms_dropped, self.last_ns, self.stale_n, self.stale_sum, self.stale_max]))
        return [self._body, self.end_ns, self.closed, self.dirty, {t: w.encode() for t, w in self.graders.items()}]

    @classmethod
    def decode(cls, v: list[Any] | dict[str, Any]) -> StepFigures:
        """``encode``'s list back (or ``to_dict``'s dict, as state written before the list was)."""
        if isinstance(v, dict):
            return cls.from_dict(v)
        body, end_ns, closed, dirty, graders = v
        f = cls()
        (f.rollouts, f.failed, f.clipped, f.reward_sum, f.reward_sumsq, f.completions, f.completion_sum,
         f.completion_min, f.completion_max, hist, lengths, samples, f.samples_dropped, f.terms_dropped, f.last_ns,
         f.stale_n, f.stale_sum, f.stale_max) = body
        f.hist = {t: RewardHistogram.decode(h) for t, h in hist.items()}
        f.lengths = ExpHistogram.decode(lengths)
        f.samples = {k: list(g) for k, g in samples.items()}
        f.end_ns, f.closed, f.dirty = end_ns, closed, dirty
        f.graders = {t: GraderWindow.decode(w) for t, w in graders.items()}
        return f

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepFigures:
        f = cls()
        for name in ("rollouts", "clipped", "reward_sum", "reward_sumsq", "completions", "completion_sum",
                     "completion_min", "completion_max", "samples_dropped", "terms_dropped", "end_ns", "closed", "dirty"):
            setattr(f, name, d[name])
        f.hist = {t: RewardHistogram.from_dict(h) for t, h in d["hist"].items()}
        f.lengths = ExpHistogram.from_dict(d["lengths"])
        f.samples = {k: list(v) for k, v in d["samples"].items()}
        f.last_ns = d.get("last_ns", 0)  # absent from state written before it existed
        f.failed = d.get("failed", 0)  # likewise
        f.stale_n, f.stale_sum, f.stale_max = d.get("stale", (0, 0, None))  # likewise
        f.graders = {t: GraderWindow.from_dict(w) for t, w in d.get("graders", {}).items()}  # likewise
        return f

    # -- records -----------------------------------------------------------------------------
    def stats_record(self, ident: dict[str, Any], step: int, emitted_at_ns: int) -> dict[str, Any]:
        """The StepStats record."""
        n = self.rollouts
        total = self.hist.get("total") or RewardHistogram()
        groups = [g for g in self.samples.values() if g[0] >= 2]
        # "all scored the same" is exact equality of the rewards, as the histograms compare exactly
        same = sum(1 for g in groups if g[1] == g[2])
        spreads = [_std(g[0], g[3], g[4]) for g in groups]
        return {
            **ident, "step": step, "rollouts": n, "clipped": self.clipped, "clipped_ratio": self.clipped / n if n else 0.0,
            "reward_mean": self.reward_sum / n if n else 0.0, "reward_std": _std(n, self.reward_sum, self.reward_sumsq),
            "reward_min": total.min if total.min is not None else 0.0,
            "reward_max": total.max if total.max is not None else 0.0,
            "reward_zero_fraction": total.zero_fraction,
            "completion_mean": self.completion_sum / self.completions if self.completions else 0.0,
            "completion_min": self.completion_min or 0, "completion_max": self.completion_max or 0,
            "samples": len(groups), "samples_same_reward": same,
            "zero_std_fraction": same / len(groups) if groups else None,
            "sample_reward_spread_mean": sum(spreads) / len(spreads) if spreads else 0.0,
            "staleness_max": self.stale_max, "staleness_mean": self.stale_sum / self.stale_n if self.stale_n else None,
            "rollouts_attempted": n + self.failed, "rollouts_failed": self.failed,
            "complete": True, "emitted_at_ns": emitted_at_ns,
        }

    def histogram_records(self, ident: dict[str, Any], step: int, emitted_at_ns: int) -> list[dict[str, Any]]:
        """RewardHistogram records: ``total`` and one per declared term."""
        bounds = [float(b) for b in REWARD_BOUNDS]
        return [{**ident, "step": step, "term": term, "bounds": bounds, "bucket_counts": list(h.counts), "count": h.count,
                 "sum": h.sum, "min": h.min if h.min is not None else 0.0, "max": h.max if h.max is not None else 0.0,
                 "zero_fraction": h.zero_fraction, "emitted_at_ns": emitted_at_ns}
                for term, h in sorted(self.hist.items())]

    def term_records(self, ident: dict[str, Any], step: int, emitted_at_ns: int) -> list[dict[str, Any]]:
        """StepTermStats records: one per declared term with shares or grader calls in the step."""
        out = []
        for term in sorted((set(self.hist) - {"total"}) | set(self.graders)):
            h = self.hist.get(term) or RewardHistogram()
            calls = self.graders.get(term) or GraderWindow()
            failures = calls.failures
            # A failed score is in the shares as 0 (seed 001), so at most h.zeros of them are; a call
            # that failed and was retried to a score is a failure that cost nothing.
            failed_zero = min(failures, h.zeros)
            scored = h.count - failed_zero
            out.append({
                **ident, "step": step, "term": term, "rollouts": h.count, "share_mean": h.mean, "share_std": h.std,
                "share_zero_fraction": h.zero_fraction, "graded": calls.graded, "failures": failures,
                "failure_rate": failures / calls.graded if calls.graded else 0.0,
                # what the failed scores would have added at the mean share of the rollouts the term did score
                "failure_cost": failed_zero * h.sum / scored if scored > 0 else (0.0 if not failed_zero else None),
                **calls.duration_figures(), "judge_input_tokens": calls.input_tokens,
                "judge_output_tokens": calls.output_tokens, "emitted_at_ns": emitted_at_ns})
        return out

    def length_record(self, ident: dict[str, Any], step: int, emitted_at_ns: int) -> dict[str, Any]:
        h = self.lengths
        return {**ident, "step": step, "scale": h.scale, "zero_count": h.zero_count, "offset": h.offset,
                "bucket_counts": list(h.counts), "count": h.count, "sum": float(h.sum),
                "min": float(h.min if h.min is not None else 0), "max": float(h.max if h.max is not None else 0),
                "emitted_at_ns": emitted_at_ns}


def _std(n: int, s: float, sq: float) -> float:
    if n == 0:
        return 0.0
    mean = s / n
    return math.sqrt(max(sq / n - mean * mean, 0.0))


class GraderWindow:
    """Grader outcomes of one (attempt, term) in one tumbling event-time window."""

    __slots__ = ("graded", "causes", "durations", "input_tokens", "output_tokens", "closed", "dirty", "_body")

    def __init__(self) -> None:
        self.graded = 0
        self.input_tokens = self.output_tokens = 0  # what the judge reported (seed 001's grader.tokens)
        self.causes: dict[str, int] = {}
        self.durations = ExpHistogram()
        self.closed = False
        self.dirty = False
        self._body: orjson.Fragment | None = None  # as StepFigures keeps its own

    def add(self, span: dict[str, Any]) -> None:
        self.add_many([self.call_of(span)])

    @staticmethod
    def call_of(span: dict[str, Any]) -> tuple[float, int, int, str | None]:
        """What a GRADER span adds to a window: (duration in s, judge input tokens, output tokens,
        failure cause or None), worked out once for the window and the step that both take it."""
        # Another writer's count outside (0, MAX_JUDGE_TOKENS] adds nothing (the raw span keeps it).
        tokens_in = span.get("judge_input_tokens")
        tokens_out = span.get("judge_output_tokens")
        outcome = span.get("outcome") or "ok"
        return (max(span["end_time_ns"] - span["start_time_ns"], 0) / NS,
                tokens_in if tokens_in is not None and 0 < tokens_in <= MAX_JUDGE_TOKENS else 0,
                tokens_out if tokens_out is not None and 0 < tokens_out <= MAX_JUDGE_TOKENS else 0,
                None if outcome == "ok" else outcome if outcome in CAUSES else UNKNOWN_CAUSE)

    def add_many(self, calls: list[tuple[float, int, int, str | None]]) -> None:
        """The grader calls (``call_of``) of one message for this window, or step and term, in their
        order: the same figures as one ``add`` each, in one loop and one batch add of the durations."""
        if compiled.LOOPS is not None:  # this method line for line, in C (streams/_loops.pyx)
            compiled.LOOPS.grader_add_many(self, calls, MAX_SUM)
            return
        self._body = None
        self.graded += len(calls)
        durations = []
        tokens_in = tokens_out = 0
        causes = self.causes
        for duration, n_in, n_out, cause in calls:
            durations.append(duration)
            tokens_in += n_in
            tokens_out += n_out
            if cause is not None:
                causes[cause] = causes.get(cause, 0) + 1
        # The sums stop at MAX_SUM (a Kafka record must never make a figure that cannot be encoded):
        # with counts >= 0, capping once is capping after each.
        self.input_tokens = min(self.input_tokens + tokens_in, MAX_SUM)
        self.output_tokens = min(self.output_tokens + tokens_out, MAX_SUM)
        self.durations.add_many(durations)
        if self.closed:
            self.dirty = True

    @property
    def failures(self) -> int:
        return sum(self.causes.values())

    def to_dict(self) -> dict[str, Any]:
        return {"graded": self.graded, "causes": dict(self.causes), "durations": self.durations.to_dict(),
                "tokens": [self.input_tokens, self.output_tokens], "closed": self.closed, "dirty": self.dirty}

    def encode(self) -> list[Any]:
        """As :meth:`StepFigures.encode`: ``to_dict``'s values in a list; ``decode`` reads it back."""
        if self._body is None:
            self._body = orjson.Fragment(orjson.dumps([self.graded, self.causes, self.durations.encode(),
                                                       self.input_tokens, self.output_tokens]))
        return [self._body, self.closed, self.dirty]

    @classmethod
    def decode(cls, v: list[Any] | dict[str, Any]) -> GraderWindow:
        """``encode``'s list back (or ``to_dict``'s dict, as state written before the list was)."""
        if isinstance(v, dict):
            return cls.from_dict(v)
        (graded, causes, durations, input_tokens, output_tokens), closed, dirty = v
        return cls.from_dict({"graded": graded, "causes": causes, "durations": ExpHistogram.decode(durations).to_dict(),
                              "tokens": [input_tokens, output_tokens], "closed": closed, "dirty": dirty})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GraderWindow:
        w = cls()
        w.graded, w.causes, w.closed, w.dirty = d["graded"], dict(d["causes"]), d["closed"], d["dirty"]
        w.durations = ExpHistogram.from_dict(d["durations"])
        w.input_tokens, w.output_tokens = d.get("tokens", (0, 0))  # absent from state written before it existed
        return w

    def failure_records(self, ident: dict[str, Any], term: str, start_ns: int, end_ns: int,
                        emitted_at_ns: int) -> list[dict[str, Any]]:
        """GraderFailureWindow records: one per cause, zero counts included (a cause that went away reads 0)."""
        own = self.causes
        known = _SORTED_CAUSES.get(CAUSES)  # read at each call: a test plays an older worker by changing CAUSES
        if known is None:
            known = _SORTED_CAUSES[CAUSES] = (frozenset(CAUSES), sorted(CAUSES))
        # every contract cause and any other this window counted (unknown, or a restored older state's), sorted
        names = known[1] if own.keys() <= known[0] else sorted(known[0] | own.keys())
        graded = self.graded
        return [{**ident, "term": term, "cause": cause, "window_start_ns": start_ns, "window_end_ns": end_ns,
                 "failures": own.get(cause, 0), "graded": graded, "emitted_at_ns": emitted_at_ns}
                for cause in names]

    def window_record(self, ident: dict[str, Any], term: str, start_ns: int, end_ns: int,
                      emitted_at_ns: int) -> dict[str, Any]:
        """The GraderWindow record: totals over causes with the grader-call duration percentiles."""
        failures = self.failures
        return {**ident, "term": term, "window_start_ns": start_ns, "window_end_ns": end_ns, "graded": self.graded,
                "failures": failures, "failure_rate": failures / self.graded if self.graded else 0.0,
                **self.duration_figures(), "emitted_at_ns": emitted_at_ns}

    def duration_figures(self) -> dict[str, float]:
        """Percentiles of the grader-call durations from the exponential histogram (0.0 when empty)."""
        d = self.durations
        p50, p90, p99 = d.quantiles(_DURATION_QS) if d.count else (0.0, 0.0, 0.0)
        return {"duration_p50_s": float(p50), "duration_p90_s": float(p90), "duration_p99_s": float(p99),
                "duration_max_s": float(d.max or 0.0)}
