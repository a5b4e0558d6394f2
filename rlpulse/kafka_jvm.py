"""One Kafka JVM from the jars: the jars fetched into the home, its log4j config, its storage
formatted, started, recognised by its pid and stopped; and the probes that tell whether a broker
answers. The single broker (``rlpulse.services``), each node of a local cluster
(``rlpulse.cluster``) and the secure listeners' tools (``rlpulse.secure_broker``) build on this
module and on nothing of one another's, so none of them imports another.

The home's Kafka folder (``$RLPULSE_HOME/kafka``) holds the jars (``libs``), the single broker's
config, data, pid file and log, a cluster's ``node-k`` folders, and the address of the broker the
home started (``rlpulse.base.settings.broker_address_file``), which ``Settings.load`` takes as
the default bootstrap.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

from rlpulse.progress import Ticker
from rlpulse.base.files import PRIVATE_UMASK, private_dir, private_file
from rlpulse.base.settings import Settings, broker_address_file, recorded_bootstrap
from rlpulse.base.errors import Error

KAFKA_VERSION = "3.9.1"
POM = Path(__file__).parent / "kafka" / "pom.xml"
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0"})  # where `services up` may start brokers
STOP_TIMEOUT = 30.0
# Per JVM: a cluster's three nodes fit a small machine beside the pipeline.
JVM_OPTS = ["-Xmx512m", "-Xms256m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true"]
# What a Kafka JVM (the broker, its storage and admin tools) gets of the user's environment: an
# allowlist. The user's shell may hold passwords (the Kafka client's, cloud keys, tokens) that
# a broker has no use for and would keep for its lifetime; COLUMNS is left out because the storage
# tool chokes on it.
JVM_ENV_ALLOWED = frozenset({"PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "JAVA_HOME"})


def jvm_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a Kafka JVM is started with: only the names in ``JVM_ENV_ALLOWED``."""
    source = os.environ if environ is None else environ
    return {k: v for k, v in source.items() if k in JVM_ENV_ALLOWED}


class ServicesError(Error, RuntimeError):
    """A failure with a message meant for the user as it is."""


def say(text: str) -> None:
    print(text, flush=True)


def pid_alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our own exited child
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def is_kafka_with(pid: int, server: Path) -> bool:
    """True if ``pid`` is a Kafka JVM started with ``server`` (not another home's broker under a reused pid)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:  # no /proc (macOS): ask ps
        run = subprocess.run(["ps", "-p", str(pid), "-o", "command="], capture_output=True, text=True)
        argv = run.stdout.split()
    return bool(argv) and Path(argv[0]).name == "java" and "kafka.Kafka" in argv and str(server) in argv


def log_tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log written)"


def write_private(path: Path, text: str) -> None:
    with open(private_file(path, append=False), "w") as f:
        f.write(text)


def write_log4j(log4j: Path, log: Path) -> Path:
    write_private(
        log4j,
        "log4j.rootLogger=INFO, file\n"
        "log4j.appender.file=org.apache.log4j.RollingFileAppender\n"
        f"log4j.appender.file.File={log}\n"
        "log4j.appender.file.MaxFileSize=50MB\n"
        "log4j.appender.file.MaxBackupIndex=2\n"
        "log4j.appender.file.layout=org.apache.log4j.PatternLayout\n"
        "log4j.appender.file.layout.ConversionPattern=[%d] %p %m (%c)%n\n"
        "log4j.logger.kafka.request.logger=WARN\n"
        "log4j.logger.org.apache.kafka.clients=WARN\n"
    )
    return log4j


def new_cluster_id() -> str:
    while True:  # Kafka's own rule: never an id that reads like a command-line flag
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


def format_storage(data: Path, libs: Path, server: Path, log4j: Path, cluster_id: str | None = None) -> None:
    """Format ``data`` (the log.dirs of ``server``) once; a cluster's nodes all get one ``cluster_id``."""
    if (data / "meta.properties").exists():
        return
    cmd = ["java", f"-Dlog4j.configuration=file:{log4j}", "-cp", f"{libs}/*",
           "kafka.tools.StorageTool", "format", "-t", cluster_id or new_cluster_id(), "-c", str(server)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=jvm_env(), umask=PRIVATE_UMASK)
    if run.returncode != 0:
        raise ServicesError(f"formatting Kafka storage failed (exit {run.returncode}):\n{run.stdout}{run.stderr}")
    say(f"formatted Kafka storage in {data}")


def launch(libs: Path, server: Path, log4j: Path, log: Path, pid_file: Path) -> subprocess.Popen:
    """Start ``kafka.Kafka server`` in its own session, output to ``log``, its pid in ``pid_file``."""
    cmd = ["java", *JVM_OPTS, f"-Dlog4j.configuration=file:{log4j}", f"-Dkafka.logs.dir={log.parent}",
           "-cp", f"{libs}/*", "kafka.Kafka", str(server)]
    # umask 077: the broker's data, its log4j files and its GC logs are the owner's only
    with open(private_file(log), "ab") as out:
        proc = subprocess.Popen(cmd, cwd=log.parent, stdin=subprocess.DEVNULL, stdout=out, env=jvm_env(),
                                stderr=subprocess.STDOUT, start_new_session=True, umask=PRIVATE_UMASK)
    write_private(pid_file, f"{proc.pid}\n")
    return proc


def stop(pid: int) -> bool:
    """SIGTERM, wait up to STOP_TIMEOUT, then SIGKILL; True if it stopped cleanly."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + STOP_TIMEOUT
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.2)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    while pid_alive(pid):
        time.sleep(0.1)
    return False


def kafka_dir(settings: Settings) -> Path:
    """The home's Kafka folder, absolute: the broker runs with this folder as its cwd."""
    return (settings.home / "kafka").absolute()


def private_kafka_dir(settings: Settings) -> Path:
    """The Kafka folder, created (or tightened) owner-only: its data is every run's telemetry."""
    private_dir(settings.home)
    return private_dir(kafka_dir(settings))


def broker_pid_file(settings: Settings) -> Path:
    """The single broker's pid file (a cluster's nodes keep theirs in ``node-k``)."""
    return kafka_dir(settings) / "broker.pid"


def broker_pid(settings: Settings) -> int | None:
    """Pid of the single broker rlpulse started under ``settings.home``, if that process still runs."""
    try:
        pid = int(broker_pid_file(settings).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) and is_kafka_with(pid, kafka_dir(settings) / "server.properties") else None


def record_address(settings: Settings, servers: str) -> Path:
    """Record in the home the bootstrap servers of the broker (or cluster) it started: a bare
    ``rlpulse`` run with this home then finds it on whatever port it listens (``Settings.load``)."""
    private_kafka_dir(settings)
    path = broker_address_file(settings.home)
    write_private(path, servers + "\n")
    return path


def forget_address(settings: Settings) -> None:
    """Remove the recorded address: the home's broker is stopped, so the default applies again."""
    broker_address_file(settings.home).unlink(missing_ok=True)


def address_line(settings: Settings) -> str:
    """What ``services status`` says about the address it probes and where that address came from."""
    recorded = recorded_bootstrap(settings.home)
    if recorded == settings.kafka_bootstrap:
        why = f"recorded in {broker_address_file(settings.home)} by `rlpulse services up`"
    elif recorded:
        why = f"from --bootstrap or the environment; this home's broker was recorded at {recorded}"
    else:
        why = "no broker recorded in this home: --bootstrap, the environment, else the default"
    return f"broker address: {settings.kafka_bootstrap} ({why})"


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


def require_tools(*tools: str) -> None:
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
    libs = kafka_dir(settings) / "libs"
    marker = libs / ".complete"
    if marker.exists() and marker.read_text().strip() == _jar_set_id():
        return libs
    require_tools("java", "mvn")
    say(f"fetching Kafka {KAFKA_VERSION} jars from Maven Central with mvn into {libs} ...")
    started = time.monotonic()
    private_kafka_dir(settings)
    libs.mkdir(mode=0o700, exist_ok=True)
    cmd = ["mvn", "-q", "-B", "-f", str(POM), "dependency:copy-dependencies", f"-DoutputDirectory={libs}"]
    # A first fetch downloads ~100 MB into ~/.m2 and can take minutes: say it is still going.
    with Ticker(f"fetching Kafka {KAFKA_VERSION} jars from Maven Central (first run)", say=say):
        run = subprocess.run(cmd, capture_output=True, text=True, umask=PRIVATE_UMASK)
    if run.returncode != 0:
        tail = "\n".join((run.stdout + run.stderr).splitlines()[-20:])
        raise ServicesError(f"mvn failed (exit {run.returncode}) fetching the Kafka jars:\n{tail}")
    for jar in libs.iterdir():  # mvn copies ~/.m2's modes (0644): everything under the home is the owner's only
        if jar.stat().st_mode & 0o077:
            jar.chmod(0o600)
    write_private(marker, _jar_set_id() + "\n")
    say(f"fetched {len(list(libs.glob('*.jar')))} jars in {time.monotonic() - started:.0f}s")
    return libs
