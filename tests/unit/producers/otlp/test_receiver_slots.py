"""``rlpulse otlp``'s receiver against issue 33's slot shape: slow clients on every slot leave an exporter's
request with the token served at once; without it, a request over the cap is answered 503."""

from __future__ import annotations

import http.client
import threading
import time

import pytest

from rlpulse.base.settings import Settings
from rlpulse.producers.otlp.receiver import MAX_CONNECTIONS, OtlpReceiver
from tests.slowloris import Drip

pytestmark = pytest.mark.full

TOKEN = "otlp-test-token-0123456789"


def get(address: tuple[str, int], headers: dict[str, str]) -> tuple[int, float]:
    started = time.monotonic()
    conn = http.client.HTTPConnection(*address, timeout=10)
    try:
        conn.request("GET", "/v1/traces", headers=headers)
        answer = conn.getresponse()
        answer.read()
        return answer.status, time.monotonic() - started
    finally:
        conn.close()


def test_slow_clients_leave_the_exporter_served() -> None:
    receiver = OtlpReceiver(Settings(), port=0, token=TOKEN)  # the HTTP side only: GET is answered 405, no broker
    thread = threading.Thread(target=receiver._server.serve_forever, daemon=True)
    thread.start()
    try:
        with Drip(receiver.address, MAX_CONNECTIONS + 8, every=2.0):
            time.sleep(3)
            status, took = get(receiver.address, {"Authorization": f"Bearer {TOKEN}"})
            assert status == 405 and took < 2, (status, took)  # served: the method is refused, not the connection
            assert get(receiver.address, {})[0] == 503
    finally:
        receiver._server.shutdown()
        receiver._server.server_close()
        thread.join(timeout=5)


def test_without_a_token_a_foreign_host_is_refused_before_anything_else() -> None:
    # On loopback without a token anyone here may post, but not a web page DNS-rebound to 127.0.0.1.
    for token, foreign in [(None, 403), (TOKEN, 405)]:
        receiver = OtlpReceiver(Settings(), port=0, token=token)
        thread = threading.Thread(target=receiver._server.serve_forever, daemon=True)
        thread.start()
        try:
            auth = {"Authorization": f"Bearer {TOKEN}"} if token else {}
            assert get(receiver.address, {"Host": "rebound.example:4318", **auth})[0] == foreign
            assert get(receiver.address, {"Host": f"127.0.0.1:{receiver.address[1]}", **auth})[0] == 405
            assert get(receiver.address, {"Host": "localhost", **auth})[0] == 405
        finally:
            receiver._server.shutdown()
            receiver._server.server_close()
            thread.join(timeout=5)
