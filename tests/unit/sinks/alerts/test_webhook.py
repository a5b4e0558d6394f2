"""The webhook client of ``rlpulse alerts`` against loopback receivers that misbehave
(``tests/webhook_receivers.py``): ``--webhook-timeout`` bounds each POST whole, over HTTP and TLS,
and a POST past it is a failed try, retried per the feed's policy; an answer's body is read up to
``RESPONSE_CAP`` and no further; and no part of a password, whatever it holds, reaches the log
lines or the errors. The CLI's own output is ``tests/integration/sinks/alerts/test_webhook_cli.py``'s.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import tracemalloc
from pathlib import Path

import pytest

from rlpulse.base.urls import url_problem
from rlpulse.sinks.alerts.webhook import RESPONSE_CAP, Webhook
from tests.secret_passwords import PASSWORDS, encoded, leaks
from tests.webhook_receivers import DripReceiver, HugeBodyReceiver, StatusReceiver, self_signed

pytestmark = pytest.mark.full  # the fast tier is at its time limit

ALERT = dict(rule="stalled_run", state="FIRING", key="r1/1", severity="critical", summary="run r1 firing", value=900.0,
             threshold=900.0, project="p", run_id="r1", attempt=1, time_ns=1, first_seen_ns=1, last_seen_ns=2)
SLACK = 0.6  # seconds past the limit a POST may take to give up (thread start, a loaded machine)
NOTICE = 0.7  # seconds the drip receiver may take to notice the client hung up: two of its 0.3 s bytes


def wait_closed(receiver: DripReceiver, count: int) -> list[tuple[float, float]]:
    """The receiver's connections once ``count`` are closed: it notices a hang-up at its next byte or
    the one after (a send into a closed connection fails once the peer's reset came back)."""
    deadline = time.monotonic() + 5
    while len(receiver.connections) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return receiver.connections


def deliver(hook: Webhook, limit_s: float = 40.0) -> tuple[bool, float]:
    """``hook.deliver(ALERT)`` and the seconds it took (bounded, so the test of an unbounded client ends)."""
    started = time.monotonic()
    accepted = asyncio.run(asyncio.wait_for(hook.deliver(ALERT), limit_s))
    return accepted, time.monotonic() - started


@pytest.mark.parametrize("tls", [False, True])
def test_a_receiver_dripping_its_answer_is_given_up_on_at_the_timeout(tls: bool, tmp_path: Path, monkeypatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    # One byte every 0.3 s: each read gets a byte well within a per-read timeout, the whole answer takes ~27 s.
    certificates = self_signed(tmp_path) if tls else None
    if certificates:
        monkeypatch.setenv("SSL_CERT_FILE", str(certificates[0]))  # the client trusts the receiver's own certificate
    receiver = DripReceiver(interval=0.3, tls=certificates)
    try:
        hook = Webhook(receiver.url("alice:pw"), timeout_s=1.0, give_up_after_s=0.0)
        accepted, took = deliver(hook)
        assert receiver.requests == 1  # the request went through (the TLS handshake too): the answer is what drips
        assert not accepted and hook.failed == 1 and hook.delivered == 0
        assert took < 1.0 + SLACK, took
        (opened, closed), = wait_closed(receiver, 1)
        assert closed - opened < 1.0 + SLACK + NOTICE, closed - opened
    finally:
        receiver.close()
    assert "given up; last error no complete answer within 1s" in caplog.text


def test_a_post_past_the_timeout_is_a_failed_try_retried_per_the_policy(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    receiver = DripReceiver(interval=0.3)
    try:
        hook = Webhook(receiver.url(), timeout_s=0.8, give_up_after_s=1.2, backoff_s=0.05)
        accepted, took = deliver(hook)
        wait_closed(receiver, 3)
    finally:
        receiver.close()
    # tries at 0, ~0.85, ~1.75 s: the first failure starts the clock, the one 1.2 s after it gives up
    assert not accepted and receiver.requests == 3 and hook.failed == 1
    assert all(closed - opened < 0.8 + SLACK + NOTICE for opened, closed in receiver.connections), receiver.connections
    assert took < 3 * (0.8 + SLACK), took
    assert "no complete answer within 0.8s for stalled_run FIRING r1/1" in caplog.text and "retrying" in caplog.text
    assert "failed 3 times" in caplog.text


def test_a_huge_answer_is_read_up_to_the_cap_then_dropped() -> None:
    receiver = HugeBodyReceiver(size=200 << 20)  # streamed by the receiver, never built
    tracemalloc.start()
    try:
        hook = Webhook(receiver.url(), timeout_s=10.0)
        accepted, took = deliver(hook)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    deadline = time.monotonic() + 10
    while not receiver.sent and time.monotonic() < deadline:  # the receiver's send fails once the client closed
        time.sleep(0.05)
    receiver.close()
    assert accepted and hook.delivered == 1  # the 200 decides; the body never does
    assert peak < 8 << 20, peak  # was the whole body: 200 MiB in one bytes object
    # the client stopped reading at the cap: what was sent beyond it sat in the kernel's socket buffers
    assert receiver.sent and receiver.sent[0] < RESPONSE_CAP + (32 << 20), receiver.sent
    assert took < 5, took


def test_no_part_of_a_password_reaches_the_logs_or_the_errors(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    receiver = StatusReceiver()
    dead = "127.0.0.1:1"  # nothing listens on port 1
    printed: list[tuple[str, str, str]] = []  # (password, what was printed, the same for a neutral password)

    def run(password: str, userinfo: str, where: str, status: str) -> str:
        caplog.clear()
        url = f"http://{userinfo}@{where}/hooks/T0KEN/{status}?sig=S1G"
        try:
            hook = Webhook(url, timeout_s=2.0, give_up_after_s=0.0)
        except ValueError as exc:  # cannot be read: refused at once, in words of its own
            assert url_problem(url) is not None or "[" in password or "]" in password, url
            return f"{exc}\n{caplog.text}"
        accepted, _ = deliver(hook)
        assert not accepted
        return f"{hook.origin}\n{caplog.text}"

    try:
        for status, where, passwords in (("503", f"127.0.0.1:{receiver.port}", PASSWORDS),
                                         ("400", f"127.0.0.1:{receiver.port}", PASSWORDS[:40]), ("503", dead, PASSWORDS[:40])):
            # what is printed whatever the password: the lines of a neutral one, the refusals' own words
            neutral = "\n".join((run("NEUTRAL", "alice:NEUTRAL", where, status), url_problem("http://u:p/q@h/") or "",
                                  "it cannot be read as a URL (write a '[' or ']' inside its user or password as %5B, %5D)"))
            for password in passwords:
                for userinfo in (f"alice:{password}", f"alice:{encoded(password)}", encoded(password)):
                    before = len(receiver.authorizations)
                    printed.append((password, run(password, userinfo, where, status), neutral))
                    if where != dead and userinfo == f"alice:{encoded(password)}":  # sent, as HTTP Basic
                        assert receiver.authorizations[before:] == [
                            "Basic " + base64.b64encode(f"alice:{password}".encode()).decode()]
    finally:
        receiver.close()
    found = [(password, text) for password, text, neutral in printed if leaks(password, text, neutral)
             or "alice" in text or "T0KEN" in text or "S1G" in text]
    assert found == [], found[:3]
    logged = "\n".join(text for _, text, _ in printed)
    assert "HTTP 503; " not in logged and "retrying" not in logged  # give_up_after 0: one try, then given up
    assert "refused stalled_run FIRING r1/1" in logged and "last error connection refused" in logged
    assert "last error HTTP 503" in logged
