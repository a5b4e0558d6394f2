"""The run processor: every figure and every alert of a run, computed in one place.

A run's spans and steps share the key ``project/run_id``, so they land on one partition and one
processor sees all of the run. Its state is one :class:`Run` (one Faust table entry), written
once per message. Time comes in as ``now_ns``; nothing here knows Kafka or Faust.

* **Replays** are skipped by sequence marks: the highest publish-order id applied per (topic,
  attempt, writer): a span's ``writer_sequence`` (its ``sequence_id`` when a writer older than that
  field sent it), a step's ``sequence_id``. A redelivered message, a replayed offset range after a
  crash, or a producer retry changes nothing. A record without a sequence (0) is always applied.
* **Event time** decides lateness. A run's progress is the span time of its slowest writer
  (each writer's spans arrive in order), as a watermark is the minimum over its inputs; the
  steps topic, read independently and often far ahead in a backlog, does not move it. A grader
  window closes when progress passes its end plus the allowed lateness; a step when progress
  passes the step's end (its STEP event, a later step's first rollout, or RUN_END) plus the
  lateness. A backlog is therefore counted exactly however late it is processed.
* **Ended runs** close at once: a writer's RUN_END names the last publish-order id it gave a span
  (``spans_sent``); when every stream of the run has ended and all it numbered is applied,
  nothing more will come, and every window and step of the run closes.
* **Idle runs** close by the wall clock: no message of the run for ``idle_s``, counted from no
  earlier than the moment this processor had read what was waiting on the run's partition when
  it got it (:meth:`RunProcessor.behind`): our downtime, a rebalance, or the replay after a
  restart never closes anything early, makes a run look silent, or lets the rules judge a
  partial step.
* **Late data** for a closed window or step that is still retained updates it and re-emits it
  (readers keep the latest ``emitted_at_ns``); the alert rules see each step and window once.
  Data older than the retention is counted in ``late_dropped`` and logged, never silently lost.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, NamedTuple

from rlpulse.schemas.catalogue import (ALERTS_TOPIC, GRADER_FAILURES_TOPIC, GRADER_WINDOWS_TOPIC, LENGTH_HISTOGRAMS_TOPIC,
                                       OTLP_WRITER_PREFIX, REWARD_HISTOGRAMS_TOPIC, SPANS_TOPIC, STEP_STATS_TOPIC,
                                       STEP_TERMS_TOPIC)
from rlpulse.base.settings import AlertThresholds
from rlpulse.streams.alerting import (RUN_SCOPED, AlertBook, checkpoint_rule, end_attempt, forget_run, grader_failure_rate,
                                      step_rules)
from rlpulse.streams import compiled
from rlpulse.streams.batch import Batch, step_order, window_order, window_parts
from rlpulse.streams import figures
from rlpulse.streams.figures import MAX_JUDGE_TOKENS, MAX_NAME, MAX_TERMS, NS, UNKNOWN_CAUSE, GraderWindow, StepFigures
from rlpulse.streams.stall import StallDetector
from rlpulse.streams.state import Run

log = logging.getLogger(__name__)


# The span fields the processor reads: the decoder may skip the rest (ids, names, attributes).
SPAN_FIELDS = frozenset({"project", "run_id", "attempt", "time_ns", "kind", "term", "outcome", "step", "start_time_ns",
                         "end_time_ns", "reward", "clipped", "completion_tokens", "term_shares", "sample_id",
                         "sequence_id", "writer_sequence", "writer_id", "status", "policy_version", "checkpoint_op",
                         "status_message", "judge_input_tokens", "judge_output_tokens"})

ALL_IN = 2**62  # the progress of a run whose writers have all ended and whose every event is in
INF = float("inf")


class Output(NamedTuple):
    topic: str  # short name of a derived topic
    key: str
    schema: str  # record type
    record: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class RunConfig:
    window_s: float = 60.0
    lateness_s: float = 10.0
    idle_s: float = 20.0  # no message for this long: close what is open by the wall clock
    stall_after_s: float = 900.0  # the stall window before a run has a step time (streams/stall.py)
    stall_min_s: float = 60.0  # a run's own window: factor x its median step time, within [min(this, stall_after), max]
    stall_max_s: float = 86400.0
    stall_factor: float = 5.0
    silent_after_s: float = 300.0
    retention_s: float = 120.0  # closed windows and steps kept this long (event time) for late data
    thresholds: AlertThresholds = dataclasses.field(default_factory=AlertThresholds)
    # Input limits for writers other than the SDK, which refuses these at the call (docs/sdk-and-tracing.md,
    # "Input limits"): the state of a run, and of a worker, stays bounded whatever arrives.
    max_terms: int = MAX_TERMS  # distinct grader terms per run; spans of further terms are refused
    max_runs: int = 10_000  # runs in this worker's state; a new run beyond it is refused until one expires
    max_name: int = MAX_NAME  # characters of a project, run_id or term

    @classmethod
    def from_settings(cls, settings: Any) -> RunConfig:
        return cls(window_s=settings.window, lateness_s=settings.allowed_lateness,
                   idle_s=max(2 * settings.allowed_lateness, 1.0),
                   stall_after_s=settings.stall_after, stall_min_s=settings.stall_min, stall_max_s=settings.stall_max,
                   stall_factor=settings.stall_factor, silent_after_s=settings.silent_after,
                   retention_s=max(10 * settings.allowed_lateness, 2 * settings.window), thresholds=settings.alerts)


class RunProcessor:
    """Applies messages and ticks to :class:`Run` states and returns the records to publish."""

    def __init__(self, config: RunConfig, resumed_ns: int):
        self.config = config
        self.resumed_ns = resumed_ns  # when this processor (re)started
        # partition -> the last wall-clock time it was still behind (messages waiting from before)
        self._behind_ns: dict[int, int] = {}
        self.size_ns = int(config.window_s * NS)
        self.lateness_ns = int(config.lateness_s * NS)
        self.idle_ns = int(config.idle_s * NS)
        self.retention_ns = int(config.retention_s * NS)
        self.duplicates = 0  # records skipped by their sequence marks
        # Sequence ids are contiguous per writer and topic, so a jump means records this worker never
        # saw (lost upstream, or skipped by the consumer): counted and logged, never silent.
        self.sequence_gaps = 0
        self.applied = 0  # records applied
        # records refused by the input limits (RunConfig): grader spans of a run's excess terms or
        # of an over-long term; records of an over-long project/run_id; records of new runs while
        # the worker holds max_runs runs. Logged at the 1st, 10th, 100th ... and counted here.
        self.terms_refused = 0
        self.names_refused = 0
        self.runs_refused = 0

    def behind(self, partition: int, now_ns: int) -> None:
        """``partition`` still has messages that were waiting when this worker got it: quiet counts from now."""
        self._behind_ns[partition] = now_ns

    def quiet_from(self, run: Run) -> int:
        """Wall clock from which the run's silence counts: the restart, or the end of its partition's catch-up."""
        return self._behind_ns.get(run.partition, self.resumed_ns)

    def _gap(self, run: Run, stream: str, last: int, seq: int) -> None:
        self.sequence_gaps += seq - last - 1
        log.warning("run %s: %s jumped from sequence %d to %d: %d records never reached this worker "
                    "(%d missing so far)", run.key, stream, last, seq, seq - last - 1, self.sequence_gaps)

    # -- messages ----------------------------------------------------------------------------
    def on_records(self, run: Run, topic: str, records: list[dict[str, Any]], now_ns: int) -> list[Output]:
        """Apply one message's records (``topic`` is ``spans`` or ``steps``) and close what is due."""
        if compiled.LOOPS is not None:  # _apply line for line, in C (streams/_loops.pyx)
            # call_of's constants, CAUSES read now (a test plays an older worker by changing it)
            call_of = (NS, MAX_JUDGE_TOKENS, figures.CAUSES, UNKNOWN_CAUSE)
            out = compiled.LOOPS.on_records(self, run, topic, records, now_ns, Batch, call_of, SPANS_TOPIC,
                                            OTLP_WRITER_PREFIX, checkpoint_rule, AlertBook)
        else:
            out = self._apply(run, topic, records, now_ns)
        self.applied += len(records)
        run.seen_ns = now_ns
        out += self._close(run, now_ns, idle=False)
        return out

    def _apply(self, run: Run, topic: str, records: list[dict[str, Any]], now_ns: int) -> list[Output]:
        """The records of one message into the run's marks, progress, steps and windows: the
        outputs of its steps events and checkpoints (the closing pass comes after)."""
        out: list[Output] = []
        marks, progress = run.marks, run.progress
        # A message's records nearly all share one stream (topic, attempt, writer): its sequence
        # mark and its progress are kept in locals while they do, and written back when it changes
        # and at the end (steps read neither; the close below reads both).
        attempt: Any = None
        writer: Any = None
        stream, last, latest = "", 0, None
        sparse = False  # a writer numbering by Kafka position (OTLP-born records): jumps are no loss
        # The message's spans go to their steps and windows together (``Batch``): in the order they
        # came, so every figure is what one add per span gives, in one loop per accumulator. A span
        # whose step or window this message has already found is appended to its list here; the
        # first, or any other, goes through _grader / _rollout, which find it and say why not.
        batch = Batch()
        rollouts, graders, size, call_of = batch.rollouts, batch.graders, self.size_ns, GraderWindow.call_of
        spans = topic == SPANS_TOPIC
        try:
            for r in records:
                if r["attempt"] != attempt or r.get("writer_id", "") != writer:
                    self._settle(marks, progress, stream, last, latest, now_ns)
                    attempt, writer = r["attempt"], r.get("writer_id", "")
                    stream = f"{topic}|{attempt}|{writer}"
                    last, latest = marks.get(stream, 0), None
                    sparse = writer.startswith(OTLP_WRITER_PREFIX)
                # publish order (a writer older than writer_sequence published in sequence_id order)
                seq = r.get("writer_sequence") or r.get("sequence_id") or 0
                if seq > 0:
                    if seq <= last:
                        self.duplicates += 1
                        continue
                    if last and seq > last + 1 and not sparse:
                        self._gap(run, stream, last, seq)
                    last = seq
                t = r["time_ns"]
                if latest is None or t > latest:
                    latest = t
                if spans:
                    kind = r["kind"]
                    if kind == "GRADER":
                        term = r.get("term")
                        if term is not None:
                            lists = graders.get((attempt, r.get("step"), term, t - t % size))
                            if lists is None:
                                self._grader(run, r, batch)
                            else:
                                call = call_of(r)
                                for items in lists:
                                    items.append(call)
                    elif kind == "ROLLOUT":
                        step = r.get("step")
                        if step is None:
                            pass
                        elif r.get("status") == "ERROR":  # attempted and failed: in no reward figure
                            self._failed_rollout(run, r, batch)
                        elif r.get("reward") is not None:
                            found = rollouts.get((attempt, step))
                            reward, shares, tokens = r["reward"], r.get("term_shares"), r.get("completion_tokens")
                            if found is not None and -INF < reward < INF and (
                                    not shares or -INF < sum(shares.values()) < INF) and (tokens is None or tokens >= 0):
                                found.append(r)
                            else:
                                self._rollout(run, r, batch)
                    elif kind == "CHECKPOINT":
                        out += [self._alert(run, a) for a in checkpoint_rule(AlertBook(run.alerts), r, now_ns)]
                else:
                    out += self._step_event(run, r, now_ns)
        finally:  # also when a record raised: the marks of those applied before it stay, as they did per record
            try:
                batch.apply()
            finally:
                self._settle(marks, progress, stream, last, latest, now_ns)
        return out

    @staticmethod
    def _settle(marks: dict[str, int], progress: dict[str, list[int]], stream: str, last: int, latest: int | None,
                now_ns: int) -> None:
        """A stream's sequence mark and progress, from on_records' locals (``latest`` None: no time seen)."""
        if last:
            marks[stream] = last
        if latest is None:
            return
        mark = progress.get(stream)
        if mark is None:
            progress[stream] = [latest, now_ns]
        else:
            if latest > mark[0]:
                mark[0] = latest
            mark[1] = now_ns

    def _grader(self, run: Run, span: dict[str, Any], batch: Batch) -> None:
        """A grader call to its step's calls of the term and to its window, each found or opened;
        once both are found (neither late), the next calls of the message with the same step,
        term and window go to them from on_records directly."""
        term = span["term"]
        if term not in run.terms:  # a short list (at most max_terms)
            if len(run.terms) >= self.config.max_terms or len(term) > self.config.max_name:
                self._refuse_term(run, term)
                return
            run.terms.append(term)
        call = GraderWindow.call_of(span)
        lists = []
        step_found = True
        # The step's own figures first: grader calls held until their step completes (the SDK's
        # grader_calls="step") may reach a window already retired, while their step is still open.
        if span.get("step") is not None:
            figures = self._step_of(run, span, batch, moves_steps=False)
            if figures is not None:
                lists.append(batch.items(figures.grader_calls(term)))
            step_found = figures is not None
        start = span["time_ns"] - span["time_ns"] % self.size_ns
        attempt = span["attempt"]
        key = f"{attempt}|{term}|{start}"
        window = run.windows.get(key)
        if window is None:
            if start <= run.retired_windows.get(str(attempt), -1):
                self._late(run, "grader span", key)
                window_found = False
            else:
                window = run.windows[key] = GraderWindow()
                window_found = True
        else:
            window_found = True
        if window is not None:
            lists.append(batch.items(window))
        for items in lists:
            items.append(call)
        if step_found and window_found:  # nothing late to count: the next such call can skip all this
            batch.graders[(attempt, span.get("step"), term, start)] = tuple(lists)

    def _rollout(self, run: Run, span: dict[str, Any], batch: Batch) -> None:
        # The SDK refuses a NaN reward or a negative length at the call; another writer's must
        # neither crash the worker nor half-update a step (checked inline: the hot path).
        reward, shares, tokens = span["reward"], span.get("term_shares"), span.get("completion_tokens")
        if not (-INF < reward < INF and (not shares or -INF < sum(shares.values()) < INF) and (tokens is None or tokens >= 0)):
            run.rejected += 1
            log.warning("rollout of %s (attempt %s, writer %r, sequence %s) skipped: %s (%d skipped for this run)", run.key,
                        span["attempt"], span.get("writer_id"), span.get("sequence_id"), StepFigures.invalid(span), run.rejected)
            return
        figures = self._step_of(run, span, batch)
        if figures is not None:
            items = batch.rollouts[(span["attempt"], span["step"])] = batch.items(figures)
            items.append(span)

    def _failed_rollout(self, run: Run, span: dict[str, Any], batch: Batch) -> None:
        figures = self._step_of(run, span, batch)
        if figures is not None:
            figures.add_failed(span)

    def _step_of(self, run: Run, span: dict[str, Any], batch: Batch, moves_steps: bool = True) -> StepFigures | None:
        """The figures of the span's step, opened if new; None (counted late) for a retired step.

        ``moves_steps`` False (a grader call): the span says nothing about the run's progress through
        its steps, so it neither ends earlier steps nor raises the attempt's highest step; a grader
        span naming a far step cannot close the run's open steps early. Within one message the
        answer for a (attempt, step, moves_steps) is kept in ``batch``: once a step's rollout has
        raised the attempt's highest step to it, no later call for that step changes anything."""
        cached = batch.steps.get((span["attempt"], span["step"], moves_steps))
        if cached is not None:
            return cached
        figures = self._open_step(run, span, moves_steps)
        if figures is not None:
            batch.steps[(span["attempt"], span["step"], moves_steps)] = figures
        return figures

    def _open_step(self, run: Run, span: dict[str, Any], moves_steps: bool) -> StepFigures | None:
        attempt, step = str(span["attempt"]), span["step"]
        key = f"{attempt}|{step}"
        figures = run.steps.get(key)
        if figures is None:
            if step <= run.retired_steps.get(attempt, -1):
                self._late(run, "rollout", key)
                return None
            figures = run.steps[key] = StepFigures()
            figures.end_ns = run.step_ends.pop(key, None)
        if moves_steps and step > run.max_step.get(attempt, -1):
            # a later step began: every earlier open step of the attempt has ended by this rollout's time
            run.max_step[attempt] = step
            for k, f in run.steps.items():
                a, s = k.split("|")
                if a == attempt and int(s) < step and f.end_ns is None:
                    f.end_ns = span["time_ns"]
        return figures

    def _step_event(self, run: Run, event: dict[str, Any], now_ns: int) -> list[Output]:
        stalls = self._stalls(run, self.quiet_from(run))
        attempt = str(event["attempt"])
        # An attempt older than the newest one seen was superseded (its stall tracking ended when
        # the newer one reported): a straggler of it must not start a new, never-resolved episode.
        # Nor may a report after the attempt's RUN_END (another rank's heartbeat racing its close, or
        # any writer): it would track the ended attempt again, and its alerts would fire and resolve
        # ("run ended") over and over.
        late = event["attempt"] < run.latest_attempt or (event["attempt"] in run.ended and event["type"] != "RUN_END")
        alerts = [] if late else stalls.observe(event, now_ns)
        run.latest_attempt = max(run.latest_attempt, event["attempt"])
        if event["type"] == "STEP":
            key = f"{attempt}|{event['step']}"
            figures = run.steps.get(key)
            if figures is not None:
                figures.end_ns = event["time_ns"] if figures.end_ns is None else min(figures.end_ns, event["time_ns"])
            elif key not in run.step_ends:
                run.step_ends[key] = event["time_ns"]
        elif event["type"] == "RUN_END":
            if event["attempt"] not in run.ended:
                run.ended.append(event["attempt"])
            writer = event.get("writer_id", "")
            if event.get("sequence_id"):  # the writer's steps end here
                run.finished[f"steps|{attempt}|{writer}"] = event["sequence_id"]
            if event.get("spans_sent"):  # and its spans at the id it names
                run.finished[f"spans|{attempt}|{writer}"] = event["spans_sent"]
            for k, f in run.steps.items():
                if k.split("|")[0] == attempt and f.end_ns is None:
                    f.end_ns = event["time_ns"]
        return [self._alert(run, a) for a in alerts]

    def _stalls(self, run: Run, resumed_ns: int) -> StallDetector:
        c = self.config
        return StallDetector(run.stalls, AlertBook(run.alerts), c.stall_after_s, c.silent_after_s, stall_min_s=c.stall_min_s,
                             stall_max_s=c.stall_max_s, factor=c.stall_factor, resumed_ns=resumed_ns)

    def _end_alerts(self, run: Run, now_ns: int, idle: bool) -> list[Output]:
        """Resolve ("run ended") the open run-scoped alerts of attempts that sent RUN_END or were
        superseded by a newer attempt, once the attempt's steps and windows are all closed (so their
        rules have judged them) and, unless the run went idle, every span its writers' RUN_END
        numbered is applied. Open GPU and engine alerts live in the hardware stage's book, not here."""
        attempts = {e["attempt"] for e in run.alerts.values()
                    if e["rule"] in RUN_SCOPED and (e["attempt"] in run.ended or e["attempt"] < run.latest_attempt)}
        if not attempts:
            return []
        for k, f in run.steps.items():
            if not f.closed:
                attempts.discard(int(k.split("|", 1)[0]))
        for k, w in run.windows.items():
            if not w.closed:
                attempts.discard(int(k.split("|", 1)[0]))
        if not idle:
            for k, last in run.finished.items():
                if k.startswith("spans|") and run.marks.get(k, 0) < last:
                    attempts.discard(int(k.split("|")[1]))
        book, out = AlertBook(run.alerts), list[Output]()
        for attempt in sorted(attempts):
            why = "run ended" if attempt in run.ended else f"superseded by attempt {run.latest_attempt} (run ended)"
            out += [self._alert(run, a) for a in end_attempt(book, run.project, run.run_id, attempt, now_ns, why)]
        return out

    def _refuse_term(self, run: Run, term: str) -> None:
        run.terms_refused += 1
        self.terms_refused += 1
        if often(run.terms_refused - 1, run.terms_refused):
            why = (f"a term of {len(term)} characters (at most {self.config.max_name})" if len(term) > self.config.max_name
                   else f"term {term!r} would be distinct term number {len(run.terms) + 1} (at most {self.config.max_terms})")
            log.warning("grader span of %s refused: %s; its figures stay bounded (%d grader spans refused for this "
                        "run, %d on this worker); the raw span is still stored", run.key[:600], why,
                        run.terms_refused, self.terms_refused)

    def _late(self, run: Run, what: str, key: str) -> None:
        run.late_dropped += 1
        log.warning("late %s of %s (%s) dropped: its figures were emitted and retired (%d dropped for this run)",
                    what, run.key, key, run.late_dropped)

    # -- ticks -------------------------------------------------------------------------------
    def on_tick(self, run: Run, now_ns: int) -> tuple[list[Output], bool]:
        """Wall-clock work for one run: stalls, and closing an idle run. Returns (outputs, state changed)."""
        before = len(run.alerts), len(run.stalls)
        resumed = self.quiet_from(run)
        alerts = self._stalls(run, resumed).tick(now_ns)
        out = [self._alert(run, a) for a in alerts]
        idle = now_ns - max(run.seen_ns, resumed) >= self.idle_ns
        changed = bool(out) or (len(run.alerts), len(run.stalls)) != before
        if idle and (any(not w.closed or w.dirty for w in run.windows.values())
                     or any(not s.closed or s.dirty for s in run.steps.values())):
            out += self._close(run, now_ns, idle=True)
            changed = True
        elif idle and run.alerts:  # nothing left to close, but an ended attempt's alerts may still wait
            ended = self._end_alerts(run, now_ns, idle=True)
            out += ended
            changed = changed or bool(ended)
        if idle and now_ns - max(run.seen_ns, resumed) >= self.retention_ns and (run.windows or run.steps):
            for key in list(run.windows):  # everything was emitted complete above
                self._retire_window(run, key)
            for key in list(run.steps):
                self._retire_step(run, key)
            changed = True
        return out, changed

    def expired(self, run: Run, now_ns: int) -> bool:
        """True when the run's state can go: every attempt ended (or went silent long ago) and nothing is open."""
        quiet = now_ns - max(run.seen_ns, self.quiet_from(run))
        if run.windows or run.steps or run.alerts:
            return False
        return (not run.stalls and quiet >= self.retention_ns) or quiet >= 24 * 3600 * NS

    # -- closing -----------------------------------------------------------------------------
    def _progress(self, run: Run) -> int | None:
        """How far the run's spans are complete, in event time; None before any span.

        Only the spans streams count: the steps topic is read independently and, in a backlog,
        can be far ahead of the spans without saying anything about them (a step's STEP event
        still sets its end). A writer's spans arrive in time order, so its highest span time is
        how far its spans are in. A spans stream that has ended (its RUN_END named its last id
        and that id is applied) holds nothing back; one not heard from for the retention while
        the run's other spans streams were (a writer that died without RUN_END) no longer does.
        """
        finished, marks = run.finished, run.marks
        open_streams = [(t, r) for k, (t, r) in run.progress.items()
                        if k.startswith("spans|") and (k not in finished or marks.get(k, 0) < finished[k])]
        if not open_streams:
            # every writer that sent spans ended and all it numbered is in: nothing more will come
            return ALL_IN if any(k.startswith("spans|") for k in run.progress) else None
        resumed = self.quiet_from(run)  # after a restart every stream counts as heard from at the restart
        latest = max(max(r, resumed) for _, r in open_streams)
        return min(t for t, r in open_streams if max(r, resumed) >= latest - self.retention_ns)

    def _close(self, run: Run, now_ns: int, idle: bool) -> list[Output]:
        if compiled.LOOPS is not None:  # this method line for line, in C (streams/_loops.pyx)
            out: list[Output] = compiled.LOOPS.close(self, run, now_ns, idle, window_order, window_parts, step_order,
                                                     forget_run)
            return out
        progress = self._progress(run)
        out = []
        size, late = self.size_ns, self.lateness_ns
        for key in sorted(run.windows, key=window_order):
            w = run.windows[key]
            attempt, term, start = window_parts(key)
            start_ns = int(start)
            due = idle or (progress is not None and progress >= start_ns + size + late)
            if not w.closed and due:
                w.closed = True
                out += self._emit_window(run, int(attempt), term, start_ns, w, now_ns, first=True)
            elif w.dirty:
                out += self._emit_window(run, int(attempt), term, start_ns, w, now_ns, first=False)
            if w.closed and progress is not None and progress >= start_ns + size + late + self.retention_ns:
                self._retire_window(run, key)
        for key in sorted(run.steps, key=step_order):
            f = run.steps[key]
            attempt_no, step = step_order(key)
            due = idle or (f.end_ns is not None and progress is not None and progress >= f.end_ns + late)
            if not f.closed and due:
                f.closed = True
                out += self._emit_step(run, attempt_no, step, f, now_ns, first=True)
            elif f.dirty:
                out += self._emit_step(run, attempt_no, step, f, now_ns, first=False)
            if f.closed and f.end_ns is not None and progress is not None and progress >= f.end_ns + late + self.retention_ns:
                self._retire_step(run, key)
        if progress is not None:
            for key in [k for k, t in run.step_ends.items() if t + late + self.retention_ns <= progress]:
                del run.step_ends[key]
            # a stream far behind and long silent (an ended attempt, a stopped writer) is forgotten;
            # its sequence mark stays, so a replay of it is still recognised
            for key in [k for k, (t, r) in run.progress.items()
                        if t + self.retention_ns < progress and now_ns - max(r, self.quiet_from(run)) > self.retention_ns]:
                del run.progress[key]
        for ended in list(run.ended):
            if not any(k.split("|")[0] == str(ended) for k in list(run.steps) + list(run.windows)):
                forget_run(run.rules, run.project, run.run_id, ended)  # its step-rule state goes with it
        if run.alerts:  # after the steps and windows above were judged: a final-step alert fires, then resolves
            out += self._end_alerts(run, now_ns, idle)
        return out

    @staticmethod
    def _retire_window(run: Run, key: str) -> None:
        attempt, _, start = window_parts(key)
        del run.windows[key]
        run.retired_windows[attempt] = max(run.retired_windows.get(attempt, -1), int(start))

    @staticmethod
    def _retire_step(run: Run, key: str) -> None:
        attempt, step = key.split("|")
        del run.steps[key]
        run.retired_steps[attempt] = max(run.retired_steps.get(attempt, -1), int(step))

    def _emit_window(self, run: Run, attempt: int, term: str, start_ns: int, w: GraderWindow, now_ns: int,
                     first: bool) -> list[Output]:
        w.dirty = False
        ident, end_ns = run.ident(attempt), start_ns + self.size_ns
        out = [Output(GRADER_FAILURES_TOPIC, run.key, "GraderFailureWindow", r)
               for r in w.failure_records(ident, term, start_ns, end_ns, now_ns)]
        window = w.window_record(ident, term, start_ns, end_ns, now_ns)
        out.append(Output(GRADER_WINDOWS_TOPIC, run.key, "GraderWindow", window))
        # A late update of the newest closed window of its term is judged again: grader calls held
        # until their step completes (the SDK's grader_calls="step") reach a window after it closed.
        # An older window is not: its verdict was overtaken by a later window's.
        if first or self._newest_window(run, attempt, term, start_ns):
            # first seen at the window's end (event time): the same record if a crash makes us fire it again
            out += [self._alert(run, a) for a in grader_failure_rate(AlertBook(run.alerts), window, self.config.thresholds,
                                                                     now_ns, since_ns=end_ns)]
        return out

    @staticmethod
    def _newest_window(run: Run, attempt: int, term: str, start_ns: int) -> bool:
        """No closed window of the same attempt and term starts after ``start_ns``."""
        a, t = str(attempt), term
        return not any(w.closed and parts[0] == a and parts[1] == t and int(parts[2]) > start_ns
                       for parts, w in ((window_parts(k), w) for k, w in run.windows.items()))

    def _emit_step(self, run: Run, attempt: int, step: int, f: StepFigures, now_ns: int, first: bool) -> list[Output]:
        f.dirty = False
        ident = run.ident(attempt)
        stats = f.stats_record(ident, step, now_ns)
        out = [Output(STEP_STATS_TOPIC, run.key, "StepStats", stats)]
        out += [Output(REWARD_HISTOGRAMS_TOPIC, run.key, "RewardHistogram", r) for r in f.histogram_records(ident, step, now_ns)]
        out += [Output(STEP_TERMS_TOPIC, run.key, "StepTermStats", r) for r in f.term_records(ident, step, now_ns)]
        out.append(Output(LENGTH_HISTOGRAMS_TOPIC, run.key, "CompletionLengthHistogram", f.length_record(ident, step, now_ns)))
        if first:
            # first seen at the step's last rollout (event time): the same record if a crash makes us fire it again
            out += [self._alert(run, a) for a in step_rules(AlertBook(run.alerts), run.rules, stats, self.config.thresholds,
                                                            now_ns, since_ns=f.last_ns or None)]
        return out

    def _alert(self, run: Run, alert: dict[str, Any]) -> Output:
        # DEBUG: the alerts topic (and `rlpulse alerts`) is where people read them; a line per alert
        # cost 5% of the worker's time in a backlog with thousands of them.
        log.debug("alert %s %s %s: %s", alert["rule"], alert["state"], alert["key"], alert["summary"])
        return Output(ALERTS_TOPIC, run.key, "Alert", alert)


def often(before: int, after: int) -> bool:
    """True when a count going from ``before`` to ``after`` reached 1, 10, 100 ...: a flood of
    refusals logs a few lines, not one each."""
    return before == 0 < after or len(str(after)) > len(str(before))
