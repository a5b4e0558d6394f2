"""``rlpulse otlp``: OTLP/HTTP in (``POST /v1/traces``, ``/v1/metrics``; protobuf or JSON, gzip
or not), written to the OTLP topics as the Collector's kafka exporter writes them. For a laptop
or one box; where the Collector runs, use it (deploy/otelcol/).

Bounded like the read endpoint (``rlpulse.base.bounded_http``): loopback unless told otherwise, and
then a bearer token (``RLPULSE_OTLP_TOKEN``) checked in constant time before a byte of the body is
read; a thread per connection up to a cap, and a few more for requests with the token (anything else
over the cap is answered 503); a request's line, headers and body must arrive within 10 s of its first
byte, across reads (an exporter's own default timeout); an idle timeout between requests; a
Content-Length required and at most the request limit, and a gzip body inflated no further than it.
A request is decoded and translated (to check it, nothing kept) before it is written: a bad one is
answered 400 with the reason, as the ingest would dead-letter it. 200 means the broker has the request.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import threading
import time
import zlib
from typing import Any

from aiokafka import AIOKafkaProducer

from rlpulse.base import env as envvars
from rlpulse.base.bounded_http import BoundedHandler, BoundedHTTPServer
from rlpulse.base.settings import Settings
from rlpulse.producers.otlp.decode import METRICS, TRACES, OtlpLimits, decode, trace_key
from rlpulse.producers.otlp.identity import OtlpRejected
from rlpulse.producers.otlp.metrics import MetricTranslator
from rlpulse.producers.otlp.spans import translate_spans
from rlpulse.schemas import lz4_level
from rlpulse.schemas.catalogue import OTLP_METRICS_TOPIC, OTLP_SPANS_TOPIC

log = logging.getLogger(__name__)

PATHS = {"/v1/traces": (TRACES, OTLP_SPANS_TOPIC), "/v1/metrics": (METRICS, OTLP_METRICS_TOPIC)}
CONTENT_TYPES = {"application/x-protobuf", "application/json"}
IDLE_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 15.0
MAX_CONNECTIONS = 64
LOOPBACK = ("127.0.0.1", "::1", "localhost")
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5\r\nConnection: close\r\nRetry-After: 1\r\n\r\nbusy\n"


class _Handler(BoundedHandler):
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S
    receiver: OtlpReceiver  # set on the subclass made per server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:  # noqa: N802
        self.close_connection = True
        self._reply(405, b"OTLP/HTTP takes POST on /v1/traces and /v1/metrics\n", allow="POST")

    def do_POST(self) -> None:  # noqa: N802
        route = PATHS.get(self.path.split("?", 1)[0])
        # Until the body is read, the connection cannot carry another request: a refusal closes it.
        client_closes, self.close_connection = self.close_connection, True
        if route is None:
            self._reply(404, b"not found: POST /v1/traces or /v1/metrics\n")
            return
        if not self._authenticated():
            self._reply(401, b"unauthorized: send Authorization: Bearer <RLPULSE_OTLP_TOKEN>\n",
                        **{"WWW-Authenticate": "Bearer"})
            return
        ctype = self.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if ctype not in CONTENT_TYPES:
            self._reply(415, b"unsupported media type: application/x-protobuf or application/json\n")
            return
        try:
            body = self._body()
            self.close_connection = client_closes  # read whole: keep-alive as the client asked
            signal, topic = route
            status, text = self.receiver.accept(signal, topic, body)
        except OtlpRejected as exc:
            status, text = exc.status if isinstance(exc, _HttpRefusal) else 400, str(exc)
        if status == 200:
            self._reply(200, b"{}" if ctype == "application/json" else b"", content_type=ctype)
        else:
            self._reply(status, (text[:2000] + "\n").encode(errors="replace"))

    def vouched(self) -> bool:  # a reserved slot: the token, or anyone where none is asked (loopback)
        return self._authenticated()

    def _authenticated(self) -> bool:
        token = self.receiver.token
        if token is None:
            return True
        scheme, _, given = self.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(errors="replace"), token.encode())

    def _body(self) -> bytes:
        limit = self.receiver.limits.max_bytes
        if self.headers.get("Transfer-Encoding"):
            raise _HttpRefusal(411, "send a Content-Length: chunked bodies are not taken")
        length_text = self.headers.get("Content-Length", "")
        if not (length_text.isascii() and length_text.isdigit()) or len(length_text) > 12:
            raise _HttpRefusal(411, "a Content-Length is required")
        length = int(length_text)
        if length > limit:
            raise _HttpRefusal(413, f"request body of {length} bytes, over the limit of {limit}")
        data = self.rfile.read(length)
        if len(data) != length:
            raise _HttpRefusal(400, f"the body ended after {len(data)} of the {length} bytes its Content-Length said")
        encoding = self.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding in ("", "identity"):
            return data
        if encoding not in ("gzip", "deflate"):
            raise _HttpRefusal(415, f"unsupported Content-Encoding {encoding[:40]!r}: gzip, deflate or none")
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
        try:
            out = inflate.decompress(data, limit + 1)  # never more than the bound in memory
        except zlib.error as exc:
            raise _HttpRefusal(400, f"the {encoding} body does not inflate: {exc}") from None
        if len(out) > limit or inflate.unconsumed_tail:
            raise _HttpRefusal(413, f"the {encoding} body inflates past the limit of {limit} bytes")
        return out

    def _reply(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8", **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)


class _HttpRefusal(OtlpRejected):
    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


class OtlpReceiver:
    """The server, its producer on a loop of its own, and what it accepted."""

    def __init__(self, settings: Settings, host: str = "127.0.0.1", port: int = 4318, token: str | None = None,
                 limits: OtlpLimits | None = None, max_connections: int = MAX_CONNECTIONS):
        if host not in LOOPBACK and not token:
            raise ValueError(f"rlpulse otlp binds {host}, beyond loopback: set {envvars.OTLP_TOKEN} to the bearer "
                             "token clients must send")
        self.settings, self.token, self.limits = settings, token or None, limits or OtlpLimits()
        self.accepted = {TRACES: 0, METRICS: 0}
        self.refused = 0
        handler = type("Handler", (_Handler,), {"receiver": self})
        # Without a token, only this machine's names: a page re-pointed at 127.0.0.1 (DNS rebinding) cannot post spans
        self._server = BoundedHTTPServer((host, port), handler, max_connections, _BUSY, "otlp receiver",
                                         check_host=token is None)
        self._loop = asyncio.new_event_loop()
        self._producer: AIOKafkaProducer | None = None
        self._threads: list[threading.Thread] = []

    @property
    def address(self) -> tuple[str, int]:
        return self._server.server_address[:2]  # type: ignore[return-value]

    def start(self) -> OtlpReceiver:
        loop_thread = threading.Thread(target=self._loop.run_forever, name="otlp-producer", daemon=True)
        loop_thread.start()
        self._producer = self._call(self._start_producer())
        serve = threading.Thread(target=self._server.serve_forever, name="otlp-http", daemon=True)
        serve.start()
        self._threads = [loop_thread, serve]
        return self

    async def _start_producer(self) -> AIOKafkaProducer:
        lz4_level.install()
        producer = AIOKafkaProducer(acks="all", enable_idempotence=True, linger_ms=5, compression_type="lz4",
                                    max_request_size=self.limits.max_bytes + 64 * 1024,
                                    **self.settings.kafka_client_kwargs())
        await producer.start()
        return producer

    def _call(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def accept(self, signal: str, topic: str, body: bytes) -> tuple[int, str]:
        """Check one request and write it to ``topic``: (200, "") once the broker has it."""
        try:
            request = decode(signal, body, self.limits)
            now = time.time_ns()
            if signal == TRACES:
                translate_spans(request, now)
                messages = [(trace_key(request), body)]
            else:
                MetricTranslator().translate(request, now)  # a fresh one: checks, keeps nothing
                messages = split_metrics(request, body)
        except OtlpRejected as exc:
            self.refused += 1
            log.info("refused an OTLP %s request: %s", signal, exc)
            return 400, str(exc)
        except Exception as exc:  # noqa: BLE001 - as the ingest dead-letters it; else the client gets no answer
            self.refused += 1
            log.exception("the OTLP translator failed on a %s request", signal)
            return 400, f"the translator failed: {type(exc).__name__}"
        assert self._producer is not None
        try:
            for key, value in messages:
                self._call(self._producer.send_and_wait(self.settings.topic(topic), value=value, key=key), SEND_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the client retries a 503, as OTLP exporters do
            log.warning("could not write an OTLP %s request to Kafka: %s", signal, exc)
            return 503, f"the broker did not take the request: {type(exc).__name__}"
        self.accepted[signal] += 1
        return 200, ""

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._producer is not None:
            self._call(self._producer.stop(), 30.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        for thread in self._threads:
            thread.join(timeout=5)


def split_metrics(request: Any, body: bytes) -> list[tuple[bytes | None, bytes]]:
    """One message per resource, keyed by a hash of its attributes, as the Collector's
    ``partition_metrics_by_resource_attributes`` writes them (one resource's series stay on one
    partition, so one ingest differences them); a request of one resource goes as it came."""
    groups = request.resource_metrics
    if len(groups) <= 1:
        return [(_resource_key(groups[0]) if groups else None, body)]
    out: list[tuple[bytes | None, bytes]] = []
    for group in groups:
        one = type(request)()
        one.resource_metrics.append(group)
        out.append((_resource_key(group), one.SerializeToString()))
    return out


def _resource_key(group: Any) -> bytes:
    attrs = sorted((kv.key, kv.value.SerializeToString()) for kv in group.resource.attributes)
    digest = hashlib.sha256()
    for key, value in attrs:
        digest.update(key.encode() + b"\0" + value + b"\0")
    return digest.digest()[:16]


def run_receiver(settings: Settings, host: str, port: int, token: str | None) -> int:
    """``rlpulse otlp``: serve until SIGINT/SIGTERM."""
    import signal

    from rlpulse.schemas.topics import ensure_topics

    ensure_topics(settings)
    receiver = OtlpReceiver(settings, host=host, port=port, token=token).start()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    bound = receiver.address
    print(f"OTLP/HTTP on http://{bound[0]}:{bound[1]}/v1/traces and /v1/metrics -> "
          f"{settings.topic(OTLP_SPANS_TOPIC)}, {settings.topic(OTLP_METRICS_TOPIC)}", flush=True)
    try:
        while not stop.wait(0.5):  # a timed wait: the signal handler runs between the waits
            pass
    finally:
        receiver.close()
    log.info("stopped: %d trace and %d metric requests accepted, %d refused",
             receiver.accepted[TRACES], receiver.accepted[METRICS], receiver.refused)
    return 0
