"""``rlpulse otlp``, the real command on loopback and beyond, against the real broker: what it
accepts lands on the OTLP topic as sent; what it refuses is answered with the reason and written
nowhere; beyond loopback the bearer token is checked before the body is read."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from rlpulse.base import env as envvars
from rlpulse.base.settings import Settings
from rlpulse.pipeline import settings_env
from rlpulse.schemas.catalogue import OTLP_METRICS_TOPIC, OTLP_SPANS_TOPIC
from rlpulse.schemas.topics import ensure_topics, read_topic
from tests.integration.producers.otlp.test_otlp_hostile import as_json, no_run, trace_request

pytestmark = [pytest.mark.integration, pytest.mark.full]

TOKEN = "otlp-test-token-" + "x" * 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_receiver(settings: Settings, host: str, port: int, token: str | None = None) -> subprocess.Popen:
    """``rlpulse otlp`` on ``host``:``port`` (with ``token`` in its environment, or none), once it listens."""
    env = {**settings_env(settings)}
    env.pop(envvars.OTLP_TOKEN, None)
    if token:
        env[envvars.OTLP_TOKEN] = token
    proc = subprocess.Popen([sys.executable, "-m", "rlpulse.cli", "otlp", "--host", host, "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"rlpulse otlp exited {proc.returncode}: {proc.stdout.read()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("rlpulse otlp did not listen in 60 s")


def _post(port: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def loopback(module_settings: Settings) -> Iterator[tuple[Settings, int]]:
    ensure_topics(module_settings)
    port = _free_port()
    proc = start_receiver(module_settings, "127.0.0.1", port, None)
    try:
        yield module_settings, port
    finally:
        proc.terminate()
        proc.wait(30)


def test_accepted_requests_land_on_the_topic_as_sent(loopback) -> None:
    settings, port = loopback
    proto = trace_request("recv-proto").SerializeToString()
    js = as_json(trace_request("recv-json", salt=4))
    assert _post(port, "/v1/traces", proto, {"Content-Type": "application/x-protobuf"}) == (200, b"")
    assert _post(port, "/v1/traces", gzip.compress(js),
                 {"Content-Type": "application/json", "Content-Encoding": "gzip"}) == (200, b"{}")
    values = [m.value for m in asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic(OTLP_SPANS_TOPIC)))]
    assert values == [proto, js]
    keys = [m.key for m in asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic(OTLP_SPANS_TOPIC)))]
    assert keys == [bytes([1] * 16).hex().encode(), bytes([5] * 16).hex().encode()]  # the Collector's key: the trace id


def test_refusals_say_why_and_write_nothing(loopback) -> None:
    settings, port = loopback
    before = len(asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic(OTLP_METRICS_TOPIC))))
    status, body = _post(port, "/v1/metrics", no_run(), {"Content-Type": "application/x-protobuf"})
    assert status == 400 and b"no run id" in body
    status, body = _post(port, "/v1/traces", b"\x0a\xff\xff\x03abc", {"Content-Type": "application/x-protobuf"})
    assert status == 400 and b"not an OTLP traces request in protobuf" in body
    assert _post(port, "/v1/traces", b"x", {"Content-Type": "text/plain"})[0] == 415
    assert _post(port, "/v1/logs", b"x", {"Content-Type": "application/x-protobuf"})[0] == 404
    bomb = gzip.compress(b"\x0a" + b"\0" * (9 << 20))
    status, body = _post(port, "/v1/traces", bomb, {"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"})
    assert status == 413 and b"inflates past the limit" in body
    after = len(asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic(OTLP_METRICS_TOPIC))))
    assert after == before


def test_beyond_loopback_it_needs_a_token_and_checks_it_before_the_body(module_settings: Settings) -> None:
    settings = module_settings
    ensure_topics(settings)
    port = _free_port()
    refused = subprocess.run([sys.executable, "-m", "rlpulse.cli", "otlp", "--host", "0.0.0.0", "--port", str(port)],
                             env={k: v for k, v in settings_env(settings).items() if k != envvars.OTLP_TOKEN},
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and envvars.OTLP_TOKEN in refused.stderr
    proc = start_receiver(settings, "0.0.0.0", port, TOKEN)
    try:
        proto = trace_request("recv-token", salt=6).SerializeToString()
        # a body claimed far bigger than sent: a 401 at once shows the body was never waited for
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            raw.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                        b"Authorization: Bearer wrong\r\nContent-Length: 1000000\r\n\r\n")
            assert raw.recv(64).startswith(b"HTTP/1.1 401")
        assert _post(port, "/v1/traces", proto, {"Content-Type": "application/x-protobuf"})[0] == 401
        ok = _post(port, "/v1/traces", proto, {"Content-Type": "application/x-protobuf", "Authorization": f"Bearer {TOKEN}"})
        assert ok == (200, b"")
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert TOKEN not in out  # never in its output
    assert os.environ.get(envvars.OTLP_TOKEN) != TOKEN
