"""A live workload with its ground truth, and ClickHouse read back to compare with it; shared by the
fault tests (test_faults) and the scale-out tests (test_scale_*).

Jobs are ``TrainingTelemetry`` instances in threads, a step a second. A step's clipped rollouts
and zero rewards are its last rollouts, in patterns that make alerts fire and resolve, so a
step judged before all of it was read would give other figures and other alerts. The expected
alerts are the alert rules (``rlpulse.streams.alerting``, unit-tested) applied to the true figures in
order: the question is whether the rules saw complete figures, once each.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import random
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any
from collections.abc import Callable

from rlpulse.producers import TrainingTelemetry
from rlpulse.pipeline import Pipeline, offsets
from rlpulse.base.settings import Settings
from rlpulse.schemas.codec import Codec
from rlpulse.schemas.topics import read_topic
from rlpulse.sinks.store.clickhouse import open_store
from rlpulse.streams.alerting import AlertBook, end_attempt, grader_failure_rate, step_rules
from rlpulse.streams.histograms import RewardHistogram
from tests.integration import until

NS = 1_000_000_000
PROJECT = "fault"
STEP_S = 1.0
ROLLOUTS = 6
TERMS = ("judge", "format")
CAUSES = ("timeout", "unavailable", "unreadable", "ungradable")
CLIPPED = (0, 1, 2, 3, 0, 0)  # clipped rollouts per step, cycling: the ratio rises three steps in a row, then falls
ZEROS = (0, 0, 0, 0, 0, 4, 1)  # rewards <= 0 per step, cycling: 4 of 6 is a collapse, 1 of 6 ends it
JUDGE_FAILURE = (0.1, 0.25, 0.5)  # one job per rate; 0.25 hovers around the 0.2 threshold: episodes come and go
MAX_TOKENS = 512
RAW = ("spans", "steps")


class RecordingClock:
    """The SDK's clock: the wall clock, remembering per thread the last time it gave (the event
    time of the call just made; the heartbeat thread asks it too)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self) -> int:
        self._local.last = time.time_ns()
        return self._local.last

    @property
    def last(self) -> int:
        return self._local.last


class Truth:
    """What one job's SDK accepted: the calls that did not count as dropped."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.calls = 0
        self.refused = 0
        self.spans = 0
        self.steps = 0  # RUN_START, STEP, RUN_END (heartbeats are not counted)
        self.graded: Counter = Counter()  # (term, window_start_ns)
        self.failures: Counter = Counter()  # (term, cause, window_start_ns)
        self.rollouts: dict[int, list[tuple[float, dict[str, float], bool]]] = defaultdict(list)
        self.graded_steps: set[int] = set()  # steps with a grader call accepted: the streams open their figures

    @property
    def accepted(self) -> int:
        return self.spans + self.steps


class Job(threading.Thread):
    """A training job publishing a step a second through the SDK until ``stopping`` is set; while
    ``paused`` is set it completes no step (a stalled job)."""

    def __init__(self, settings: Settings, index: int, **sdk: Any):
        super().__init__(name=f"job{index}", daemon=True)
        # set: the job is stuck, no step completes (its heartbeats, if on, still report the count)
        self.paused = threading.Event()
        self.completed = 0  # steps completed: the step_count its heartbeats report
        self.truth = Truth(f"run{index}")
        self.judge_failure = JUDGE_FAILURE[index % len(JUDGE_FAILURE)]
        self.window_ns = int(settings.window * NS)
        self.rng = random.Random(index)
        self.clock = RecordingClock()
        self.tel = TrainingTelemetry(project=PROJECT, run_id=self.truth.run_id, settings=settings, clock=self.clock, **sdk)
        self.stopping = threading.Event()
        self.undelivered: int | None = None
        self.error: BaseException | None = None

    def _call(self, method: Any, **kwargs: Any) -> bool:
        """Call the SDK; True when the event was accepted (``dropped`` did not move)."""
        before = self.tel.dropped
        method(**kwargs)
        self.truth.calls += 1
        accepted = self.tel.dropped == before
        self.truth.refused += not accepted
        return accepted

    def run(self) -> None:
        try:
            self.truth.steps += self._call(self.tel.start)
            step, next_at = 0, time.monotonic()
            while not self.stopping.is_set():
                if not self.paused.is_set():
                    self._step(step)
                    step += 1
                    self.completed = step
                next_at += STEP_S
                self.stopping.wait(max(0.0, next_at - time.monotonic()))
            self.truth.steps += self._call(self.tel.close, timeout=60.0)  # RUN_END, then everything delivered
            self.undelivered = self.tel.pending
        except BaseException as exc:  # reported by check(), in the test's thread
            self.error = exc

    def _step(self, step: int) -> None:
        rng, truth = self.rng, self.truth
        clipped_n, zeros_n = CLIPPED[step % len(CLIPPED)], ZEROS[step % len(ZEROS)]
        for i in range(ROLLOUTS):
            rid = f"s{step}-r{i}"
            for term in TERMS:
                rate = self.judge_failure if term == "judge" else 0.05
                outcome = rng.choice(CAUSES) if rng.random() < rate else "ok"
                if self._call(self.tel.grader, step=step, rollout_id=rid, term=term, outcome=outcome, duration_s=0.5):
                    start = self.clock.last - self.clock.last % self.window_ns
                    truth.spans += 1
                    truth.graded[(term, start)] += 1
                    truth.graded_steps.add(step)
                    if outcome != "ok":
                        truth.failures[(term, outcome, start)] += 1
            reward = 0.0 if i >= ROLLOUTS - zeros_n else round(rng.uniform(0.01, 1.5), 3)
            clipped = i >= ROLLOUTS - clipped_n
            shares = {"judge": round(reward * 0.6, 6), "format": round(reward * 0.4, 6)}
            tokens = MAX_TOKENS if clipped else rng.randrange(16, MAX_TOKENS)
            if self._call(self.tel.rollout, step=step, rollout_id=rid, reward=reward, term_shares=shares,
                          completion_tokens=tokens, max_tokens=MAX_TOKENS):
                truth.spans += 1
                truth.rollouts[step].append((reward, shares, clipped))
        truth.steps += self._call(self.tel.step_completed, step=step, tokens=1000, duration_s=STEP_S)

    def check(self) -> None:
        if self.error is not None:
            raise AssertionError(f"{self.name} failed: {self.error!r}") from self.error


def run_for(seconds: float, pipeline: Pipeline, jobs: list[Job]) -> None:
    """Let the jobs publish for ``seconds``, failing at once if a pipeline process or a job dies."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pipeline.check_alive()
        for job in jobs:
            job.check()
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def stop_jobs(jobs: list[Job]) -> None:
    for job in jobs:
        job.stopping.set()
    for job in jobs:
        job.join(120)
        assert not job.is_alive(), f"{job.name} did not finish"
        job.check()


def wait_committed_past(settings: Settings, groups: tuple[str, ...], end: dict, pipeline: Pipeline,
                        since: float, timeout: float = 180.0) -> dict[str, float]:
    """Seconds from ``since`` (monotonic) until each group has committed up to ``end`` on every partition."""
    done: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(groups):
        pipeline.check_alive()
        for group in groups:
            if group not in done:
                _, committed = offsets(settings, group, RAW)
                if all(committed.get(tp, 0) >= n for tp, n in end.items()):
                    done[group] = round(time.monotonic() - since, 1)
        if time.monotonic() > deadline:
            raise TimeoutError(f"not caught up in {timeout:.0f}s: {sorted(set(groups) - set(done))}; "
                               f"logs in {pipeline.log_dir}")
        time.sleep(0.5)
    return done


def end_offsets(settings: Settings) -> dict:
    end, _ = offsets(settings, settings.sink_group, RAW)
    return end


# -- the truth and ClickHouse ------------------------------------------------------------------
def expected(jobs: list[Job], settings: Settings) -> dict[str, Any]:
    out: dict[str, Any] = {"failures": {}, "windows": {}, "steps": {}, "histograms": {}, "alerts": []}
    alerts: list[dict] = []
    for job in jobs:
        t, run = job.truth, job.truth.run_id
        book, rules = AlertBook({}), {}
        # A step whose rollouts were all dropped (a full SDK buffer) but whose grader calls got through
        # has figures too, as the streams open them: no rollouts, none clipped, a ratio of 0.
        for step in sorted(set(t.rollouts) | t.graded_steps):
            rollouts = t.rollouts.get(step, [])
            hist = {"total": RewardHistogram(), **{term: RewardHistogram() for term in TERMS}}
            for reward, shares, _ in rollouts:  # in the order the streams add them
                hist["total"].add(reward)
                for term, share in shares.items():
                    hist[term].add(share)
            if rollouts:
                for term, h in hist.items():
                    out["histograms"][(run, step, term)] = (h.counts, h.count, h.sum, h.min, h.max)
            clipped = sum(c for _, _, c in rollouts)
            out["steps"][(run, step)] = (len(rollouts), clipped)
            stats = {"project": PROJECT, "run_id": run, "attempt": 1, "step": step,
                     "clipped_ratio": clipped / len(rollouts) if rollouts else 0.0,
                     "reward_zero_fraction": hist["total"].zero_fraction}
            alerts += step_rules(book, rules, stats, settings.alerts, now_ns=0)
        for term, start in sorted(t.graded, key=lambda k: (k[1], k[0])):  # windows close in start order
            failures = sum(t.failures[(term, c, start)] for c in CAUSES)
            out["windows"][(run, term, start)] = (t.graded[(term, start)], failures)
            window = {"project": PROJECT, "run_id": run, "attempt": 1, "term": term, "window_start_ns": start,
                      "graded": t.graded[(term, start)], "failures": failures}
            alerts += grader_failure_rate(book, window, settings.alerts, now_ns=0)
        for (term, cause, start), n in t.failures.items():
            out["failures"][(run, term, cause, start)] = n
        # the job ended (RUN_END) after all of the above: what is still open resolves, "run ended"
        alerts += end_attempt(book, PROJECT, run, 1, now_ns=0)
    out["alerts"] = sorted((a["rule"], a["key"], a["state"], a["summary"]) for a in alerts)
    return out


def figures_in(settings: Settings, want: dict[str, Any], dsns: list[str] | None = None) -> Callable[[], bool]:
    """A ``wait_caught_up`` condition: every step and window of ``want`` (``expected``) has its figures
    in ClickHouse, in the union of the stores ``dsns`` (the settings' store by default). The jobs
    ended with RUN_END, so each run closed as its last message was read: no idle wait."""
    def keys(sql: str) -> set[tuple] | None:
        found: set[tuple] = set()
        for dsn in dict.fromkeys(dsns or [settings.clickhouse_dsn]):
            rows = until.query(dataclasses.replace(settings, clickhouse_url=dsn), sql)
            if rows is None:
                return None
            found.update(rows)
        return found

    def ready() -> bool:
        steps = keys(f"SELECT run_id, step FROM $db.step_stats FINAL WHERE project = '{PROJECT}'")
        windows = keys(f"SELECT run_id, term, window_start_ns FROM $db.grader_windows FINAL WHERE project = '{PROJECT}'")
        return (steps is not None and windows is not None
                and len(steps) >= len(want["steps"]) and len(windows) >= len(want["windows"]))
    return ready


def read_figures(settings: Settings, dsn: str | None = None) -> dict[str, Any]:
    """The figures in the store at ``dsn`` (the settings' store by default) in the form ``expected`` gives."""
    with open_store(dsn or settings.clickhouse_dsn, owner="test") as store:
        db, p = store.database, {"p": PROJECT}

        def rows(sql: str) -> list[tuple]:
            return store.client.query(sql.replace("$db", db), parameters=p).result_rows

        where = "WHERE project = {p:String}"
        return {
            "failures": {(r, t, c, s): n for r, t, c, s, n in rows(
                f"SELECT run_id, term, cause, window_start_ns, failures FROM $db.grader_failures FINAL {where} "
                "AND failures > 0")},
            "windows": {(r, t, s): (g, f) for r, t, s, g, f in rows(
                f"SELECT run_id, term, window_start_ns, graded, failures FROM $db.grader_windows FINAL {where}")},
            "steps": {(r, s): (n, c) for r, s, n, c in rows(
                f"SELECT run_id, step, rollouts, clipped FROM $db.step_stats FINAL {where}")},
            "histograms": {(r, s, t): (list(b), n, total, lo, hi) for r, s, t, b, n, total, lo, hi in rows(
                f"SELECT run_id, step, term, bucket_counts, count, sum, min, max FROM $db.reward_histograms FINAL {where}")},
            "alerts": sorted(rows(f"SELECT rule, key, state, summary FROM $db.alerts FINAL {where}")),
            # the alerts table's key (rule, key, first_seen_ns, state) with the summary: one per episode and state
            "alert_rows": sorted(rows(f"SELECT rule, key, first_seen_ns, state, summary FROM $db.alerts FINAL {where}")),
            "span_rows": rows(f"SELECT count() FROM $db.spans FINAL {where}")[0][0],
            "span_rows_unmerged": rows(f"SELECT count() FROM $db.spans {where}")[0][0],
            "step_rows": rows(f"SELECT count() FROM $db.steps FINAL {where} AND type != 'HEARTBEAT'")[0][0],
            # per writer: spans, lowest and highest sequence id (dropped events take no id: 1..n)
            "sequences": {r: (n, lo, hi) for r, n, lo, hi in rows(
                f"SELECT run_id, count(), min(writer_sequence), max(writer_sequence) FROM $db.spans FINAL {where} "
                "GROUP BY run_id")},
        }


def emitted_more_than_once(settings: Settings) -> dict[str, list]:
    """Steps and windows whose figures the streams published more than once. Each should close
    once, complete: a second emission means it was closed before all of it was read (the
    alert rules then judged the part), or a replay was not recognised."""
    codec, out = Codec(), {}
    for short, fields in (("step-stats", ("run_id", "step")), ("grader-windows", ("run_id", "term", "window_start_ns"))):
        messages = asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic(short)))
        keys = Counter(tuple(r[f] for f in fields) for m in messages for r in codec.decode(m.value).records)
        out[short] = sorted(k for k, n in keys.items() if n > 1)
    return out


def assert_figures_equal(want: dict[str, Any], got: dict[str, Any]) -> None:
    for name in ("failures", "windows", "steps", "histograms", "alerts"):
        w, g = want[name], got[name]
        if w != g:
            if isinstance(w, dict):
                wrong = sorted({k for k in w.keys() | g.keys() if w.get(k) != g.get(k)}, key=str)
                detail = "; ".join(f"{k}: expected {w.get(k)}, got {g.get(k)}" for k in wrong[:5])
                raise AssertionError(f"{name}: {len(wrong)} of {len(w)} differ: {detail}")
            missing = sorted((Counter(w) - Counter(g)).elements())
            extra = sorted((Counter(g) - Counter(w)).elements())
            raise AssertionError(f"{name}: missing {missing[:6]}, unexpected {extra[:6]}")


def check_delivery(jobs: list[Job], got: dict[str, Any]) -> dict[str, int]:
    """Every accepted event is in ClickHouse once, every writer's sequence is 1..n; returns the counts."""
    calls = sum(j.truth.calls for j in jobs)
    spans, steps = sum(j.truth.spans for j in jobs), sum(j.truth.steps for j in jobs)
    dropped = sum(j.tel.dropped for j in jobs)
    figures = {"calls": calls, "accepted_spans": spans, "accepted_steps": steps, "dropped": dropped,
               "span_rows": got["span_rows"], "step_rows": got["step_rows"],
               "duplicates_before_merge": got["span_rows_unmerged"] - got["span_rows"]}
    assert [j.undelivered for j in jobs] == [0] * len(jobs)
    assert [j.tel.dropped for j in jobs] == [j.truth.refused for j in jobs]
    assert (got["span_rows"], got["step_rows"]) == (spans, steps)
    assert calls - got["span_rows"] - got["step_rows"] == dropped  # what is missing is exactly what was dropped
    assert got["sequences"] == {j.truth.run_id: (j.truth.spans, 1, j.truth.spans) for j in jobs}
    return figures


def indices_by_partition(settings: Settings) -> list[int]:
    """For each partition of the raw topics, the lowest ``Job`` index whose run lands there (the SDK's
    producer partitions by the key ``project/run_id`` with Kafka's default murmur2 partitioner)."""
    from aiokafka.partitioner import DefaultPartitioner

    partitioner, parts = DefaultPartitioner(), list(range(settings.partitions))
    found: dict[int, int] = {}
    i = 0
    while len(found) < settings.partitions:
        found.setdefault(partitioner(f"{PROJECT}/run{i}".encode(), parts, parts), i)
        i += 1
    return [found[p] for p in parts]


def partitions_of_runs(settings: Settings) -> dict[str, int]:
    """run_id -> the partition its steps are on, as read back from the steps topic."""
    messages = asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic("steps")))
    codec, out = Codec(), {}
    for m in messages:
        for r in codec.decode(m.value).records:
            if r["project"] == PROJECT:
                out[r["run_id"]] = m.partition
    return out


def alerts_published(settings: Settings, rule: str | None = None) -> list[dict[str, Any]]:
    """Every Alert record on the alerts topic (of ``rule``, if given), in partition order."""
    messages = asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic("alerts")))
    codec = Codec()
    return [r for m in messages for r in codec.decode(m.value).records
            if r["project"] == PROJECT and (rule is None or r["rule"] == rule)]


def sequence_gaps(log_dir: Path) -> dict[str, int]:
    """Records the streams workers logged as never reaching them (``rlpulse.streams.runs``: a run's sequence
    jumped), per worker log: what faust-streaming 0.15.3 skips now and then when a worker gets a
    partition (see ``rlpulse.streams.commits.ProcessedOffsets.missed``)."""
    out = {}
    for path in sorted(log_dir.glob("streams*.log")):
        n = sum(int(m.group(1)) for m in re.finditer(r"(\d+) records never reached this worker", path.read_text()))
        if n:
            out[path.stem] = n
    return out
