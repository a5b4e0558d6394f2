"""Every client against a broker that demands TLS and SASL.

One broker of this module's own (never the shared one on 9092), from the same jars, with three
listeners: PLAINTEXT (the controller's and the admin tools'), SASL_SSL with SCRAM-SHA-512, and
SSL that demands a client certificate (mTLS). The certificates are made here with openssl and
the SCRAM user with Kafka's own ConfigCommand (``rlpulse.secure_broker``).

* Right credentials over SASL_SSL: topic creation, the SDK, ``rlpulse streams`` and ``rlpulse
  sink`` (exact rows in ClickHouse, derived figures), ``rlpulse alerts --once``, ``rlpulse status``.
* Wrong password: the SDK, ``rlpulse sink``, ``streams``, ``status`` and ``alerts`` each fail
  within 30 s with one clear line about the credentials; the SDK keeps its events and says so once.
* mTLS: the SDK and the sink work with the client certificate (its key encrypted), and fail
  clearly without it.
* ``rlpulse bench --smoke`` over SASL_SSL: the SDK, Kafka's Java ceilings (their credentials in a
  0600 properties file), a drain through streams and sink, the latency phase; and the Java tools
  over mTLS with the client certificate.
* No captured output or log holds a password.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Iterator

import pytest

from bench import kafka_perf
from rlpulse.producers import TrainingTelemetry
from rlpulse import secure_broker, services
from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.base.settings import AlertThresholds, Settings
from rlpulse.schemas.topics import ensure_topics
from tests.kafka_tls import Certificates, make_certificates
from tests.integration.rlpulse.test_pipeline import expected_failures, publish_workload, snapshot, workload_in

pytestmark = [pytest.mark.integration, pytest.mark.full]  # a SASL_SSL/mTLS broker of its own: make test-all

USER = "alice"
REFUSED = "refused the credentials: SASL authentication of user 'alice' with SCRAM-SHA-512 failed"


@dataclasses.dataclass
class SecureBroker:
    plaintext: int
    sasl_ssl: int
    ssl: int
    home: Path
    certs: Certificates
    password: str  # alice's SCRAM password
    wrong: str  # a password the broker refuses

    @property
    def secrets(self) -> tuple[str, ...]:
        return (self.password, self.wrong, self.certs.keystore_password, self.certs.client_key_password)

    def settings(self, tmp: Path, *, password: str | None = None, mtls: bool | None = None) -> Settings:
        """A client's settings: SASL_SSL as alice (``password``, default the right one), or with
        ``mtls`` the SSL listener, with (True) or without (False) the client certificate."""
        if mtls is None:
            security: dict[str, object] = dict(
                kafka_bootstrap=f"127.0.0.1:{self.sasl_ssl}", kafka_security_protocol="SASL_SSL",
                kafka_sasl_mechanism="SCRAM-SHA-512", kafka_sasl_username=USER,
                kafka_sasl_password=self.password if password is None else password)
        else:
            security = dict(kafka_bootstrap=f"127.0.0.1:{self.ssl}", kafka_security_protocol="SSL")
            if mtls:
                security.update(kafka_ssl_certfile=str(self.certs.client_cert), kafka_ssl_keyfile=str(self.certs.client_key),
                                kafka_ssl_key_password=self.certs.client_key_password)
        return dataclasses.replace(  # one replace: the settings are validated as a whole
            Settings.load({}), topic_prefix=f"s{secrets.token_hex(5)}", home=self.home,  # home: `status` finds the broker
            clickhouse_url=f"chdb://{tmp / 'clickhouse'}", partitions=2, window=2.0, allowed_lateness=5.0,
            heartbeat_interval=3600.0, alerts=AlertThresholds(grader_min_graded=2), kafka_ssl_cafile=str(self.certs.ca),
            **security)  # type: ignore[arg-type]

    def assert_no_secret(self, text: str) -> None:
        for secret in self.secrets:
            assert secret not in text


def _free_ports(count: int = 4) -> int:
    """A port p with p .. p+count-1 free on 127.0.0.1, in 30000-40000 (the own_broker fixture uses 20000-30000)."""
    for _ in range(200):
        first = secrets.randbelow(10000 - count) + 30000
        sockets = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} free neighbouring ports in 30000-40000 for the secure test broker")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBroker]:
    for tool in ("java", "mvn", "openssl"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} not found on PATH: the SASL_SSL broker of this test needs java, mvn and openssl")
    root = tmp_path_factory.mktemp("secure-broker")
    certs = make_certificates(root / "certs", secrets.token_urlsafe(12), secrets.token_urlsafe(12))
    port = _free_ports()
    b = SecureBroker(plaintext=port, sasl_ssl=port + 2, ssl=port + 3, home=root / "home", certs=certs,
                     password="pw-" + secrets.token_hex(8), wrong="pw-" + secrets.token_hex(8))
    admin = dataclasses.replace(Settings.load({}), kafka_bootstrap=f"127.0.0.1:{port}", home=b.home)
    services.up(admin, secure_broker.TlsListeners(keystore=certs.keystore, keystore_password=certs.keystore_password,
                                                  truststore=certs.ca, sasl_ssl_port=b.sasl_ssl, ssl_port=b.ssl))
    try:
        secure_broker.add_scram_user(admin, USER, b.password)
        yield b
    finally:
        services.down(admin)


def rlpulse(settings: Settings, *args: str, timeout: float = 60.0) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``rlpulse ARGS`` with ``settings`` in its environment; (the run, its seconds)."""
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "rlpulse.cli", *args], env=settings_env(settings),
                         capture_output=True, text=True, timeout=timeout)
    return run, time.monotonic() - started


def test_every_client_works_over_sasl_ssl_with_the_right_credentials(broker: SecureBroker, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    settings = broker.settings(tmp_path)
    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        publish_workload(settings)  # the SDK over SASL_SSL: each run's flush(30) == 0
        pipeline.wait_caught_up(until=workload_in(settings))
        pipeline.stop()
    rows = snapshot(settings)
    assert rows["spans_by_kind"] == {"ROLLOUT": 6, "GRADER": 11}
    assert rows["sequence"] == [("runA", 1, 15, 15, 1, 15), ("runB", 2, 2, 2, 1, 2)]
    assert rows["failures"] == expected_failures()  # derived by the streams, written by the sink

    alerts, seconds = rlpulse(settings, "alerts", "--once", "--from-beginning")
    assert alerts.returncode == 0, alerts.stderr
    assert "FIRING" in alerts.stdout and "grader_failure_rate" in alerts.stdout  # runA step 0: 3 of 4 judge calls failed

    status, _ = rlpulse(settings, "status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"127.0.0.1:{broker.sasl_ssl}: a Kafka broker answers" in status.stdout
    # one line per group (its partitions with --detail), each caught up (its members: those still leaving, if any)
    assert re.search(rf"^consumer group {settings.app_id}: lag 0, \d+ partitions \(3 topics\), \d+ members?",
                     status.stdout, re.MULTILINE), status.stdout
    assert re.search(rf"^consumer group {settings.sink_group}: lag 0, \d+ partitions \(10 topics\), \d+ members?",
                     status.stdout, re.MULTILINE), status.stdout

    logs = "".join(p.read_text() for p in (settings.home / "logs").glob("*.log"))
    broker.assert_no_secret(logs + alerts.stdout + alerts.stderr + status.stdout + status.stderr + caplog.text)


def test_a_wrong_password_fails_each_client_fast_in_one_line(broker: SecureBroker, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    settings = broker.settings(tmp_path, password=broker.wrong)
    refused = f"Kafka at 127.0.0.1:{broker.sasl_ssl} {REFUSED}"
    outputs = []
    for args in (("sink",), ("streams",), ("status",), ("alerts", "--once"), ("simulate", "--runs", "1")):
        run, seconds = rlpulse(settings, *args, timeout=60)
        out = run.stdout + run.stderr
        outputs.append(out)
        assert run.returncode == 1 and seconds < 30, (args, run.returncode, seconds, out)
        [line] = [line for line in run.stderr.splitlines() if line]  # one line, no traceback, no retry noise
        assert refused in line and "RLPULSE_KAFKA_SASL_PASSWORD" in line, (args, line)

    # The SDK: never raises into the training job; says why once, keeps the events, flush says how many wait.
    caplog.set_level(logging.INFO)
    started = time.monotonic()
    tel = TrainingTelemetry(project="itest", run_id="denied", settings=settings)
    tel.start()
    tel.step_completed(step=0, tokens=10, duration_s=1.0)
    assert tel.flush(10) == 2  # RUN_START and the step
    assert time.monotonic() - started < 30
    assert tel.kafka_refused is not None and refused in tel.kafka_refused
    assert tel.close(1) == 3  # and RUN_END
    said = [r.getMessage() for r in caplog.records if r.name == "rlpulse.producers.sdk.transport" and r.levelno == logging.ERROR]
    assert len(said) == 1 and refused in said[0] and "events wait in the buffer" in said[0]
    broker.assert_no_secret("".join(outputs) + caplog.text)


def test_mtls_the_sdk_and_the_sink_with_a_client_certificate_and_without(broker: SecureBroker, tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    settings = broker.settings(tmp_path, mtls=True)
    ensure_topics(settings)
    with TrainingTelemetry(project="itest", run_id="mtls", settings=settings) as tel:
        tel.step_completed(step=0, tokens=10, duration_s=1.0)
        assert tel.flush(30) == 0
    assert tel.delivered == 3  # RUN_START, STEP, RUN_END
    with Pipeline(settings) as pipeline:
        pipeline.start(("sink",))
        pipeline.wait_caught_up(0)
        pipeline.stop()
    open_store = __import__("rlpulse.sinks.store.clickhouse", fromlist=["open_store"]).open_store
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        steps = store.client.query(
            f"SELECT type FROM {store.database}.steps FINAL WHERE run_id = 'mtls' ORDER BY time_ns"
        ).result_rows
    assert steps == [("RUN_START",), ("STEP",), ("RUN_END",)]

    without = broker.settings(tmp_path, mtls=False)
    want_cert = (
        f"Kafka at 127.0.0.1:{broker.ssl} closed the TLS connection during the handshake: if the listener "
        "demands client certificates (ssl.client.auth=required), set RLPULSE_KAFKA_SSL_CERTFILE"
    )
    run, seconds = rlpulse(without, "sink")
    assert run.returncode == 1 and seconds < 30, run.stderr
    [line] = [line for line in run.stderr.splitlines() if line]
    assert want_cert in line
    caplog.set_level(logging.INFO)
    denied = TrainingTelemetry(project="itest", run_id="no-cert", settings=without)
    denied.start()
    assert denied.flush(5) == 1
    assert denied.kafka_refused is not None and want_cert in denied.kafka_refused
    denied.close(1)
    logs = "".join(p.read_text() for p in (settings.home / "logs").glob("*.log"))
    broker.assert_no_secret(logs + run.stdout + run.stderr + caplog.text)


def test_bench_measures_over_sasl_ssl_and_writes_no_password(broker: SecureBroker, tmp_path: Path) -> None:
    settings = broker.settings(tmp_path)
    out = tmp_path / "bench-results"  # never the checkout's bench/results
    run, seconds = rlpulse(settings, "bench", "--smoke", "--no-profile", "--output", str(out), timeout=900)
    said = run.stdout + run.stderr
    assert run.returncode == 0, said[-4000:]
    assert (
        f"rlpulse bench: measuring the broker at 127.0.0.1:{broker.sasl_ssl} over SASL_SSL as it is "
        "(not running `services up`, which starts a local PLAINTEXT broker only)"
    ) in run.stdout
    text = (out / "latest.json").read_text()
    results = json.loads(text)
    assert results["errors"] == {}, results["errors"]
    assert (results["kafka_bootstrap"], results["kafka_security_protocol"]) == (f"127.0.0.1:{broker.sasl_ssl}", "SASL_SSL")
    for key in (
        "producer_events_per_s",
        "producer_ceiling_events_per_s",
        "consumer_ceiling_events_per_s",
        "e2e_events_per_s",
        "latency_events",
    ):
        assert results[key] > 0, key  # the SDK, ProducerPerformance, ConsumerPerformance, the drain, the live load
    assert results["e2e_exact"] is True and results["drain_complete"] is True
    assert results["e2e_latency_p50_s"] is not None
    # the Java tools' arguments as they ran: the credentials came from a file, which is gone
    [producer] = [r["command"] for r in results["producer_ceiling_runs"]]
    [consumer] = [r["command"] for r in results["consumer_ceiling_runs"]]
    assert producer.startswith("ProducerPerformance ") and "--producer.config " in producer
    assert consumer.startswith("ConsumerPerformance ") and "--consumer.config " in consumer
    for command in (producer, consumer):
        config = Path(command.split(".config ")[1].split(" ")[0])
        assert config.name == "client.properties" and not config.parent.exists()
    assert not list(Path(tempfile.gettempdir()).glob("rlpulse-bench-client-*"))
    logs = "".join(p.read_text(errors="replace") for p in out.rglob("*") if p.is_file())
    broker.assert_no_secret(said + text + logs)
    print(
        f"rlpulse bench --smoke over SASL_SSL: {seconds:.0f}s, drain {results['e2e_events_per_s']:,.0f} events/s, "
        f"ceilings producer {results['producer_ceiling_events_per_s']:,.0f} consumer "
        f"{results['consumer_ceiling_events_per_s']:,.0f} events/s"
    )


def test_bench_java_tools_over_mtls_with_the_client_certificate(broker: SecureBroker, tmp_path: Path) -> None:
    settings = broker.settings(tmp_path, mtls=True)  # its key encrypted: ssl.key.password in the 0600 file
    ensure_topics(settings)
    topic = settings.topic("spans")
    libs = kafka_perf.tools_libs(settings)
    produced = kafka_perf.producer_perf(settings, libs, topic, records=500, record_size=1000)
    assert produced["records"] == 500 and "--producer.config " in produced["command"]
    consumed = kafka_perf.consumer_perf(settings, libs, topic, messages=500)
    assert consumed["messages"] == 500 and "--consumer.config " in consumed["command"]
    broker.assert_no_secret(produced["command"] + consumed["command"])
