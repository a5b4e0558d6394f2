"""Alert rules and their once-per-episode bookkeeping, with state in any mutable mapping.

An *episode* runs from the first FIRING record of a (rule, key) to its RESOLVED record; in
between, a rule that still holds produces nothing. After RESOLVED the next firing opens a new
episode. State lives in mappings passed in (Faust tables in
production, plain dicts in tests), values are JSON-able dicts that are replaced, never mutated
in place, and time comes in as ``now_ns`` (wall clock of the stream processor).

Severity: ``xid``, ``stalled_run`` and ``first_step_stalled`` are ``critical`` (a GPU fault or a
job that no longer makes progress burns the whole allocation); every other rule is ``warning`` (a quality or
telemetry signal that someone should look at, but the job is still training). ``silent_run`` is
a warning because silence may come from the exporter or the network as well as from the job.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any
from collections.abc import MutableMapping

from rlpulse.schemas.catalogue import engine_key
from rlpulse.base.env import STALL_AFTER
from rlpulse.base.settings import AlertThresholds
from rlpulse.schemas import gpu_health

_PLAIN = re.compile(r'[ !#-\[\]-~]*')  # what json.dumps writes as it is: printable ASCII but '"' and '\\'

NS = 1_000_000_000
SLOWDOWN_BIT = 0x8  # NVML clocks event reason: hardware slowdown (seed 001, "GPU health")

SEVERITY = {
    "stalled_run": "critical",
    "first_step_stalled": "critical",  # a job stuck at start-up holds its whole allocation too
    "silent_run": "warning",
    "grader_failure_rate": "warning",
    "xid": "critical",
    "hw_slowdown": "warning",
    "clipped_ratio_rising": "warning",
    "reward_collapse": "warning",
    "policy_stale": "warning",
    "checkpoint_failed": "critical",  # a run that cannot save loses its progress at the next fault
    "engine_saturated": "warning",  # rollouts queue and slow down; the run still trains
}
# What each rule means, for people reading an alert (docs/reference/alerts.md is generated from it).
MEANING = {
    "stalled_run": "a run still reports, but its step count has not increased for its stall window "
                   f"(factor x its own median step time, clamped; {STALL_AFTER} before it has one)",
    "first_step_stalled": f"a run still reports, but has not completed its first step {STALL_AFTER} "
                          "after its first report (stuck at start-up)",
    "silent_run": "a run has sent no event at all for the silence window",
    "grader_failure_rate": "a reward term's failed scores over its graded scores, in one window, is over the threshold",
    "xid": "a GPU reported its first XID error (resolves after a quiet period without a new one); the summary "
           "gives its class. " + gpu_health.xid_classes_table(),
    "hw_slowdown": f"a GPU's clocks are cut by the hardware slowdown throttle reason (bit {gpu_health.HW_SLOWDOWN_BIT:#x}); "
                   f"the summary names every reason set, of: {gpu_health.throttle_reasons_table()}",
    "clipped_ratio_rising": "the share of rollouts truncated at the maximum length rose over consecutive steps",
    "reward_collapse": "a step's rewards are at or below zero too often (the total's zero fraction)",
    "policy_stale": "a step trained on rollouts generated more steps before it than the staleness bound",
    "checkpoint_failed": "a checkpoint save failed",
    "engine_saturated": "a vLLM engine has requests waiting with its KV cache nearly full, for too long",
}
# What each rule's key names, and so what ends its episodes besides its own condition (the
# generated alerts reference shows it). ``run``: keyed by project/run_id/attempt (a grader term
# after it): the run processor resolves every open one with "run ended" once the attempt has sent
# RUN_END (or was superseded by a newer attempt) and its last steps and windows were judged.
# ``gpu``: keyed by hw_id; the GPU outlives the run, so its own rule resolves it (an XID after a
# quiet period, a slowdown when the bit clears). ``engine``: keyed by the vLLM engine (pod, url,
# engine); it resolves when a sample shows the engine no longer saturated.
SCOPE = {
    "stalled_run": "run", "first_step_stalled": "run", "silent_run": "run", "grader_failure_rate": "run",
    "clipped_ratio_rising": "run", "reward_collapse": "run", "policy_stale": "run", "checkpoint_failed": "run",
    "xid": "gpu", "hw_slowdown": "gpu", "engine_saturated": "engine",
}
RUN_SCOPED = frozenset(rule for rule, scope in SCOPE.items() if scope == "run")
if not set(MEANING) == set(SEVERITY) == set(SCOPE):  # a rule added to one and not the others would go undocumented
    raise ImportError("alert rules without a meaning, a severity or a scope: "
                      f"{sorted((set(MEANING) | set(SEVERITY) | set(SCOPE)) - (set(MEANING) & set(SEVERITY) & set(SCOPE)))}")


class AlertBook:
    """Which (rule, key) episodes are firing; turns rule outcomes into Alert records.

    Only firing episodes are stored: resolving deletes the entry, so the mapping holds no more
    than the alerts open right now.
    """

    def __init__(self, state: MutableMapping[str, dict]):
        self.state = state

    @staticmethod
    def _key(rule: str, key: str) -> str:
        # JSON of [rule, key]: written out directly when neither needs escaping (printable ASCII
        # without '"' or '\\'), the usual case, as json.dumps would (it was 2% of the worker's time)
        if _PLAIN.fullmatch(rule) and _PLAIN.fullmatch(key):
            return f'["{rule}","{key}"]'
        return json.dumps([rule, key], separators=(",", ":"))

    def fire(self, rule: str, key: str, *, now_ns: int, value: float, threshold: float, summary: str,
             severity: str = "warning", project: str = "", run_id: str = "", attempt: int = 0,
             since_ns: int | None = None) -> dict | None:
        """The FIRING record when this opens an episode; None while the episode is already open.

        An open episode still gets ``last_seen_ns`` and ``value`` updated, so the RESOLVED record
        says when the condition was last seen to hold.

        ``since_ns`` (default ``now_ns``) becomes ``first_seen_ns``: when the condition began, as
        the inputs say (a step's or window's event time, a sample's time, the last report plus
        the silence limit). The sink keys alerts on (rule, key, first_seen_ns, state), so an
        episode fired again after a crash lost the state write that recorded it (the output was
        sent, the changelog write was not) lands on the same row instead of opening a second,
        never-resolved one.
        """
        book_key = self._key(rule, key)
        current = self.state.get(book_key)
        if current is not None:
            self.state[book_key] = {**current, "last_seen_ns": now_ns, "value": float(value)}
            return None
        entry = {
            "rule": rule, "key": key, "severity": severity, "summary": summary, "value": float(value),
            "threshold": float(threshold), "project": project, "run_id": run_id, "attempt": int(attempt),
            "first_seen_ns": now_ns if since_ns is None else int(since_ns), "last_seen_ns": now_ns,
        }
        self.state[book_key] = entry
        return _record(entry, "FIRING", now_ns)

    def resolve(self, rule: str, key: str, *, now_ns: int, value: float, summary: str) -> dict | None:
        """The RESOLVED record (same ``first_seen_ns``, ``last_seen_ns`` = now) if firing, else None."""
        if not self.state:  # nothing open, the usual case: every closed window and step asks
            return None
        book_key = self._key(rule, key)
        current = self.state.get(book_key)
        if current is None:
            return None
        del self.state[book_key]
        entry = {**current, "value": float(value), "summary": summary, "last_seen_ns": now_ns}
        return _record(entry, "RESOLVED", now_ns)

    def is_firing(self, rule: str, key: str) -> bool:
        return self._key(rule, key) in self.state

    def firing(self, rule: str | None = None) -> list[dict]:
        """Open episodes (all, or of one rule), in book-key order."""
        return [v for _, v in sorted(self.state.items()) if rule is None or v["rule"] == rule]


def _record(entry: dict, state: str, now_ns: int) -> dict:
    """An Alert record: exactly the fields of schemas/alert.avsc, in its order."""
    return {
        "rule": entry["rule"], "state": state, "key": entry["key"], "severity": entry["severity"],
        "summary": entry["summary"], "value": entry["value"], "threshold": entry["threshold"],
        "project": entry["project"], "run_id": entry["run_id"], "attempt": entry["attempt"],
        "time_ns": now_ns, "first_seen_ns": entry["first_seen_ns"], "last_seen_ns": entry["last_seen_ns"],
    }


def _emit(*records: dict | None) -> list[dict]:
    return [r for r in records if r is not None]


def _utc(t_ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t_ns / 1e9))


def grader_failure_rate(book: AlertBook, window: dict[str, Any], thresholds: AlertThresholds,
                        now_ns: int, since_ns: int | None = None) -> list[dict]:
    """Failure rate of one closed window of one term (totals over causes and partitions).

    A window with fewer than ``grader_min_graded`` scores says nothing: it neither fires nor
    resolves. Windows are expected in close order, which is start order (same size for all).
    ``since_ns``: the episode's first_seen_ns (the run processor passes the window's end).
    """
    graded, failures = window["graded"], window["failures"]
    if graded <= 0 or graded < thresholds.grader_min_graded:
        return []
    rate = failures / graded
    limit = thresholds.grader_failure_rate
    if rate <= limit and not book.state:  # nothing open to resolve, the usual case: no key or summary to write
        return []
    key = f"{window['project']}/{window['run_id']}/{window['attempt']}/{window['term']}"
    if rate > limit:
        return _emit(book.fire(
            "grader_failure_rate", key, now_ns=now_ns, value=rate, threshold=limit,
            summary=f"term {window['term']}: {failures} of {graded} scores failed ({rate:.0%}) "
                    f"in the window from {_utc(window['window_start_ns'])}",
            severity=SEVERITY["grader_failure_rate"], project=window["project"], run_id=window["run_id"],
            attempt=window["attempt"], since_ns=since_ns))
    return _emit(book.resolve(
        "grader_failure_rate", key, now_ns=now_ns, value=rate,
        summary=f"term {window['term']}: failure rate back to {rate:.0%} ({failures} of {graded})"))


def hardware(book: AlertBook, state: MutableMapping[str, dict], sample: dict[str, Any],
             thresholds: AlertThresholds, now_ns: int, since_ns: int | None = None) -> list[dict]:
    """XID and hardware-slowdown rules for one GpuSample; ``state`` is keyed by ``hw_id``.

    The XID count is published from zero, so the first sample with ``xid_errors > 0`` fires. A
    count below the one seen before (the poller restarted and counts from zero again) is taken
    as the new baseline without firing. The quiet period runs from the processing time at which
    the last increase was seen.

    A sample that raises the XID count is the poller's at-once XID report, published between
    its regular exports: its ``throttle_reasons`` is one instantaneous reading (or none at all),
    not the OR over an export interval, so it may open a slowdown episode but never closes one;
    the next regular export says whether the slowdown is over. ``since_ns``: the first_seen_ns
    of an episode this sample opens (the hardware stage passes the sample's time).
    """
    hw_id = sample["hw_id"]
    ident = {"project": sample.get("project", ""), "run_id": sample.get("run_id", ""),
             "attempt": sample.get("attempt", 0)}
    seen = state.get(hw_id) or {"xid_errors": 0, "xid_last": None, "xid_increased_ns": None}
    count = int(sample.get("xid_errors") or 0)
    out: list[dict | None] = []
    new = {**seen, **ident, "xid_errors": count}
    xid_report = count > seen["xid_errors"]
    if xid_report:
        new["xid_last"] = sample.get("xid_last")
        new["xid_increased_ns"] = now_ns
        code = new["xid_last"]
        # A poller older than the class field: classify here, from the same catalogue.
        klass = sample.get("xid_class") or gpu_health.xid_class(code)
        what = gpu_health.xid_description(code)
        out.append(book.fire(
            "xid", hw_id, now_ns=now_ns, value=float(code or 0), threshold=0.0,
            summary=f"XID {code} ({klass}{': ' + what if what else ''}) on GPU {hw_id} (index {sample.get('index')}, "
                    f"host {sample.get('host', '')}); {count} XIDs since the count started",
            severity=SEVERITY["xid"], since_ns=since_ns, **ident))
    if new != seen:  # most samples change nothing; skip the changelog write for them
        state[hw_id] = new
    out.extend(_xid_quiet(book, hw_id, new, thresholds, now_ns))

    reasons = int(sample.get("throttle_reasons") or 0) & 0xFFFF_FFFF_FFFF_FFFF  # an Avro long: bit 63 negative
    names = ", ".join(gpu_health.throttle_reason_names(reasons)) or "none"
    if reasons & gpu_health.HW_SLOWDOWN_BIT:  # with hw_thermal / hw_power_brake naming the cause when set
        out.append(book.fire(
            "hw_slowdown", hw_id, now_ns=now_ns, value=float(reasons), threshold=float(gpu_health.HW_SLOWDOWN_BIT),
            summary=f"GPU {hw_id} clocks held down by the hardware: {names} (throttle reasons {reasons:#x})",
            severity=SEVERITY["hw_slowdown"], since_ns=since_ns, **ident))
    elif not xid_report:
        out.append(book.resolve(
            "hw_slowdown", hw_id, now_ns=now_ns, value=float(reasons),
            summary=f"GPU {hw_id} no longer slowed down by the hardware: {names} (throttle reasons {reasons:#x})"))
    return _emit(*out)


def hardware_tick(book: AlertBook, state: MutableMapping[str, dict], thresholds: AlertThresholds,
                  now_ns: int) -> list[dict]:
    """Wall-clock check: resolve XID alerts whose GPU has had no new XID for ``xid_quiet_after``."""
    out: list[dict] = []
    for hw_id, seen in sorted(state.items()):
        out.extend(_xid_quiet(book, hw_id, seen, thresholds, now_ns))
    return out


def _xid_quiet(book: AlertBook, hw_id: str, seen: dict, thresholds: AlertThresholds, now_ns: int) -> list[dict]:
    since = seen.get("xid_increased_ns")
    if since is None or now_ns - since < thresholds.xid_quiet_after * NS or not book.is_firing("xid", hw_id):
        return []
    return _emit(book.resolve(
        "xid", hw_id, now_ns=now_ns, value=float(seen.get("xid_last") or 0),
        summary=f"no new XID on GPU {hw_id} for {thresholds.xid_quiet_after:g}s"))


def engine_saturated(book: AlertBook, state: MutableMapping[str, dict], sample: dict[str, Any],
                     thresholds: AlertThresholds, now_ns: int) -> list[dict]:
    """One EngineSample: an engine with requests waiting and its KV cache at least ``engine_kv_usage``
    full, continuously for longer than ``engine_saturated_after``, fires; the first sample that is
    not saturated resolves. ``state`` is keyed by ``engine_key`` and keeps when the saturation began.

    Time is the samples' own (``time_ns``, the scrape's), so a backlog read late gives the same
    episodes, and ``first_seen_ns`` is when the saturation began. A sample lacking either figure (an
    engine that does not export it) neither fires, resolves nor breaks the streak.
    """
    waiting, usage = sample.get("requests_waiting"), sample.get("kv_cache_usage")
    if waiting is None or usage is None:
        return []
    key = engine_key(sample.get("pod", ""), sample["url"], sample.get("engine", ""))
    ident = {"project": sample.get("project", ""), "run_id": sample.get("run_id", ""), "attempt": sample.get("attempt", 0)}
    limit, t = thresholds.engine_kv_usage, int(sample["time_ns"])
    since = (state.get(key) or {}).get("since_ns")
    if waiting > 0 and usage >= limit:
        if since is None:
            since = t
            state[key] = {"since_ns": since}
        held_s = (t - since) / NS
        if held_s <= thresholds.engine_saturated_after:
            return []
        return _emit(book.fire(
            "engine_saturated", key, now_ns=now_ns, value=float(usage), threshold=limit,
            summary=f"engine {key}: {waiting:g} requests waiting with the KV cache {usage:.0%} full for {held_s:.0f}s",
            severity=SEVERITY["engine_saturated"], since_ns=since, **ident))
    if since is not None:
        state[key] = {"since_ns": None}
    return _emit(book.resolve(
        "engine_saturated", key, now_ns=now_ns, value=float(usage),
        summary=f"engine {key}: {waiting:g} requests waiting, KV cache {usage:.0%} full"))


def step_rules(book: AlertBook, state: MutableMapping[str, dict], step_stats: dict[str, Any],
               thresholds: AlertThresholds, now_ns: int, since_ns: int | None = None) -> list[dict]:
    """Clipped-ratio-rising, reward-collapse and policy-stale rules for one per-step stats update.

    ``state`` is keyed ``project/run_id/attempt`` and keeps the latest step, its clipped ratio and the
    run of increases ending there, plus the same for the step before it. A re-sent update of the
    latest step is measured against the step before it again, so it never counts twice; an
    update of an older step is ignored (it would rewrite history the rules already acted on).
    Steps are consecutive in arrival order: a gap in step numbers is not a break in the run.
    ``since_ns``: the first_seen_ns of an episode this step opens (the run processor passes the
    step's event time).
    """
    run_id, attempt = step_stats["run_id"], step_stats["attempt"]
    key = f"{step_stats.get('project', '')}/{run_id}/{attempt}"
    ident = {"project": step_stats.get("project", ""), "run_id": run_id, "attempt": attempt}
    step = step_stats["step"]
    ratio = step_stats.get("clipped_ratio")
    seen = state.get(key)
    if seen is not None and step < seen["step"]:
        return []
    if seen is not None and step == seen["step"]:
        prev_ratio, prev_rises = seen["prev_ratio"], seen["prev_rises"]
    elif seen is not None:
        prev_ratio, prev_rises = seen["ratio"], seen["rises"]
    else:
        prev_ratio, prev_rises = None, 0
    if ratio is None:  # no rollouts in this step: the run of increases neither grows nor breaks
        rises, ratio = prev_rises, prev_ratio
    else:
        rises = prev_rises + 1 if prev_ratio is not None and ratio > prev_ratio else 0
    state[key] = {"step": step, "ratio": ratio, "rises": rises, "prev_ratio": prev_ratio, "prev_rises": prev_rises}

    out: list[dict | None] = []
    k = thresholds.clipped_rising_steps
    if rises >= k:
        out.append(book.fire(
            "clipped_ratio_rising", key, now_ns=now_ns, value=float(ratio), threshold=float(k),
            summary=f"clipped ratio rose {rises} steps in a row to {ratio:.3f} at step {step}",
            severity=SEVERITY["clipped_ratio_rising"], since_ns=since_ns, **ident))
    elif rises == 0 and ratio is not None:
        out.append(book.resolve(
            "clipped_ratio_rising", key, now_ns=now_ns, value=float(ratio),
            summary=f"clipped ratio stopped rising at step {step} ({ratio:.3f})"))

    zero = step_stats.get("reward_zero_fraction")
    if zero is not None:
        limit = thresholds.reward_zero_fraction
        if zero > limit:
            out.append(book.fire(
                "reward_collapse", key, now_ns=now_ns, value=float(zero), threshold=limit,
                summary=f"{zero:.0%} of rewards at step {step} are <= 0",
                severity=SEVERITY["reward_collapse"], since_ns=since_ns, **ident))
        else:
            out.append(book.resolve(
                "reward_collapse", key, now_ns=now_ns, value=float(zero),
                summary=f"rewards <= 0 down to {zero:.0%} at step {step}"))

    stale = step_stats.get("staleness_max")
    if stale is not None:  # only rollouts that name their policy version say anything
        bound = thresholds.staleness_max
        if stale > bound:
            out.append(book.fire(
                "policy_stale", key, now_ns=now_ns, value=float(stale), threshold=float(bound),
                summary=f"step {step} trained on rollouts {stale} steps old (at most {bound})",
                severity=SEVERITY["policy_stale"], since_ns=since_ns, **ident))
        else:
            out.append(book.resolve(
                "policy_stale", key, now_ns=now_ns, value=float(stale),
                summary=f"rollouts of step {step} at most {stale} steps old"))
    return _emit(*out)


def checkpoint_rule(book: AlertBook, span: dict[str, Any], now_ns: int) -> list[dict]:
    """A failed checkpoint save fires ``checkpoint_failed`` for its attempt; the next successful
    save resolves it (restores say nothing). ``span`` is a CHECKPOINT span."""
    if span.get("checkpoint_op") != "save":
        return []
    ident = {"project": span.get("project", ""), "run_id": span["run_id"], "attempt": span["attempt"]}
    key = f"{ident['project']}/{ident['run_id']}/{ident['attempt']}"
    step = span.get("step")
    if span.get("outcome") == "failed":
        why = (span.get("status_message") or "")[:200]
        return _emit(book.fire(
            "checkpoint_failed", key, now_ns=now_ns, value=float(step or 0), threshold=0.0,
            summary=f"checkpoint save at step {step} failed" + (f": {why}" if why else ""),
            severity=SEVERITY["checkpoint_failed"], since_ns=span["time_ns"], **ident))
    return _emit(book.resolve("checkpoint_failed", key, now_ns=now_ns, value=float(step or 0),
                              summary=f"checkpoint saved at step {step}"))


def forget_run(state: MutableMapping[str, dict], project: str, run_id: str, attempt: int) -> None:
    """Drop the step-rule state of an attempt that ended (the wiring calls it on RUN_END)."""
    state.pop(f"{project}/{run_id}/{attempt}", None)


def end_attempt(book: AlertBook, project: str, run_id: str, attempt: int, now_ns: int, why: str = "run ended") -> list[dict]:
    """RESOLVED records for every open run-scoped episode (``SCOPE``) of one attempt, in (rule, key) order.

    The summary is ``run <run_id> attempt <n>: <why>``; the value stays the last one seen. GPU- and
    engine-scoped episodes that carry the run's identity (an XID on a GPU placed on it) are left
    to their own rules. Resolving deletes the entry, so a second call returns nothing.
    """
    mine = sorted((e["rule"], e["key"]) for e in book.state.values()
                  if e["rule"] in RUN_SCOPED and e["attempt"] == attempt and e["run_id"] == run_id
                  and e["project"] == project)
    out: list[dict] = []
    for rule, key in mine:
        current = book.state[book._key(rule, key)]
        out += _emit(book.resolve(rule, key, now_ns=now_ns, value=current["value"],
                                  summary=f"run {run_id} attempt {attempt}: {why}"))
    return out
