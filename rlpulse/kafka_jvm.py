"""One Kafka JVM from the jars: its log4j config, its storage formatted, started, recognised by
its pid and stopped. The single broker (``rlpulse.services``) and each node of a local cluster
(``rlpulse.cluster``) are such a JVM.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

from rlpulse.schemas.files import PRIVATE_UMASK, private_file

STOP_TIMEOUT = 30.0
# Per JVM: a cluster's three nodes fit a small machine beside the pipeline.
JVM_OPTS = ["-Xmx512m", "-Xms256m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true"]


class ServicesError(RuntimeError):
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
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # StorageTool chokes on COLUMNS
    cmd = ["java", f"-Dlog4j.configuration=file:{log4j}", "-cp", f"{libs}/*",
           "kafka.tools.StorageTool", "format", "-t", cluster_id or new_cluster_id(), "-c", str(server)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, umask=PRIVATE_UMASK)
    if run.returncode != 0:
        raise ServicesError(f"formatting Kafka storage failed (exit {run.returncode}):\n{run.stdout}{run.stderr}")
    say(f"formatted Kafka storage in {data}")


def launch(libs: Path, server: Path, log4j: Path, log: Path, pid_file: Path) -> subprocess.Popen:
    """Start ``kafka.Kafka server`` in its own session, output to ``log``, its pid in ``pid_file``."""
    cmd = ["java", *JVM_OPTS, f"-Dlog4j.configuration=file:{log4j}", f"-Dkafka.logs.dir={log.parent}",
           "-cp", f"{libs}/*", "kafka.Kafka", str(server)]
    # umask 077: the broker's data, its log4j files and its GC logs are the owner's only
    with open(private_file(log), "ab") as out:
        proc = subprocess.Popen(cmd, cwd=log.parent, stdin=subprocess.DEVNULL, stdout=out,
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
