"""``rlpulse alerts``: prints alerts and POSTs each to a webhook, retrying; a dead webhook is not fatal."""

from __future__ import annotations

import asyncio
import http.server
import json
import subprocess
import sys
import threading

import pytest
from aiokafka import AIOKafkaProducer

from rlpulse.pipeline import settings_env
from rlpulse.settings import Settings
from schemas.topics import ensure_topics
from schemas.codec import Codec

pytestmark = pytest.mark.integration


def alert(state: str) -> dict:
    return dict(rule="stalled_run", state=state, key="r1/1", severity="critical", summary=f"run r1 {state.lower()}",
                value=900.0, threshold=900.0, project="p", run_id="r1", attempt=1, time_ns=1_800_000_000_000_000_000,
                first_seen_ns=1, last_seen_ns=2)


async def publish(settings: Settings, records: list[dict]) -> None:
    codec = Codec()
    producer = AIOKafkaProducer(**settings.kafka_client_kwargs())
    await producer.start()
    try:
        for record in records:
            await producer.send_and_wait(settings.topic("alerts"), key=b"p/r1", value=codec.encode("Alert", [record]))
    finally:
        await producer.stop()


class Receiver(http.server.BaseHTTPRequestHandler):
    received: list = []
    fail_first = 0

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if Receiver.fail_first > 0:  # the webhook is flaky: the first calls fail
            Receiver.fail_first -= 1
            self.send_response(503)
        else:
            Receiver.received.append(body)
            self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def run_cli(settings: Settings, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlpulse.cli", "alerts", "--from-beginning", "--once", *args],
                          env=settings_env(settings), capture_output=True, text=True, timeout=120)


def test_alerts_are_printed_and_posted_once_each_with_retries(settings: Settings) -> None:
    ensure_topics(settings)
    asyncio.run(publish(settings, [alert("FIRING"), alert("RESOLVED")]))
    server = http.server.HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Receiver.received, Receiver.fail_first = [], 2
    try:
        run = run_cli(settings, "--webhook", f"http://127.0.0.1:{server.server_port}/hook")
    finally:
        server.shutdown()
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stdout.splitlines() if "stalled_run" in line]
    assert len(lines) == 2 and "FIRING" in lines[0] and "RESOLVED" in lines[1] and "[critical]" in lines[0]
    assert [(a["rule"], a["state"], a["key"]) for a in Receiver.received] == [
        ("stalled_run", "FIRING", "r1/1"), ("stalled_run", "RESOLVED", "r1/1")]
    assert "webhook: 2 delivered, 0 failed, 0 dropped" in run.stdout


def test_a_dead_webhook_is_logged_not_fatal(settings: Settings) -> None:
    ensure_topics(settings)
    asyncio.run(publish(settings, [alert("FIRING")]))
    run = run_cli(settings, "--webhook", "http://user:hook-secret@127.0.0.1:1/hook")  # nothing listens on port 1
    assert run.returncode == 0, run.stderr
    assert "FIRING" in run.stdout and "webhook: 0 delivered, 1 failed, 0 dropped" in run.stdout
    assert "webhook http://user:***@127.0.0.1:1/hook failed 4 times" in run.stderr
    assert "hook-secret" not in run.stdout + run.stderr
