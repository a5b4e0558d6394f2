"""``rlpulse services up|down|status`` against a real Kafka 3.9.1 broker, through the real CLI.

The broker runs on 127.0.0.1:19092 (controller 19093) with a throwaway RLPULSE_HOME, so a broker
on the default 9092 is never touched. The first ``up`` fetches the jars with mvn (fast once
~/.m2 holds them).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rlpulse import kafka_jvm, services
from rlpulse.base import env as envvars
from rlpulse.base.settings import Settings

pytestmark = [
    pytest.mark.integration,
    pytest.mark.full,  # starts and stops brokers of its own
    pytest.mark.skipif(
        shutil.which("java") is None or shutil.which("mvn") is None,
        reason="the local Kafka broker needs java and mvn on PATH (apt-get install openjdk-17-jre-headless maven)",
    ),
]

BOOTSTRAP = "127.0.0.1:19092"
REPO = Path(__file__).resolve().parents[3]


# In the environment of `services up`; the broker it starts must not inherit it (rlpulse.kafka_jvm.JVM_ENV_ALLOWED).
SHELL_SECRET = (envvars.KAFKA_SASL_PASSWORD, "a-shell-secret-the-broker-must-not-hold")


def cli(home: Path, action: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, RLPULSE_HOME=str(home), RLPULSE_KAFKA_BOOTSTRAP=BOOTSTRAP)
    env[SHELL_SECRET[0]] = SHELL_SECRET[1]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "rlpulse.cli", "services", action],
        env=env, capture_output=True, text=True, timeout=300,
    )


def pid_in_file(home: Path) -> int | None:
    pid_file = home / "kafka" / "broker.pid"
    return int(pid_file.read_text()) if pid_file.exists() else None


def test_up_is_idempotent_and_down_stops_it(tmp_path: Path) -> None:
    settings = Settings(kafka_bootstrap=BOOTSTRAP, home=tmp_path)
    assert not services.port_open("127.0.0.1", 19092), "port 19092 is taken: this test needs it free"
    try:
        first = cli(tmp_path, "up")
        assert first.returncode == 0, first.stdout + first.stderr
        assert "broker up on 127.0.0.1:19092" in first.stdout
        pid = pid_in_file(tmp_path)
        assert pid is not None and services.our_pid(settings) == pid
        assert services.broker_answers(BOOTSTRAP, 5.0)
        # The broker got only the allowlisted names of the environment `services up` ran with.
        environ = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
        assert set(environ) <= kafka_jvm.JVM_ENV_ALLOWED and "PATH" in environ, sorted(environ)
        assert SHELL_SECRET[1] not in Path(f"/proc/{pid}/environ").read_text()

        second = cli(tmp_path, "up")
        assert second.returncode == 0, second.stdout + second.stderr
        assert "already running" in second.stdout
        assert f"pid {pid}" in second.stdout
        assert pid_in_file(tmp_path) == pid
        assert "fetching" not in second.stdout  # jars are fetched once

        running = cli(tmp_path, "status")
        assert running.returncode == 0, running.stdout + running.stderr
        assert f"running (pid {pid}" in running.stdout
        assert "a Kafka broker answers" in running.stdout

        stopped = cli(tmp_path, "down")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert f"pid {pid}" in stopped.stdout and "stopped" in stopped.stdout

        after = cli(tmp_path, "status")
        assert after.returncode == 3, after.stdout + after.stderr
        assert "not running" in after.stdout
        assert "no Kafka broker answers" in after.stdout
        assert pid_in_file(tmp_path) is None
        assert not kafka_jvm.pid_alive(pid)

        again = cli(tmp_path, "down")
        assert again.returncode == 0 and "no broker started by rlpulse is running" in again.stdout
    finally:
        cli(tmp_path, "down")


def test_up_refuses_a_port_someone_else_listens_on(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 19092))
        squatter.listen()
        try:
            result = cli(tmp_path, "up")
            assert result.returncode == 1
            assert "already in use" in result.stderr and "not starting a second broker" in result.stderr
            assert pid_in_file(tmp_path) is None

            status = cli(tmp_path, "status")
            assert status.returncode == 3
            assert "did not start" in status.stdout
        finally:
            cli(tmp_path, "down")
