"""Kafka's own ceilings on this machine, from the broker's jars: ``ProducerPerformance`` and
``ConsumerPerformance`` (``org.apache.kafka:kafka-tools``, fetched with the broker's jars).

Both tools count Kafka records (our messages); one of our messages is a container of many
events, so their records/s are converted to events/s with our records-per-message (see
:func:`producer_ceiling` and :func:`consumer_ceiling`, which say so in their results).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any
from collections.abc import Iterator

from bench.stats import median
from rlpulse import services
from rlpulse.base import env as envvars
from rlpulse.base.settings import Settings

JVM_OPTS = ["-Xmx512m", "-Xms128m", "-Djava.awt.headless=true"]
# The jars ship only slf4j-reload4j as a backend: without a config log4j prints a warning per
# run, and at INFO the clients log every config value. Warnings and errors go to stderr.
LOG4J = """log4j.rootLogger=WARN, stderr
log4j.appender.stderr=org.apache.log4j.ConsoleAppender
log4j.appender.stderr.Target=System.err
log4j.appender.stderr.layout=org.apache.log4j.PatternLayout
log4j.appender.stderr.layout.ConversionPattern=%p %m (%c)%n
# a topic's first metadata response names it unknown until it is created: expected, not a problem
log4j.logger.org.apache.kafka.clients.NetworkClient=ERROR
"""
# The producer settings a ceiling uses: acks=all as our idempotent producers need, the
# compression the design asks of every producer, and Kafka's usual throughput batching.
PRODUCER_PROPS = {"acks": "all", "compression.type": "lz4", "linger.ms": "5", "batch.size": "262144",
                  "max.request.size": "1048576"}

_PRODUCER_LINE = re.compile(
    r"(?P<records>\d+) records sent, (?P<rps>[\d.]+) records/sec \((?P<mbps>[\d.]+) MB/sec\), "
    r"(?P<avg>[\d.]+) ms avg latency, (?P<max>[\d.]+) ms max latency, (?P<p50>\d+) ms 50th, (?P<p95>\d+) ms 95th, "
    r"(?P<p99>\d+) ms 99th")


class PerfError(RuntimeError):
    """A Kafka tool failed or printed something we cannot read; the message carries its output."""


def tools_libs(settings: Settings) -> Path:
    """The broker's jar folder, which must hold kafka-tools (``services.fetch_jars`` adds it)."""
    libs = services.fetch_jars(settings)
    if not list(libs.glob("kafka-tools-[0-9]*.jar")):
        raise PerfError(f"no kafka-tools jar in {libs}: run `rlpulse services up` to fetch the jars of rlpulse/kafka/pom.xml")
    return libs


_CERT = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)
_PLAIN_KEY = re.compile(r"-----BEGIN PRIVATE KEY-----.+?-----END PRIVATE KEY-----", re.S)
_LOGIN_MODULES = {"PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
                  "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
                  "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule"}


def _escape(value: str) -> str:
    """A value as java.util.Properties reads it back (Latin-1 file: anything else as \\uXXXX)."""
    out = []
    for c in value:
        if c == "\\":
            out.append("\\\\")
        elif c in "\n\r\t\f":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t", "\f": "\\f"}[c])
        elif not " " <= c <= "~":  # UTF-16 units, as Java strings hold them
            units = c.encode("utf-16-be")
            out += [f"\\u{int.from_bytes(units[i:i + 2], 'big'):04x}" for i in range(0, len(units), 2)]
        else:
            out.append(c)
    text = "".join(out)
    return "\\" + text if text.startswith(" ") else text  # a leading blank would be dropped


def _jaas_quote(value: str) -> str:
    """A JAAS option value in double quotes (JAAS reads backslash escapes inside them)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def client_properties(settings: Settings, folder: Path) -> dict[str, str]:
    """The Java clients' security settings for ``settings`` (empty for PLAINTEXT).

    With mTLS, the client certificate and its key go into one PEM keystore in ``folder`` (Kafka's
    PEM keystore is a single file holding the PKCS#8 key and the chain; see :func:`_plain_pkcs8`)."""
    protocol = settings.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return {}
    props = {"security.protocol": protocol}
    if protocol.startswith("SASL_"):
        mechanism = settings.kafka_sasl_mechanism
        props["sasl.mechanism"] = mechanism
        props["sasl.jaas.config"] = (f"{_LOGIN_MODULES[mechanism]} required username={_jaas_quote(settings.kafka_sasl_username)} "
                                     f"password={_jaas_quote(settings.kafka_sasl_password)};")
    if protocol.endswith("SSL"):
        if settings.kafka_ssl_cafile:  # else the JVM's own CAs, as the Python clients use the system's
            props.update({"ssl.truststore.type": "PEM", "ssl.truststore.location": settings.kafka_ssl_cafile})
        if settings.kafka_ssl_certfile:
            cert_text = Path(settings.kafka_ssl_certfile).read_text()
            certs = "".join(f"{m}\n" for m in _CERT.findall(cert_text))
            key = _plain_pkcs8(settings.kafka_ssl_keyfile or settings.kafka_ssl_certfile, settings.kafka_ssl_key_password)
            keystore = folder / "client-keystore.pem"
            _write_private(keystore, key + certs)
            props.update({"ssl.keystore.type": "PEM", "ssl.keystore.location": str(keystore)})
    return props


def _plain_pkcs8(path: str, password: str) -> str:
    """The private key in ``path`` as unencrypted PKCS#8 PEM, for Kafka's PEM keystore.

    Kafka reads only PKCS#8, and of encrypted keys only PBES1 ones: a key encrypted as openssl
    does by default (PBES2, e.g. AES-256) fails with "PBES2 SecretKeyFactory not available". So
    the key is decrypted with openssl (the password on its stdin) into the keystore, which lives
    in the same private 0700 folder as the password file and goes with it."""
    text = Path(path).read_text()
    plain = _PLAIN_KEY.search(text)
    if plain:
        return plain.group(0) + "\n"
    if "PRIVATE KEY-----" not in text:
        raise PerfError(
            f"no private key in {path} ({envvars.KAFKA_SSL_KEYFILE}): the Java tools need the client certificate's key"
        )
    if shutil.which("openssl") is None:
        raise PerfError(
            "the client key is encrypted or not PKCS#8, which Kafka's Java PEM keystore cannot read: "
            f"install openssl to convert it, or give {envvars.KAFKA_SSL_KEYFILE} an unencrypted PKCS#8 key"
        )
    run = subprocess.run(
        ["openssl", "pkcs8", "-topk8", "-nocrypt", "-in", path, "-passin", "stdin"],
        input=password + "\n",
        capture_output=True,
        text=True,
        timeout=30,
    )
    key = _PLAIN_KEY.search(run.stdout) if run.returncode == 0 else None
    if key is None:
        why = next((line for line in run.stderr.splitlines() if "could not" in line.lower()), f"exit {run.returncode}")
        raise PerfError(f"openssl could not read the client key {path} with {envvars.KAFKA_SSL_KEY_PASSWORD} ({why.strip()})")
    return key.group(0) + "\n"


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="latin-1", errors="strict") as f:
        f.write(text)


@contextlib.contextmanager
def client_config(settings: Settings) -> Iterator[Path | None]:
    """A 0600 properties file of the security settings for ``--producer.config`` /
    ``--consumer.config``, in a private temp folder removed on exit; None for PLAINTEXT.

    Passwords go to the tools only through this file, never on a command line that ``ps`` shows."""
    if settings.kafka_security_protocol == "PLAINTEXT":
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="rlpulse-bench-client-") as tmp:  # mkdtemp: 0700
        folder = Path(tmp)
        path = folder / "client.properties"
        _write_private(path, "".join(f"{k}={_escape(v)}\n" for k, v in client_properties(settings, folder).items()))
        yield path


def _java(libs: Path, main: str, args: list[str], timeout: float) -> tuple[str, str]:
    """(the tool's stdout, its arguments as one line: what the results record of how it ran)."""
    with tempfile.NamedTemporaryFile("w", suffix=".properties", prefix="rlpulse-bench-log4j-") as log4j:
        log4j.write(LOG4J)
        log4j.flush()
        cmd = ["java", *JVM_OPTS, f"-Dlog4j.configuration=file:{log4j.name}", "-cp", f"{libs}/*", main, *args]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise PerfError(f"{main.rsplit('.', 1)[-1]} ran past {timeout:.0f}s") from exc
    if run.returncode != 0:
        # a Java stack trace's frames would crowd out its messages ("Caused by: ..."): keep those
        lines = [line for line in (run.stdout + run.stderr).splitlines() if not line.lstrip().startswith(("at ", "..."))]
        tail = "\n".join(lines[-15:])
        raise PerfError(f"{main.rsplit('.', 1)[-1]} exited with {run.returncode}:\n{tail}")
    return run.stdout, " ".join([main.rsplit(".", 1)[-1], *args])


def parse_producer(stdout: str) -> dict[str, float]:
    """The summary line ProducerPerformance prints last (its periodic lines lack the percentiles)."""
    matches = list(_PRODUCER_LINE.finditer(stdout))
    if not matches:
        raise PerfError(f"no ProducerPerformance summary in its output:\n{stdout[-2000:]}")
    m = matches[-1]
    return {
        "records": int(m["records"]),
        "records_per_s": float(m["rps"]),
        "mb_per_s": float(m["mbps"]),
        "latency_avg_ms": float(m["avg"]),
        "latency_p99_ms": float(m["p99"]),
    }


def parse_consumer(stdout: str) -> dict[str, float]:
    """ConsumerPerformance's CSV: a header line, then one line of totals."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    for i, line in enumerate(lines[:-1]):
        if line.startswith("start.time,"):
            header = [h.strip() for h in line.split(",")]
            values = [v.strip() for v in lines[i + 1].split(",")]
            row = dict(zip(header, values))
            try:
                return {
                    "messages": int(row["data.consumed.in.nMsg"]),
                    "mb": float(row["data.consumed.in.MB"]),
                    "messages_per_s": float(row["nMsg.sec"]),
                    "mb_per_s": float(row["MB.sec"]),
                    # fetch.* leave out the group join (rebalance.time.ms): the rate of reading itself
                    "fetch_messages_per_s": float(row["fetch.nMsg.sec"]),
                    "fetch_mb_per_s": float(row["fetch.MB.sec"]),
                    "rebalance_ms": float(row["rebalance.time.ms"]),
                    "fetch_ms": float(row["fetch.time.ms"]),
                }
            except (KeyError, ValueError) as exc:
                raise PerfError(f"unreadable ConsumerPerformance totals {lines[i + 1]!r}: {exc}") from None
    raise PerfError(f"no ConsumerPerformance totals in its output:\n{stdout[-2000:]}")


def producer_perf(
    settings: Settings, libs: Path, topic: str, records: int, record_size: int, timeout: float = 120.0
) -> dict[str, float]:
    props = [f"bootstrap.servers={settings.kafka_bootstrap}", *(f"{k}={v}" for k, v in PRODUCER_PROPS.items())]
    with client_config(settings) as config:
        out, command = _java(
            libs,
            "org.apache.kafka.tools.ProducerPerformance",
            [
                "--topic",
                topic,
                "--num-records",
                str(records),
                "--record-size",
                str(record_size),
                "--throughput",
                "-1",
                *(["--producer.config", str(config)] if config else []),
                "--producer-props",
                *props,
            ],
            timeout,
        )
    return {**parse_producer(out), "command": command}


def consumer_perf(settings: Settings, libs: Path, topic: str, messages: int, timeout: float = 120.0) -> dict[str, float]:
    """Read ``messages`` records of ``topic`` from the start, in a fresh consumer group."""
    with client_config(settings) as config:
        out, command = _java(
            libs,
            "org.apache.kafka.tools.ConsumerPerformance",
            [
                "--bootstrap-server",
                settings.kafka_bootstrap,
                "--topic",
                topic,
                "--messages",
                str(messages),
                "--group",
                f"rlpulse-bench-cperf-{uuid.uuid4().hex[:8]}",
                "--timeout",
                "30000",
                *(["--consumer.config", str(config)] if config else []),
            ],
            timeout,
        )
    return {**parse_consumer(out), "command": command}


def producer_ceiling(
    settings: Settings,
    libs: Path,
    topic: str,
    record_size: int,
    events_per_record: float,
    reps: int = 3,
    target_mb: float = 120.0,
) -> dict[str, Any]:
    """Median of ``reps`` ProducerPerformance runs with records the size of our span containers."""
    records = max(200, int(target_mb * 1e6 / record_size))
    runs = [producer_perf(settings, libs, topic, records, record_size) for _ in range(reps)]
    rps = median(r["records_per_s"] for r in runs)
    return {
        "producer_ceiling_events_per_s": None if rps is None else rps * events_per_record,
        "producer_ceiling_records_per_s": rps,
        "producer_ceiling_mb_per_s": median(r["mb_per_s"] for r in runs),
        "producer_ceiling_latency_p99_ms": median(r["latency_p99_ms"] for r in runs),
        "producer_ceiling_runs": runs,
        "producer_ceiling_conversion": (
            f"Kafka records/s x {events_per_record:.1f} events per record: each ProducerPerformance record is "
            f"{record_size} bytes, the mean size of our span containers of {events_per_record:.1f} events "
            f"(median of {reps} runs of {records} records; producer {PRODUCER_PROPS}; its payload is random "
            "letters, which lz4 compresses less than Avro)"
        ),
    }


def consumer_figures(runs: list[dict[str, Any]], events_per_message: float, messages: int) -> dict[str, Any]:
    """The consumer ceiling from ConsumerPerformance runs that each read a whole backlog topic the drain reads."""
    mps = median(r["fetch_messages_per_s"] for r in runs)
    return {
        "consumer_ceiling_events_per_s": None if mps is None else mps * events_per_message,
        "consumer_ceiling_messages_per_s": mps,
        "consumer_ceiling_mb_per_s": median(r["fetch_mb_per_s"] for r in runs),
        "consumer_ceiling_runs": runs,
        "consumer_ceiling_conversion": (
            f"ConsumerPerformance fetch.nMsg.sec (group join excluded) x {events_per_message:.1f} events per message; "
            f"each run reads all {messages} messages of a backlog's spans topic, the topic its drain then reads "
            f"(median of {len(runs)} runs)"
        ),
    }
