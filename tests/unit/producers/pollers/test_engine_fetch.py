"""The engine poller's scrape against endpoints that answer badly on purpose (raw sockets on loopback):
the whole exchange (connect, TLS, status line, headers, body) ends within the timeout, whatever is not a
whole HTTP response is a ScrapeError with its reason, and one slow endpoint does not hold the others.

The times asserted are bounds of correctness (the timeout and some slack), not speed measurements."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from rlpulse.producers.pollers.engine_poller import EnginePoller, EngineRun, ScrapeError, fetch
from rlpulse.producers.sdk.sender import Outgoing
from rlpulse.base.settings import Settings

pytestmark = pytest.mark.full

pytest.importorskip("prometheus_client")
from tests.vllm_exporter import VllmExporter  # noqa: E402

SETTINGS = Settings(topic_prefix="t")
METRICS = b'vllm:num_requests_running{engine="0",model_name="m"} 7\n'
OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"


class Raw:
    """A TCP server on loopback; each connection runs ``answer(conn, stop)`` on its own thread."""

    def __init__(self, answer: Callable[[socket.socket, threading.Event], None]):
        self.answer, self.stop = answer, threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}/metrics"

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(5)
            self.answer(conn, self.stop)
        except OSError:  # the client gave up: what these tests want
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.listener.close()
        self.thread.join(2)


def read_request(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            return
        data += chunk


def drip(data: bytes, every_s: float) -> Callable[[socket.socket, threading.Event], None]:
    """``data`` one byte at a time, every ``every_s`` seconds: each read comes well within a socket timeout."""
    def answer(conn: socket.socket, stop: threading.Event) -> None:
        read_request(conn)
        for i in range(len(data)):
            if stop.wait(every_s):
                return
            conn.sendall(data[i:i + 1])
    return answer


def send(data: bytes, then_wait_s: float = 0.0) -> Callable[[socket.socket, threading.Event], None]:
    def answer(conn: socket.socket, stop: threading.Event) -> None:
        read_request(conn)
        conn.sendall(data)
        stop.wait(then_wait_s)
    return answer


@pytest.fixture
def raw() -> Iterator[Callable[[Callable[[socket.socket, threading.Event], None]], Raw]]:
    servers: list[Raw] = []

    def start(answer: Callable[[socket.socket, threading.Event], None]) -> Raw:
        servers.append(Raw(answer))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def within(limit_s: float, call: Callable[[], object]) -> tuple[object, float]:
    """``call()``'s result (or the exception it raised) and how long it took; fails if it runs past ``limit_s``
    (checked from another thread, so a fetch that never ends fails the test at once rather than hanging it)."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    elapsed = time.monotonic() - started
    assert not thread.is_alive(), f"still running after {limit_s}s"
    return out[0], elapsed


def test_a_body_dripped_a_byte_every_half_second_is_cut_at_the_timeout(raw) -> None:
    server = raw(drip(OK_HEAD + b"\r\n" + METRICS * 100, 0.5))
    got, elapsed = within(3.5, lambda: fetch(server.url(), timeout_s=2))
    assert isinstance(got, ScrapeError) and "no complete response within 2s" in str(got)
    assert elapsed >= 1.9


def test_headers_dripped_at_20_bytes_a_second_are_cut_at_the_timeout(raw) -> None:
    server = raw(drip(OK_HEAD + b"X-Pad: " + b"a" * 2000 + b"\r\n\r\n" + METRICS, 0.05))
    got, elapsed = within(4.5, lambda: fetch(server.url(), timeout_s=3))
    assert isinstance(got, ScrapeError) and "no complete response within 3s" in str(got)
    assert elapsed >= 2.9


def test_a_status_line_dripped_is_cut_at_the_timeout(raw) -> None:
    server = raw(drip(b"HTTP/1.1 200 " + b"O" * 500 + b"\r\n\r\n", 0.1))
    got, _ = within(3.0, lambda: fetch(server.url(), timeout_s=1.5))
    assert isinstance(got, ScrapeError) and "within 1.5s" in str(got)


def test_a_tls_handshake_dripped_is_cut_at_the_timeout(raw) -> None:
    # a TLS record header announcing 16 KiB, then its bytes one at a time: the handshake waits for all of them
    record = b"\x16\x03\x03\x40\x00" + b"\x00" * 16384

    def answer(conn: socket.socket, stop: threading.Event) -> None:
        conn.recv(4096)  # the ClientHello
        for i in range(len(record)):
            if stop.wait(0.2):
                return
            conn.sendall(record[i:i + 1])

    server = raw(answer)
    got, _ = within(3.5, lambda: fetch(server.url("https"), timeout_s=2))
    assert isinstance(got, ScrapeError) and "within 2s" in str(got)


def test_an_ssh_banner_is_not_an_http_response(raw) -> None:
    server = raw(send(b"SSH-2.0-OpenSSH_9.6p1 Ubuntu-3ubuntu13\r\n", then_wait_s=5))
    got, elapsed = within(3.0, lambda: fetch(server.url(), timeout_s=2))
    assert isinstance(got, ScrapeError), got
    assert "not an HTTP response" in str(got) and "OpenSSH" not in str(got)  # the reason, not the peer's bytes
    assert elapsed < 1.5  # refused when the line arrives, not at the timeout


def test_a_70_kb_header_line_is_refused(raw) -> None:
    server = raw(send(OK_HEAD + b"X-Long: " + b"a" * 70_000 + b"\r\n\r\n" + METRICS))
    got, _ = within(3.0, lambda: fetch(server.url(), timeout_s=2))
    assert isinstance(got, ScrapeError) and "line over" in str(got) and "LineTooLong" in str(got), got


def test_headers_past_the_cap_in_all_are_refused(raw) -> None:
    # a hundred lines each under http.client's 64 KiB line limit: 6 MB of headers, never a body
    server = raw(send(OK_HEAD + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 60_000) for i in range(90)) + b"\r\n" + METRICS))
    got, _ = within(3.0, lambda: fetch(server.url(), timeout_s=2, max_bytes=4096))
    assert isinstance(got, ScrapeError) and "cap" in str(got), got


def test_a_body_cut_short_of_its_content_length_is_an_error_and_nothing_is_read(raw) -> None:
    server = raw(send(OK_HEAD + b"Content-Length: 1000\r\n\r\n" + METRICS))
    got, _ = within(3.0, lambda: fetch(server.url(), timeout_s=2))
    assert isinstance(got, ScrapeError), got
    assert "cut short" in str(got) and f"{len(METRICS)} of 1000 bytes" in str(got) and "IncompleteRead" in str(got)


def test_a_chunked_body_cut_short_is_an_error(raw) -> None:
    server = raw(send(OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % 500 + METRICS))
    got, _ = within(3.0, lambda: fetch(server.url(), timeout_s=2))
    assert isinstance(got, ScrapeError) and "cut short" in str(got), got


def test_a_whole_response_still_reads(raw) -> None:
    length = b"Content-Length: %d\r\n\r\n" % len(METRICS)
    assert fetch(raw(send(OK_HEAD + length + METRICS)).url(), timeout_s=2) == METRICS
    chunked = OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(METRICS) + METRICS + b"\r\n0\r\n\r\n"
    assert fetch(raw(send(chunked)).url(), timeout_s=2) == METRICS
    assert fetch(raw(send(OK_HEAD + b"Connection: close\r\n\r\n" + METRICS)).url(), timeout_s=2) == METRICS  # to EOF
    closed = raw(send(b""))  # accepted, then closed without a byte
    with pytest.raises(ScrapeError, match="closed without answering"):
        fetch(closed.url(), timeout_s=2)


def test_one_slow_or_hostile_endpoint_holds_neither_the_others_nor_the_poller(raw) -> None:
    hostile = [raw(drip(OK_HEAD + b"\r\n" + METRICS * 100, 0.5)),  # the body dripped
               raw(drip(OK_HEAD + b"X-Pad: " + b"a" * 2000 + b"\r\n\r\n", 0.05)),  # the headers dripped
               raw(send(b"SSH-2.0-OpenSSH_9.6\r\n", then_wait_s=5)),  # not HTTP
               raw(send(OK_HEAD + b"X-Long: " + b"a" * 70_000 + b"\r\n\r\n")),  # a header line of 70 KB
               raw(send(OK_HEAD + b"Content-Length: 1000\r\n\r\n" + METRICS))]  # cut short
    with VllmExporter() as vllm:
        out: list[Outgoing] = []
        urls = [s.url() for s in hostile] + [vllm.url]
        poller = EnginePoller(urls, out.append, SETTINGS, run=EngineRun(run_id="r"), timeout_s=2)
        for _ in range(2):  # the poller goes on
            records, elapsed = within(3.5, poller.scrape)
            assert isinstance(records, list), records
            assert [r["url"] for r in records] == [vllm.url] and records[0]["requests_running"] == 0.0
    assert poller.failures == {s.url(): 2 for s in hostile} and len(out) == 2


def test_a_fetch_that_never_returns_costs_its_url_the_scrape_not_the_poller() -> None:
    """What no socket timeout bounds (a name lookup that hangs): the scrape still ends at the timeout and
    the next one does not start a second request to that URL while the first is still out."""
    release = threading.Event()
    started: list[str] = []

    def fetcher(url: str, timeout_s: float, max_bytes: int) -> bytes:
        started.append(url)
        if "hangs" in url:
            release.wait(30)
            raise ScrapeError("released")
        return METRICS

    out: list[Outgoing] = []
    poller = EnginePoller(["http://hangs:8000/metrics", "http://fine:8000/metrics"], out.append, SETTINGS,
                          timeout_s=1, fetcher=fetcher)
    try:
        for _ in range(2):
            records, _ = within(2.8, poller.scrape)
            assert isinstance(records, list) and [r["url"] for r in records] == ["http://fine:8000/metrics"], records
        assert started.count("http://hangs:8000/metrics") == 1  # not asked again while the first is out
        assert poller.failures == {"http://hangs:8000/metrics": 2}
    finally:
        release.set()
