"""``rlpulse alerts --webhook URL`` as a user runs it, against the real broker: ``--webhook-timeout``
bounds a POST to a receiver that drips its answer (it took the whole drip, 10 s against 1 s, when the
limit was per socket read), and no part of a webhook password, whatever it holds, reaches the
command's output (stdout and stderr: its log lines, its summary, its errors), whether the URL comes
from ``--webhook`` or from ``RLPULSE_ALERTS_WEBHOOK``. The client's own paths are
``tests/unit/sinks/alerts/test_webhook.py``'s."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from rlpulse.base.settings import Settings
from rlpulse.base.urls import url_problem
from rlpulse.pipeline import settings_env
from rlpulse.schemas.topics import ensure_topics
from tests.integration.sinks.alerts.test_alert_feed import alert, publish
from tests.secret_passwords import encoded, leaks
from tests.webhook_receivers import DripReceiver, StatusReceiver

pytestmark = [pytest.mark.integration, pytest.mark.full]  # the fast tier is at its time limit

# The report's password, then one per delimiter a URL parser trips on, and unicode
CLI_PASSWORDS = ("s3cr/et", "Pw#Secret9", "Pw?Sec@ret9", "Pw:Se%2Fcret", "Pw[v6]Secret", "Pw日本€Secret")


def alerts(settings: Settings, group: str, *args: str,
           env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "rlpulse.cli", "alerts", "--from-beginning", "--once", "-v",
                          "--group", group, *args], env={**settings_env(settings), **(env or {})},
                         capture_output=True, text=True, timeout=120)
    return run, time.monotonic() - started


def test_the_webhook_timeout_bounds_a_post_to_a_dripping_receiver(settings: Settings) -> None:
    ensure_topics(settings)
    publish(settings, [alert("FIRING")])
    receiver = DripReceiver(interval=0.3)  # 0.3 s a byte: the answer takes ~27 s, each read ~0.3 s
    try:
        run, _ = alerts(settings, "drip", "--webhook", receiver.url("alice:Dr1pSecret"), "--webhook-timeout", "1s",
                        "--give-up-after", "0s")
        deadline = time.monotonic() + 5
        while not receiver.connections and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        receiver.close()
    assert run.returncode == 0, run.stderr
    assert receiver.requests == 1
    (opened, closed), = receiver.connections
    assert closed - opened < 1.0 + 1.3, closed - opened  # the limit, the feed's slack, the receiver noticing
    assert f"webhook http://127.0.0.1:{receiver.port}: 0 delivered, 1 failed, 0 not delivered" in run.stdout, run.stdout
    assert "given up; last error no complete answer within 1s" in run.stderr, run.stderr
    assert "Dr1pSecret" not in run.stdout + run.stderr and "alice" not in run.stdout + run.stderr


def test_no_part_of_a_webhook_password_reaches_the_commands_output(settings: Settings) -> None:
    ensure_topics(settings)
    publish(settings, [alert("FIRING")])
    receiver = StatusReceiver()  # answers the status the path ends in: 503, retried until given up
    where = f"127.0.0.1:{receiver.port}"
    outputs: list[tuple[str, str, str]] = []
    try:
        neutral_run, _ = alerts(settings, "neutral", "--webhook", f"http://alice:NEUTRAL@{where}/hooks/T0KEN/503?sig=S1G",
                                "--give-up-after", "0s")
        neutral = neutral_run.stdout + neutral_run.stderr + (url_problem("http://u:p/q@h/") or "") + \
            "it cannot be read as a URL (write a '[' or ']' inside its user or password as %5B, %5D)"
        for i, password in enumerate(CLI_PASSWORDS):
            for j, pw in enumerate((password, encoded(password))):
                url = f"http://alice:{pw}@{where}/hooks/T0KEN/503?sig=S1G"
                by_env = (i + j) % 2 == 1  # half through the environment, as the docs advise for secrets
                run, _ = alerts(settings, f"g{i}-{j}", *(() if by_env else ("--webhook", url)), "--give-up-after", "0s",
                                env={"RLPULSE_ALERTS_WEBHOOK": url} if by_env else None)
                outputs.append((password, run.stdout + run.stderr, url))
                if url_problem(url) is None and "[" not in pw:  # it can be read: posted, 503, given up
                    assert run.returncode == 0 and "0 delivered, 1 failed" in run.stdout, run.stdout + run.stderr
                else:  # refused at the start, saying why
                    assert run.returncode == 2 and "rlpulse alerts: --webhook http://" in run.stderr, run.stderr
    finally:
        receiver.close()
    for password, text, url in outputs:
        assert leaks(password, text, neutral) == [], (url, text)
        assert "alice" not in text and "T0KEN" not in text and "S1G" not in text, (url, text)
