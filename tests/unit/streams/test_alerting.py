import json
from pathlib import Path
import random

import pytest

from rlpulse.base.settings import AlertThresholds
from rlpulse.streams.alerting import AlertBook, grader_failure_rate, hardware, hardware_tick, step_rules

S = 1_000_000_000
ALERT_FIELDS = [f["name"] for f in json.loads(
    (Path(__file__).resolve().parents[3] / "schemas" / "alert.avsc").read_text())["fields"]]
TH = AlertThresholds()  # failure rate 0.2, min graded 10, K = 3, zero fraction 0.5, XID quiet 900 s


def states(alerts):
    return [(a["rule"], a["state"], a["key"]) for a in alerts]


# --- AlertBook ---------------------------------------------------------------------------------

def fire(book, now_ns, value=1.0):
    return book.fire("xid", "GPU-1", now_ns=now_ns, value=value, threshold=0.0, summary="XID 79",
                     severity="critical", project="p", run_id="r1", attempt=2)


def test_alert_book_fires_once_per_episode_and_resolves_once():
    state = {}
    book = AlertBook(state)
    first = fire(book, 10)
    assert list(first) == ALERT_FIELDS
    assert first == {"rule": "xid", "state": "FIRING", "key": "GPU-1", "severity": "critical", "summary": "XID 79",
                     "value": 1.0, "threshold": 0.0, "project": "p", "run_id": "r1", "attempt": 2,
                     "time_ns": 10, "first_seen_ns": 10, "last_seen_ns": 10}
    assert book.is_firing("xid", "GPU-1") and not book.is_firing("xid", "GPU-2")
    [entry] = state.values()
    assert fire(book, 20, value=13.0) is None  # same episode: nothing new to say
    assert entry["last_seen_ns"] == 10  # the old value was replaced, not mutated
    assert [e["last_seen_ns"] for e in book.firing("xid")] == [20]
    json.dumps(state)  # table values stay JSON-able

    resolved = book.resolve("xid", "GPU-1", now_ns=30, value=13.0, summary="quiet")
    assert list(resolved) == ALERT_FIELDS
    assert (resolved["state"], resolved["first_seen_ns"], resolved["last_seen_ns"], resolved["time_ns"]) == \
        ("RESOLVED", 10, 30, 30)
    assert (resolved["severity"], resolved["threshold"], resolved["run_id"], resolved["attempt"]) == ("critical", 0.0, "r1", 2)
    assert resolved["summary"] == "quiet" and state == {}
    assert book.resolve("xid", "GPU-1", now_ns=40, value=0, summary="x") is None

    again = fire(book, 50)
    assert again["state"] == "FIRING" and again["first_seen_ns"] == 50  # a new episode


def test_alert_book_keys_rule_and_key_apart():
    book = AlertBook({})
    assert book.fire("a", "k", now_ns=1, value=1, threshold=0, summary="") is not None
    assert book.fire("b", "k", now_ns=1, value=1, threshold=0, summary="") is not None
    assert book.fire("a", "k2", now_ns=1, value=1, threshold=0, summary="") is not None
    assert len(book.firing()) == 3 and len(book.firing("a")) == 2


# --- grader failure rate -----------------------------------------------------------------------

def window(failures, graded, start=0, term="judge"):
    return dict(project="p", run_id="r1", attempt=1, term=term, window_start_ns=start, failures=failures, graded=graded)


def test_grader_failure_rate_respects_min_graded_fires_and_resolves():
    book = AlertBook({})
    assert grader_failure_rate(book, window(9, 9), TH, now_ns=1) == []  # too few scores to say
    assert grader_failure_rate(book, window(2, 10), TH, now_ns=2) == []  # exactly at the threshold
    [alert] = grader_failure_rate(book, window(3, 10, start=60 * S), TH, now_ns=3)
    assert (alert["rule"], alert["state"], alert["key"], alert["severity"]) == \
        ("grader_failure_rate", "FIRING", "p/r1/1/judge", "warning")
    assert alert["value"] == 0.3 and alert["threshold"] == 0.2
    assert grader_failure_rate(book, window(50, 60), TH, now_ns=4) == []  # same episode
    assert grader_failure_rate(book, window(0, 5), TH, now_ns=5) == []  # too few to resolve either
    assert grader_failure_rate(book, window(1, 10, term="format"), TH, now_ns=6) == []  # other term
    [resolved] = grader_failure_rate(book, window(2, 10), TH, now_ns=7)
    assert (resolved["state"], resolved["value"], resolved["first_seen_ns"]) == ("RESOLVED", 0.2, 3)
    assert grader_failure_rate(book, window(0, 10), TH, now_ns=8) == []


def test_grader_failure_rate_with_no_minimum_and_no_scores_does_not_divide_by_zero():
    assert grader_failure_rate(AlertBook({}), window(0, 0), AlertThresholds(grader_min_graded=0), 1) == []


# --- hardware ----------------------------------------------------------------------------------

def gpu(xid_errors=0, xid_last=None, throttle=0, hw_id="GPU-1"):
    return dict(project="p", run_id="r1", attempt=1, time_ns=0, hw_id=hw_id, index=0, host="h", node="n", pod="",
                rank=0, role="trainer", power_w=300.0, temperature_c=60.0, gpu_utilization=0.9,
                memory_used_bytes=1, memory_total_bytes=2, memory_utilization=0.5, memory_activity=0.4,
                sm_clock_mhz=1800.0, throttle_reasons=throttle, xid_errors=xid_errors, xid_last=xid_last)


def test_first_xid_fires_at_once_and_resolves_after_the_quiet_period():
    book, state = AlertBook({}), {}
    assert hardware(book, state, gpu(0), TH, now_ns=0) == []
    [alert] = hardware(book, state, gpu(1, 79), TH, now_ns=10 * S)
    assert (alert["rule"], alert["state"], alert["key"], alert["severity"], alert["value"]) == \
        ("xid", "FIRING", "GPU-1", "critical", 79.0)
    assert hardware(book, state, gpu(1, 79), TH, now_ns=20 * S) == []
    assert hardware(book, state, gpu(2, 13), TH, now_ns=100 * S) == []  # second XID: same episode
    assert hardware_tick(book, state, TH, now_ns=999 * S) == []  # quiet period restarted at 100 s
    [resolved] = hardware_tick(book, state, TH, now_ns=1000 * S)
    assert (resolved["state"], resolved["value"], resolved["first_seen_ns"], resolved["last_seen_ns"]) == \
        ("RESOLVED", 13.0, 10 * S, 1000 * S)
    assert hardware_tick(book, state, TH, now_ns=2000 * S) == []
    assert hardware(book, state, gpu(2, 13), TH, now_ns=2001 * S) == []  # no increase, no alert
    [new] = hardware(book, state, gpu(3, 48), TH, now_ns=2002 * S)
    assert new["state"] == "FIRING" and new["first_seen_ns"] == 2002 * S


def test_xid_counts_from_zero_so_a_first_sample_with_xids_fires():
    book, state = AlertBook({}), {}
    assert states(hardware(book, state, gpu(2, 31, hw_id="GPU-9"), TH, now_ns=0)) == [("xid", "FIRING", "GPU-9")]


def test_xid_quiet_period_can_also_end_on_a_sample():
    book, state = AlertBook({}), {}
    hardware(book, state, gpu(1, 79), TH, now_ns=0)
    assert states(hardware(book, state, gpu(1, 79), TH, now_ns=900 * S)) == [("xid", "RESOLVED", "GPU-1")]


def test_xid_count_reset_by_a_restarted_poller_becomes_the_new_baseline():
    book, state = AlertBook({}), {}
    hardware(book, state, gpu(3, 79), TH, now_ns=0)
    hardware_tick(book, state, TH, now_ns=900 * S)
    assert hardware(book, state, gpu(0), TH, now_ns=901 * S) == []
    assert states(hardware(book, state, gpu(1, 43), TH, now_ns=902 * S)) == [("xid", "FIRING", "GPU-1")]


def test_hw_slowdown_fires_on_bit_0x8_only_and_resolves_on_the_first_sample_without_it():
    book, state = AlertBook({}), {}
    assert hardware(book, state, gpu(throttle=0x1), TH, now_ns=1) == []  # idle alone
    assert hardware(book, state, gpu(throttle=0x4), TH, now_ns=2) == []  # a power cap is not 0x8
    [alert] = hardware(book, state, gpu(throttle=0x9), TH, now_ns=3)
    assert (alert["rule"], alert["state"], alert["key"], alert["value"], alert["threshold"]) == \
        ("hw_slowdown", "FIRING", "GPU-1", 9.0, 8.0)
    assert hardware(book, state, gpu(throttle=0x8), TH, now_ns=4) == []
    [resolved] = hardware(book, state, gpu(throttle=0x1), TH, now_ns=5)
    assert (resolved["state"], resolved["first_seen_ns"], resolved["last_seen_ns"]) == ("RESOLVED", 3, 5)
    assert hardware(book, state, gpu(throttle=0x0), TH, now_ns=6) == []


# --- step rules --------------------------------------------------------------------------------

def stats(step, ratio, zero=0.0, attempt=1):
    return dict(project="p", run_id="r1", attempt=attempt, step=step, rollouts=100, clipped=int(ratio * 100),
                clipped_ratio=ratio, reward_mean=0.5, reward_zero_fraction=zero)


def test_clipped_ratio_rising_fires_exactly_at_the_kth_increase_and_resolves_when_it_stops():
    book, state = AlertBook({}), {}
    for step, ratio in [(1, 0.10), (2, 0.20), (3, 0.30)]:  # two increases
        assert step_rules(book, state, stats(step, ratio), TH, now_ns=step) == []
    [alert] = step_rules(book, state, stats(4, 0.40), TH, now_ns=4)  # the third increase
    assert (alert["rule"], alert["state"], alert["key"], alert["value"], alert["threshold"]) == \
        ("clipped_ratio_rising", "FIRING", "p/r1/1", 0.4, 3.0)
    assert step_rules(book, state, stats(5, 0.50), TH, now_ns=5) == []
    [resolved] = step_rules(book, state, stats(6, 0.50), TH, now_ns=6)  # equal is not rising
    assert (resolved["state"], resolved["first_seen_ns"]) == ("RESOLVED", 4)
    assert step_rules(book, state, stats(7, 0.60), TH, now_ns=7) == []


def test_a_resent_update_of_the_same_step_does_not_advance_the_count():
    book, state = AlertBook({}), {}
    step_rules(book, state, stats(1, 0.10), TH, now_ns=1)
    step_rules(book, state, stats(2, 0.20), TH, now_ns=2)
    assert step_rules(book, state, stats(2, 0.20), TH, now_ns=3) == []  # duplicate
    assert step_rules(book, state, stats(2, 0.25), TH, now_ns=4) == []  # update: still one increase
    assert step_rules(book, state, stats(3, 0.30), TH, now_ns=5) == []  # two increases
    assert step_rules(book, state, stats(3, 0.30), TH, now_ns=6) == []  # still two
    assert step_rules(book, state, stats(2, 0.05), TH, now_ns=7) == []  # an older step is ignored
    assert states(step_rules(book, state, stats(4, 0.40), TH, now_ns=8)) == [("clipped_ratio_rising", "FIRING", "p/r1/1")]
    # an update of step 4 that turns out not to rise resolves
    assert states(step_rules(book, state, stats(4, 0.30), TH, now_ns=9)) == [("clipped_ratio_rising", "RESOLVED", "p/r1/1")]


def test_attempts_are_separate_series_for_step_rules():
    book, state = AlertBook({}), {}
    for step, ratio in [(1, 0.1), (2, 0.2), (3, 0.3)]:
        step_rules(book, state, stats(step, ratio), TH, now_ns=step)
    assert step_rules(book, state, stats(4, 0.4, attempt=2), TH, now_ns=4) == []


def test_reward_collapse_fires_above_the_zero_fraction_and_resolves_at_or_below_it():
    book, state = AlertBook({}), {}
    assert step_rules(book, state, stats(1, 0.1, zero=0.5), TH, now_ns=1) == []  # at the threshold
    [alert] = step_rules(book, state, stats(2, 0.1, zero=0.6), TH, now_ns=2)
    assert (alert["rule"], alert["state"], alert["key"], alert["value"], alert["threshold"], alert["severity"]) == \
        ("reward_collapse", "FIRING", "p/r1/1", 0.6, 0.5, "warning")
    assert step_rules(book, state, stats(3, 0.1, zero=0.9), TH, now_ns=3) == []
    [resolved] = step_rules(book, state, stats(4, 0.1, zero=0.5), TH, now_ns=4)
    assert (resolved["rule"], resolved["state"], resolved["first_seen_ns"]) == ("reward_collapse", "RESOLVED", 2)


def test_the_pollers_at_once_xid_sample_neither_resolves_nor_refires_a_slowdown():
    """Its throttle reasons are one reading (or none), not the OR of an export interval."""
    book, state = AlertBook({}), {}
    seq = [hardware(book, state, gpu(0, throttle=0x9), TH, now_ns=1, since_ns=10),
           hardware(book, state, gpu(1, 79, throttle=0x0), TH, now_ns=2, since_ns=20),  # the XID, at once
           hardware(book, state, gpu(1, 79, throttle=0x9), TH, now_ns=3, since_ns=30),  # the next export
           hardware(book, state, gpu(1, 79, throttle=0x1), TH, now_ns=4, since_ns=40)]
    assert [states(out) for out in seq] == [[("hw_slowdown", "FIRING", "GPU-1")], [("xid", "FIRING", "GPU-1")], [],
                                           [("hw_slowdown", "RESOLVED", "GPU-1")]]
    assert seq[3][0]["first_seen_ns"] == 10  # since_ns: the sample's time, not the clock


@pytest.mark.full
def test_an_alert_books_key_is_the_json_of_rule_and_key_whatever_the_key_holds() -> None:
    # The book key is stored in every run's state: the fast path must write what json.dumps writes.
    rng = random.Random(5)
    alphabet = [chr(i) for i in range(0, 300)] + ['"', "\\", "\u2028", "\U0001f600"]
    keys = ["p/r/1/judge", "", '"', "\\", "\x7f", "~", " "] + [
        "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 8))) for _ in range(5000)]
    for key in keys:
        assert AlertBook._key("grader_failure_rate", key) == json.dumps(["grader_failure_rate", key], separators=(",", ":"))
