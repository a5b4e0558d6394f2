"""``rlpulse alerts`` against the real broker, posting to a real local HTTP receiver: each alert is
posted at least once with an id (body ``alert_id`` = ``Idempotency-Key`` header), alerts fired while
the feed was down are posted when it is back, a dead webhook neither loses alerts nor holds up a
SIGTERM, and the webhook URL's secrets never reach the output."""

from __future__ import annotations

import asyncio
import http.server
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
from aiokafka import AIOKafkaProducer

from rlpulse.pipeline import settings_env
from rlpulse.base.settings import Settings
from rlpulse.schemas.codec import Codec
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.alerts.webhook import alert_id

pytestmark = pytest.mark.integration
TOKEN = "T0AAA/B0BBB/xoxb-s3cr3t-t0ken"  # a Slack-style token in the URL path


def alert(state: str, run: str = "r1", first_seen_ns: int = 1) -> dict:
    return dict(rule="stalled_run", state=state, key=f"{run}/1", severity="critical", summary=f"run {run} {state.lower()}",
                value=900.0, threshold=900.0, project="p", run_id=run, attempt=1, time_ns=1_800_000_000_000_000_000,
                first_seen_ns=first_seen_ns, last_seen_ns=2)


def episodes(runs: list[str]) -> list[dict]:
    return [alert(state, run, first_seen_ns=1000 + i) for i, run in enumerate(runs) for state in ("FIRING", "RESOLVED")]


async def _publish(settings: Settings, records: list[dict]) -> None:
    codec = Codec()
    producer = AIOKafkaProducer(**settings.kafka_client_kwargs())
    await producer.start()
    try:
        for record in records:
            key = f"{record['project']}/{record['run_id']}".encode()
            await producer.send_and_wait(settings.topic("alerts"), key=key, value=codec.encode("Alert", [record]))
    finally:
        await producer.stop()


def publish(settings: Settings, records: list[dict]) -> None:
    asyncio.run(_publish(settings, records))


class Receiver:
    """A local webhook: records (Idempotency-Key, body) of each accepted POST; can fail or hang."""

    def __init__(self, fail_first: int = 0, hang: bool = False, status: int = 200):
        self.received: list[tuple[str, dict]] = []
        self.requests = 0
        self.fail_first, self.hang, self.status = fail_first, hang, status
        self.release = threading.Event()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.requests += 1
                if receiver.hang:  # a webhook that never answers (until the test ends)
                    receiver.release.wait(60)
                    return
                if receiver.fail_first > 0:  # flaky: the first calls fail
                    receiver.fail_first -= 1
                    self.send_response(503)
                elif receiver.status != 200:  # refuses every call with this status
                    self.send_response(receiver.status)
                else:
                    receiver.received.append((self.headers["Idempotency-Key"], body))
                    self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://hookuser:hookpass@127.0.0.1:{self.server.server_port}/services/{TOKEN}?token=q-s3cr3t"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class Feed:
    """``rlpulse alerts`` as a child process, its stdout and stderr collected line by line."""

    def __init__(self, settings: Settings, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "rlpulse.cli", "alerts", *args], env=settings_env(settings),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._readers = [threading.Thread(target=self._collect, args=(stream, lines), daemon=True)
                         for stream, lines in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _collect(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def wait_for(self, what: str, condition: Callable[[], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(f"feed exited ({self.proc.returncode}) before {what}: {self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {self.output()}")
            time.sleep(0.05)

    def wait_following(self) -> None:
        self.wait_for("the feed to follow its partitions", lambda: any("alerts: following" in line for line in self.stderr))

    def terminate(self, timeout: float = 30.0) -> float:
        """SIGTERM; returns the seconds until the process exited."""
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout)
        took = time.monotonic() - start
        for reader in self._readers:
            reader.join(5)
        return took

    def output(self) -> str:
        return "\n".join(self.stdout + self.stderr)


def assert_no_secret(text: str) -> None:
    for secret in ("s3cr3t", "hookpass", "hookuser", "/services/", "T0AAA"):
        assert secret not in text


def test_running_feed_posts_each_alert_once_with_its_id_after_retries(settings: Settings) -> None:
    ensure_topics(settings)
    receiver = Receiver(fail_first=2)  # the first two POSTs get 503 and are retried
    feed = Feed(settings, "--webhook", receiver.url)
    try:
        feed.wait_following()
        sent = episodes(["r1", "r2", "r3"])
        publish(settings, sent)
        feed.wait_for("6 alerts posted", lambda: len(receiver.received) >= 6)
        time.sleep(1.0)  # nothing more comes
        took = feed.terminate()
    finally:
        receiver.close()
    assert feed.proc.returncode == 0, feed.output()
    expected = {alert_id(a): a for a in sent}
    assert len(expected) == 6  # one id per transition: FIRING and RESOLVED differ
    assert sorted(key for key, _ in receiver.received) == sorted(expected)
    for key, body in receiver.received:
        assert body == {"alert_id": key, **expected[key]}
    # one run's alerts share a partition and arrive in order: FIRING before RESOLVED
    for run in ("r1", "r2", "r3"):
        assert [b["state"] for _, b in receiver.received if b["run_id"] == run] == ["FIRING", "RESOLVED"]
    printed = [line for line in feed.stdout if "stalled_run" in line]
    assert len(printed) == 6 and "[critical]" in printed[0]
    assert f"webhook http://127.0.0.1:{receiver.server.server_port}: 6 delivered, 0 failed, 0 not delivered" in feed.stdout[-1]
    assert took < 5.0
    assert_no_secret(feed.output())


def test_alerts_fired_while_the_feed_was_down_are_posted_when_it_is_back(settings: Settings) -> None:
    ensure_topics(settings)
    receiver = Receiver()
    try:
        first = Feed(settings, "--webhook", receiver.url)
        first.wait_following()
        before = episodes(["a1"])
        publish(settings, before)
        first.wait_for("2 alerts posted", lambda: len(receiver.received) >= 2)
        assert first.terminate() < 5.0 and first.proc.returncode == 0, first.output()

        down = episodes([f"d{i}" for i in range(5)])  # N = 10 alerts while the feed is down
        publish(settings, down)

        second = Feed(settings, "--webhook", receiver.url)
        second.wait_for("10 more alerts posted", lambda: len({k for k, _ in receiver.received}) >= 12)
        time.sleep(1.0)
        assert second.terminate() < 5.0 and second.proc.returncode == 0, second.output()
    finally:
        receiver.close()
    expected = {alert_id(a): a for a in before + down}
    ids = [key for key, _ in receiver.received]
    assert set(ids) == set(expected)  # no loss
    for key, body in receiver.received:  # a duplicate, if any, is the same body under the same id
        assert body == {"alert_id": key, **expected[key]}
    print(f"down/up: {len(expected)} sent, {len(ids)} posts, {len(ids) - len(set(ids))} duplicates")
    assert len(ids) == 12  # and here, a clean stop after each delivery committed: no duplicate either
    assert sum("stalled_run" in line for line in second.stdout) == 10  # resumed after the committed a1 alerts
    assert "10 delivered, 0 failed, 0 not delivered" in second.stdout[-1]


def test_a_dead_webhook_does_not_hold_up_sigterm_and_its_alerts_are_posted_at_the_next_start(settings: Settings) -> None:
    ensure_topics(settings)
    sent = episodes(["x1", "x2"])
    publish(settings, sent)
    hanging = Receiver(hang=True)
    try:
        feed = Feed(settings, "--from-beginning", "--webhook", hanging.url)
        feed.wait_for("a POST in flight", lambda: hanging.requests >= 1)
        feed.wait_for("every alert printed", lambda: sum("stalled_run" in line for line in feed.stdout) == 4)
        took = feed.terminate()
    finally:
        hanging.close()
    assert feed.proc.returncode == 0, feed.output()
    print(f"hanging webhook: SIGTERM -> exit in {took:.2f}s")
    assert took < 5.0, f"SIGTERM took {took:.1f}s"
    assert "0 delivered, 0 failed, 4 not delivered (posted again at the next start)" in feed.stdout[-1]

    # refused connections (nothing listens): retried, then SIGTERM; still nothing committed
    refused = Receiver()
    refused.close()
    dead = Feed(settings, "--webhook", refused.url)
    dead.wait_for("a failed try logged", lambda: any("retrying" in line for line in dead.stderr))
    took = dead.terminate()
    print(f"refused webhook: SIGTERM -> exit in {took:.2f}s")
    assert took < 5.0, f"SIGTERM took {took:.1f}s"
    assert "0 delivered, 0 failed, 4 not delivered" in dead.stdout[-1]

    receiver = Receiver()
    try:
        again = Feed(settings, "--webhook", receiver.url)
        again.wait_for("4 alerts posted", lambda: len(receiver.received) >= 4)
        time.sleep(1.0)
        again.terminate()
    finally:
        receiver.close()
    expected = {alert_id(a): a for a in sent}
    assert sorted(key for key, _ in receiver.received) == sorted(expected)
    for key, body in receiver.received:
        assert body == {"alert_id": key, **expected[key]}
    assert_no_secret(feed.output() + dead.output() + again.output())


def run_once(settings: Settings, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlpulse.cli", "alerts", "--from-beginning", "--once", *args],
                          env=settings_env(settings), capture_output=True, text=True, timeout=120)


def test_once_gives_up_on_a_dead_webhook_after_the_limit_and_commits(settings: Settings) -> None:
    ensure_topics(settings)
    publish(settings, [alert("FIRING")])
    url = f"http://user:hook-secret@127.0.0.1:1/hook/{TOKEN}"  # nothing listens on port 1
    run = run_once(settings, "--webhook", url, "--give-up-after", "1s")
    assert run.returncode == 0, run.stderr
    assert "FIRING" in run.stdout
    assert "webhook http://127.0.0.1:1: 0 delivered, 1 failed, 0 not delivered" in run.stdout
    assert "webhook http://127.0.0.1:1 failed" in run.stderr and "given up" in run.stderr
    assert_no_secret(run.stdout + run.stderr)
    assert "hook-secret" not in run.stdout + run.stderr
    # given up is done: the group's offset moved past it
    again = run_once(settings, "--webhook", url, "--give-up-after", "1s")
    assert again.returncode == 0, again.stderr
    assert "stalled_run" not in again.stdout and "0 delivered, 0 failed, 0 not delivered" in again.stdout


def test_a_new_group_starts_at_the_end_unless_from_beginning(settings: Settings) -> None:
    ensure_topics(settings)
    publish(settings, [alert("FIRING")])
    env = settings_env(settings)
    cmd = [sys.executable, "-m", "rlpulse.cli", "alerts", "--once"]
    at_end = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert at_end.returncode == 0, at_end.stderr
    assert "stalled_run" not in at_end.stdout
    other = subprocess.run(cmd + ["--group", f"{settings.topic_prefix}-other", "--from-beginning"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr
    assert sum("stalled_run" in line for line in other.stdout.splitlines()) == 1


def test_a_refusal_4xx_is_given_up_at_once_and_a_429_is_retried(settings: Settings) -> None:
    ensure_topics(settings)
    publish(settings, [alert("FIRING")])
    refusing = Receiver(status=400)
    try:
        run = run_once(settings, "--webhook", refusing.url)
    finally:
        refusing.close()
    assert run.returncode == 0, run.stderr
    assert refusing.requests == 1 and "0 delivered, 1 failed, 0 not delivered" in run.stdout
    assert "refused stalled_run FIRING r1/1" in run.stderr and "HTTP 400; given up" in run.stderr
    assert_no_secret(run.stdout + run.stderr)
    publish(settings, [alert("RESOLVED")])
    busy = Receiver(status=429)
    try:
        run = run_once(settings, "--webhook", busy.url, "--give-up-after", "2s")
    finally:
        busy.close()
    assert run.returncode == 0, run.stderr
    assert busy.requests >= 2 and "0 delivered, 1 failed, 0 not delivered" in run.stdout  # only RESOLVED: FIRING was done
