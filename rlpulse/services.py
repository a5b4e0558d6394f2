"""The local Kafka broker behind ``rlpulse services up|down|status``.

Apache Kafka 3.9.1 runs as one KRaft node (broker and controller in one JVM) from the official
jars, which ``mvn`` fetches from Maven Central into ``$RLPULSE_HOME/kafka/libs``. Everything the
broker writes (config, data, pid file, log) lives under ``$RLPULSE_HOME/kafka``. Only the process
named in our pid file is ever stopped; a broker someone else runs on the port is left alone.
``--brokers 3`` starts a cluster of such nodes instead (``rlpulse.cluster``); ``down`` and
``status`` act on the cluster formed in the home, if there is one.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rlpulse.kafka_jvm import STOP_TIMEOUT, ServicesError, launch
from rlpulse.kafka_jvm import format_storage as _format_storage
from rlpulse.kafka_jvm import is_kafka_with as _is_kafka_with
from rlpulse.kafka_jvm import log_tail as _log_tail
from rlpulse.kafka_jvm import pid_alive as _pid_alive
from rlpulse.kafka_jvm import say as _say
from rlpulse.kafka_jvm import stop as _stop
from rlpulse.kafka_jvm import write_log4j as _write_log4j
from rlpulse.kafka_jvm import write_private as _write_private
from rlpulse.progress import Ticker
from rlpulse.schemas.files import PRIVATE_UMASK, private_dir
from rlpulse.schemas.settings import Settings

if TYPE_CHECKING:
    from rlpulse.secure_broker import TlsListeners

KAFKA_VERSION = "3.9.1"
POM = Path(__file__).parent / "kafka" / "pom.xml"
START_TIMEOUT = 60.0
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


def _kafka_dir(settings: Settings) -> Path:
    return (settings.home / "kafka").absolute()  # absolute: the broker runs with this folder as cwd


def _private_kafka_dir(settings: Settings) -> Path:
    """The broker's folder, created (or tightened) owner-only: its data is every run's telemetry."""
    private_dir(settings.home)
    return private_dir(_kafka_dir(settings))


def _pid_file(settings: Settings) -> Path:
    return _kafka_dir(settings) / "broker.pid"


def _log_file(settings: Settings) -> Path:
    return _kafka_dir(settings) / "broker.log"


def host_port(bootstrap: str) -> tuple[str, int]:
    """Host and port of the first entry of a bootstrap list such as ``127.0.0.1:9092,...``."""
    first = bootstrap.split(",")[0].strip()
    host, sep, port = first.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bootstrap {bootstrap!r}: expected host:port, e.g. 127.0.0.1:9092")
    return host.strip("[]") or "127.0.0.1", int(port)


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    """True if something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def broker_answers(bootstrap: str, timeout: float = 5.0, **client_kwargs: object) -> bool:
    """True if a Kafka broker at ``bootstrap`` answers a metadata request within ``timeout`` seconds.

    ``client_kwargs``: security settings (``Settings.kafka_client_kwargs()`` less the bootstrap)."""
    return bool(metadata_brokers(bootstrap, timeout, **client_kwargs))


def metadata_brokers(bootstrap: str, timeout: float = 5.0, **client_kwargs: object) -> set[int]:
    """Ids of the brokers the metadata at ``bootstrap`` lists now (a fenced, dead one is not
    listed); empty when nothing answers within ``timeout`` seconds."""
    from aiokafka.client import AIOKafkaClient

    async def probe() -> set[int]:
        client = AIOKafkaClient(**{**client_kwargs, "bootstrap_servers": bootstrap}, request_timeout_ms=int(timeout * 1000))
        try:
            await asyncio.wait_for(client.bootstrap(), timeout)
            return {b.nodeId for b in client.cluster.brokers()}
        except Exception:
            return set()
        finally:
            await client.close()

    quiet = logging.getLogger("aiokafka")  # a refused connection is an answer here, not an error
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        return asyncio.run(probe())
    finally:
        quiet.setLevel(level)


def our_pid(settings: Settings) -> int | None:
    """Pid of the broker rlpulse started under ``settings.home``, if that process still runs."""
    try:
        pid = int(_pid_file(settings).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _pid_alive(pid) and _is_kafka_with(pid, _kafka_dir(settings) / "server.properties") else None


def _require(*tools: str) -> None:
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise ServicesError(
            f"{' and '.join(missing)} not found on PATH: the local Kafka broker needs Java 17+ and Maven "
            "(Debian/Ubuntu: apt-get install openjdk-17-jre-headless maven; macOS: brew install openjdk@17 maven), "
            "or run everything with `docker compose up`"
        )


def _jar_set_id() -> str:
    """What the libs folder was fetched for: the Kafka version and a digest of the pom, so a changed
    jar set (say a tool added to the pom) fetches again into a folder fetched before."""
    return f"{KAFKA_VERSION} {hashlib.sha256(POM.read_bytes()).hexdigest()[:16]}"


def fetch_jars(settings: Settings) -> Path:
    """Fetch the Kafka jars into ``$RLPULSE_HOME/kafka/libs`` with ``mvn``, once per jar set; return that folder.

    Jars already there are kept (mvn skips them), so this is safe while the broker runs from them.
    """
    libs = _kafka_dir(settings) / "libs"
    marker = libs / ".complete"
    if marker.exists() and marker.read_text().strip() == _jar_set_id():
        return libs
    _require("java", "mvn")
    _say(f"fetching Kafka {KAFKA_VERSION} jars from Maven Central with mvn into {libs} ...")
    started = time.monotonic()
    _private_kafka_dir(settings)
    libs.mkdir(mode=0o700, exist_ok=True)
    cmd = ["mvn", "-q", "-B", "-f", str(POM), "dependency:copy-dependencies", f"-DoutputDirectory={libs}"]
    # A first fetch downloads ~100 MB into ~/.m2 and can take minutes: say it is still going.
    with Ticker(f"fetching Kafka {KAFKA_VERSION} jars from Maven Central (first run)", say=_say):
        run = subprocess.run(cmd, capture_output=True, text=True, umask=PRIVATE_UMASK)
    if run.returncode != 0:
        tail = "\n".join((run.stdout + run.stderr).splitlines()[-20:])
        raise ServicesError(f"mvn failed (exit {run.returncode}) fetching the Kafka jars:\n{tail}")
    for jar in libs.iterdir():  # mvn copies ~/.m2's modes (0644): everything under the home is the owner's only
        if jar.stat().st_mode & 0o077:
            jar.chmod(0o600)
    _write_private(marker, _jar_set_id() + "\n")
    _say(f"fetched {len(list(libs.glob('*.jar')))} jars in {time.monotonic() - started:.0f}s")
    return libs


def _write_config(settings: Settings, host: str, port: int, tls: TlsListeners | None = None) -> tuple[Path, Path]:
    kdir = _private_kafka_dir(settings)
    server = kdir / "server.properties"
    extra, protocols, secure = tls.properties(host) if tls is not None else ([], [], "")
    _write_private(  # 0600: with ``tls`` it holds the keystore's password
        server,
        "# Written by `rlpulse services up` on every start; edits are overwritten.\n"
        "process.roles=broker,controller\n"
        "node.id=1\n"
        f"controller.quorum.voters=1@{host}:{port + 1}\n"
        f"listeners={','.join([f'PLAINTEXT://{host}:{port}', f'CONTROLLER://{host}:{port + 1}', *extra])}\n"
        f"advertised.listeners={','.join([f'PLAINTEXT://{host}:{port}', *extra])}\n"
        "controller.listener.names=CONTROLLER\n"
        "inter.broker.listener.name=PLAINTEXT\n"
        f"listener.security.protocol.map={','.join(['PLAINTEXT:PLAINTEXT', 'CONTROLLER:PLAINTEXT', *protocols])}\n"
        f"{secure}"
        f"log.dirs={kdir / 'data'}\n"
        "num.partitions=1\n"
        "auto.create.topics.enable=true\n"
        "offsets.topic.replication.factor=1\n"
        "transaction.state.log.replication.factor=1\n"
        "transaction.state.log.min.isr=1\n"
        "group.initial.rebalance.delay.ms=0\n"
        "log.retention.hours=168\n"
    )
    return server, _write_log4j(kdir / "log4j.properties", _log_file(settings))


def up(settings: Settings, tls: TlsListeners | None = None) -> None:
    """Start the local broker unless it already runs; return once it answers metadata requests.

    ``tls``: secure listeners besides PLAINTEXT (``rlpulse.secure_broker``; the tests use it,
    ``rlpulse services up`` does not)."""
    host, port = host_port(settings.kafka_bootstrap)
    bootstrap = f"{host}:{port}"
    log = _log_file(settings)
    pid = our_pid(settings)
    if pid is not None:
        deadline = time.monotonic() + START_TIMEOUT  # it may still be starting (a concurrent `up`)
        with Ticker(f"waiting for the broker rlpulse started (pid {pid}) to answer on {bootstrap}", say=_say):
            while not broker_answers(bootstrap, 2.0, **_security_kwargs(settings)):  # the port may be a TLS listener
                if time.monotonic() > deadline or our_pid(settings) is None:
                    raise ServicesError(f"the broker rlpulse started (pid {pid}) does not answer on {bootstrap}; "
                                        f"run `rlpulse services down` and look at {log}")
                time.sleep(0.5)
        _say(f"Kafka {KAFKA_VERSION} broker already running on {bootstrap} (pid {pid}, log: {log})")
        return
    if host not in _LOCAL_HOSTS:
        raise ServicesError(f"RLPULSE_KAFKA_BOOTSTRAP is {settings.kafka_bootstrap}: "
                            "`services up` only starts a broker on this machine (e.g. 127.0.0.1:9092)")
    for busy in (port, port + 1):
        if port_open(host, busy):
            what = "a Kafka broker" if busy == port and broker_answers(bootstrap, 3.0) else "another process"
            raise ServicesError(f"{host}:{busy} is already in use by {what} not started by rlpulse "
                                f"(RLPULSE_HOME={settings.home}); not starting a second broker. "
                                "Stop it, or pick another port with RLPULSE_KAFKA_BOOTSTRAP")
    _pid_file(settings).unlink(missing_ok=True)  # stale: that process is gone
    libs = fetch_jars(settings)
    _require("java")
    server, log4j = _write_config(settings, host, port, tls)
    _format_storage(_kafka_dir(settings) / "data", libs, server, log4j)
    started = time.monotonic()
    proc = launch(libs, server, log4j, log, _pid_file(settings))
    _say(f"started the Kafka broker (pid {proc.pid}); waiting for it to answer on {bootstrap}")
    with Ticker(f"waiting for the broker to answer on {bootstrap} (pid {proc.pid})", say=_say):
        while not broker_answers(bootstrap, 2.0):
            failed = None
            if proc.poll() is not None:
                failed = f"the Kafka broker exited with status {proc.returncode} before it answered"
            elif time.monotonic() - started > START_TIMEOUT:
                failed = f"the Kafka broker did not answer on {bootstrap} within {START_TIMEOUT:.0f}s; stopped it"
                _stop(proc.pid)
            if failed:
                _pid_file(settings).unlink(missing_ok=True)
                raise ServicesError(f"{failed}. Last lines of {log}:\n{_log_tail(log)}")
            time.sleep(0.5)
    _say(f"Kafka {KAFKA_VERSION} broker up on {bootstrap} (pid {proc.pid}, log: {log}) "
         f"in {time.monotonic() - started:.1f}s")


def down(settings: Settings) -> None:
    """Stop the broker named in our pid file, and only that one."""
    pid = our_pid(settings)
    if pid is None:
        _pid_file(settings).unlink(missing_ok=True)
        _say(f"no broker started by rlpulse is running (RLPULSE_HOME={settings.home})")
        return
    started = time.monotonic()
    clean = _stop(pid)
    _pid_file(settings).unlink(missing_ok=True)
    how = "stopped" if clean else f"killed (it ignored SIGTERM for {STOP_TIMEOUT:.0f}s)"
    _say(f"Kafka broker (pid {pid}) {how} in {time.monotonic() - started:.1f}s")


def status(settings: Settings) -> bool:
    """Print what is true about the local broker; True if ours runs and answers."""
    host, port = host_port(settings.kafka_bootstrap)
    bootstrap = f"{host}:{port}"
    pid = our_pid(settings)
    _say(f"rlpulse home: {settings.home} (RLPULSE_HOME overrides it)")
    if pid is not None:
        _say(f"broker started by rlpulse: running (pid {pid}, log: {_log_file(settings)})")
    elif _pid_file(settings).exists():
        _say(f"broker started by rlpulse: not running (stale pid file {_pid_file(settings)})")
    else:
        _say(f"broker started by rlpulse: not running (RLPULSE_HOME={settings.home})")
    _refused(settings, 3.0)  # TLS or SASL refused: say why, not "no broker"
    answers = broker_answers(bootstrap, 3.0, **_security_kwargs(settings))
    _say(f"{bootstrap}: {'a Kafka broker answers' if answers else 'no Kafka broker answers'}")
    if pid is None and (answers or port_open(host, port)):
        _say(f"note: {bootstrap} is served by a process rlpulse did not start from RLPULSE_HOME={settings.home}")
    elif not answers:
        _say("start it with `rlpulse services up` (or `make services-up`)")
    return pid is not None and answers


def _security_kwargs(settings: Settings) -> dict[str, object]:
    return {k: v for k, v in settings.kafka_client_kwargs().items() if k != "bootstrap_servers"}


def _refused(settings: Settings, timeout: float) -> None:
    """ServicesError, naming what to fix and no secret, when the broker refuses our TLS or SASL
    settings: aiokafka's own clients would only retry, then say they could not bootstrap."""
    from rlpulse.schemas.kafka_check import check_connection

    problem = check_connection(settings, timeout)
    if problem is not None and problem.refused:
        raise ServicesError(problem.message)


def require_broker(settings: Settings, timeout: float = 10.0) -> None:
    """ServicesError, with what to do, unless a Kafka broker answers at the settings' bootstrap."""
    _refused(settings, timeout)
    if not broker_answers(settings.kafka_bootstrap, timeout, **_security_kwargs(settings)):
        raise ServicesError(f"no Kafka broker answers at {settings.kafka_bootstrap}. Start the local one with "
                            "`rlpulse services up` (or `make services-up`), or point --bootstrap / "
                            "RLPULSE_KAFKA_BOOTSTRAP at yours")


def main(settings: Settings, action: str, brokers: int | None = None) -> int:
    """Run ``up``, ``down`` or ``status``; the exit code: 0 ok, 1 failed, 3 ``status`` says not running.

    ``brokers``: how many nodes ``up`` starts; None: the cluster formed in this home (``rlpulse.cluster``), if any, else one."""
    from rlpulse import cluster

    try:
        formed = cluster.formed_size(settings)
        if action == "up" and (brokers or formed or 1) > 1:
            cluster.up(settings, brokers or formed)
        elif action == "up":
            if cluster.running(settings):
                raise ServicesError(f"the Kafka cluster rlpulse started from RLPULSE_HOME={settings.home} runs: "
                                    "`rlpulse services down` first, or leave out --brokers 1")
            up(settings)
        elif action == "down":
            if formed:
                cluster.down(settings)
            if our_pid(settings) is not None or not formed:
                down(settings)
        elif action == "status":
            return 0 if (cluster.status(settings) if formed else status(settings)) else 3
        else:
            raise ValueError(f"unknown action {action!r}: expected up, down or status")
    except ServicesError as exc:
        print(f"rlpulse services {action}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0
