"""``rlpulse prometheus``'s scrape endpoint against issue 33's shapes: slow clients on every slot leave
Prometheus's scrape (with its token) served at once, and without a token (loopback) a request whose Host
names another site (DNS rebinding) is refused before the figures are read (rlpulse.sinks.prometheus.server)."""

from __future__ import annotations

import http.client
import time

import pytest

from rlpulse.sinks.prometheus.server import MAX_CONNECTIONS, PrometheusServer
from tests.slowloris import Drip

pytestmark = pytest.mark.full

TOKEN = "prometheus-test-token-0123456789"


class _Scraper:
    def __init__(self) -> None:
        self.scrapes = 0

    def scrape(self) -> bytes:
        self.scrapes += 1
        return b"# figures\nup 1\n"


def get(server: PrometheusServer, headers: dict[str, str]) -> tuple[int, float]:
    started = time.monotonic()
    conn = http.client.HTTPConnection(*server.address, timeout=10)
    try:
        conn.request("GET", "/metrics", headers=headers)
        answer = conn.getresponse()
        answer.read()
        return answer.status, time.monotonic() - started
    finally:
        conn.close()


def test_slow_clients_leave_the_scrape_served() -> None:
    with PrometheusServer(_Scraper(), port=0, token=TOKEN) as server:  # type: ignore[arg-type]
        with Drip(server.address, MAX_CONNECTIONS + 8, every=2.0):
            time.sleep(3)
            status, took = get(server, {"Authorization": f"Bearer {TOKEN}"})
            assert status == 200 and took < 2, (status, took)
            assert get(server, {})[0] == 503  # no token, over the cap
        # with a token, any Host passes: Prometheus names the target as it was configured
        assert get(server, {"Authorization": f"Bearer {TOKEN}", "Host": "metrics.lab.example:9464"})[0] == 200


def test_without_a_token_a_foreign_host_is_refused_before_the_store() -> None:
    scraper = _Scraper()
    with PrometheusServer(scraper, port=0) as server:  # type: ignore[arg-type]
        assert get(server, {"Host": "evil.example"})[0] == 403
        assert scraper.scrapes == 0
        assert get(server, {"Host": f"localhost:{server.address[1]}"})[0] == 200
        assert get(server, {})[0] == 200  # http.client's own Host: 127.0.0.1:PORT
