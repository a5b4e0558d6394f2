"""The local Kafka broker behind ``rlpulse services up|down|status``.

Apache Kafka 3.9.1 runs as one KRaft node (broker and controller in one JVM) from the official
jars, which ``mvn`` fetches from Maven Central into ``$RLPULSE_HOME/kafka/libs``. Everything the
broker writes (config, data, pid file, log) lives under ``$RLPULSE_HOME/kafka``. Only the process
named in our pid file is ever stopped; a broker someone else runs on the port is left alone.
``--brokers 3`` starts a cluster of such nodes instead (``rlpulse.cluster``); ``down`` and
``status`` act on the cluster formed in the home, if there is one.

``up`` records the broker's address in the home and ``down`` removes it: a bare ``rlpulse`` run
with that home (no --bootstrap, no RLPULSE_KAFKA_BOOTSTRAP) finds the broker on whatever port it
was started (``Settings.load``). This module imports ``rlpulse.cluster``, never the reverse: both
stand on ``rlpulse.kafka_jvm``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rlpulse import cluster
from rlpulse.kafka_jvm import (KAFKA_VERSION, LOCAL_HOSTS, POM, STOP_TIMEOUT, ServicesError, address_line,
                               broker_answers, broker_pid, broker_pid_file, fetch_jars, forget_address,
                               format_storage, host_port, kafka_dir, launch, log_tail, port_open,
                               private_kafka_dir, record_address, require_tools, say, stop, write_log4j,
                               write_private)
from rlpulse.progress import Ticker
from rlpulse.base import env as envvars
from rlpulse.base.settings import Settings, recorded_bootstrap

if TYPE_CHECKING:  # only the type: secure_broker imports nothing of this module
    from rlpulse.secure_broker import TlsListeners

# Some names are kafka_jvm's, imported for the callers that know them as services.<name> (bench, tests).
__all__ = ["KAFKA_VERSION", "POM", "ServicesError", "broker_answers", "fetch_jars", "host_port", "port_open",
           "our_pid", "up", "down", "status", "require_broker", "main"]

START_TIMEOUT = 60.0
our_pid = broker_pid  # the single broker rlpulse started from this home, if it runs


def _log_file(settings: Settings) -> Path:
    return kafka_dir(settings) / "broker.log"


def _write_config(settings: Settings, host: str, port: int, tls: TlsListeners | None = None) -> tuple[Path, Path]:
    kdir = private_kafka_dir(settings)
    server = kdir / "server.properties"
    extra, protocols, secure = tls.properties(host) if tls is not None else ([], [], "")
    write_private(  # 0600: with ``tls`` it holds the keystore's password
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
    return server, write_log4j(kdir / "log4j.properties", _log_file(settings))


def up(settings: Settings, tls: TlsListeners | None = None) -> None:
    """Start the local broker unless it already runs; return once it answers metadata requests.

    ``tls``: secure listeners besides PLAINTEXT (``rlpulse.secure_broker``; the tests use it,
    ``rlpulse services up`` does not)."""
    host, port = host_port(settings.kafka_bootstrap)
    bootstrap = f"{host}:{port}"
    log = _log_file(settings)
    pid = our_pid(settings)
    recorded = recorded_bootstrap(settings.home)
    if pid is not None and recorded and bootstrap not in recorded.split(","):
        raise ServicesError(f"the broker rlpulse started from {envvars.HOME}={settings.home} (pid {pid}) listens on "
                            f"{recorded}, not {bootstrap}: leave out --bootstrap / {envvars.KAFKA_BOOTSTRAP}, or "
                            "`rlpulse services down` first")
    if pid is not None:
        deadline = time.monotonic() + START_TIMEOUT  # it may still be starting (a concurrent `up`)
        with Ticker(f"waiting for the broker rlpulse started (pid {pid}) to answer on {bootstrap}", say=say):
            while not broker_answers(bootstrap, 2.0, **_security_kwargs(settings)):  # the port may be a TLS listener
                if time.monotonic() > deadline or our_pid(settings) is None:
                    raise ServicesError(f"the broker rlpulse started (pid {pid}) does not answer on {bootstrap}; "
                                        f"run `rlpulse services down` and look at {log}")
                time.sleep(0.5)
        record_address(settings, bootstrap)  # a broker started before homes recorded their address
        say(f"Kafka {KAFKA_VERSION} broker already running on {bootstrap} (pid {pid}, log: {log})")
        return
    if host not in LOCAL_HOSTS:
        raise ServicesError(f"{envvars.KAFKA_BOOTSTRAP} is {settings.kafka_bootstrap}: "
                            "`services up` only starts a broker on this machine (e.g. 127.0.0.1:9092)")
    for busy in (port, port + 1):
        if port_open(host, busy):
            what = "a Kafka broker" if busy == port and broker_answers(bootstrap, 3.0) else "another process"
            raise ServicesError(f"{host}:{busy} is already in use by {what} not started by rlpulse "
                                f"({envvars.HOME}={settings.home}); not starting a second broker. "
                                f"Stop it, or pick another port with {envvars.KAFKA_BOOTSTRAP}")
    broker_pid_file(settings).unlink(missing_ok=True)  # stale: that process is gone
    libs = fetch_jars(settings)
    require_tools("java")
    server, log4j = _write_config(settings, host, port, tls)
    format_storage(kafka_dir(settings) / "data", libs, server, log4j)
    started = time.monotonic()
    proc = launch(libs, server, log4j, log, broker_pid_file(settings))
    say(f"started the Kafka broker (pid {proc.pid}); waiting for it to answer on {bootstrap}")
    with Ticker(f"waiting for the broker to answer on {bootstrap} (pid {proc.pid})", say=say):
        while not broker_answers(bootstrap, 2.0):
            failed = None
            if proc.poll() is not None:
                failed = f"the Kafka broker exited with status {proc.returncode} before it answered"
            elif time.monotonic() - started > START_TIMEOUT:
                failed = f"the Kafka broker did not answer on {bootstrap} within {START_TIMEOUT:.0f}s; stopped it"
                stop(proc.pid)
            if failed:
                broker_pid_file(settings).unlink(missing_ok=True)
                raise ServicesError(f"{failed}. Last lines of {log}:\n{log_tail(log)}")
            time.sleep(0.5)
    record_address(settings, bootstrap)
    say(f"Kafka {KAFKA_VERSION} broker up on {bootstrap} (pid {proc.pid}, log: {log}) "
        f"in {time.monotonic() - started:.1f}s")


def down(settings: Settings) -> None:
    """Stop the broker named in our pid file, and only that one; forget its address."""
    pid = our_pid(settings)
    forget_address(settings)
    if pid is None:
        broker_pid_file(settings).unlink(missing_ok=True)
        say(f"no broker started by rlpulse is running ({envvars.HOME}={settings.home})")
        return
    started = time.monotonic()
    clean = stop(pid)
    broker_pid_file(settings).unlink(missing_ok=True)
    how = "stopped" if clean else f"killed (it ignored SIGTERM for {STOP_TIMEOUT:.0f}s)"
    say(f"Kafka broker (pid {pid}) {how} in {time.monotonic() - started:.1f}s")


def status(settings: Settings) -> bool:
    """Print what is true about the local broker; True if ours runs and answers."""
    host, port = host_port(settings.kafka_bootstrap)
    bootstrap = f"{host}:{port}"
    pid = our_pid(settings)
    say(f"rlpulse home: {settings.home} ({envvars.HOME} overrides it)")
    say(address_line(settings))
    if pid is not None:
        say(f"broker started by rlpulse: running (pid {pid}, log: {_log_file(settings)})")
    elif broker_pid_file(settings).exists():
        say(f"broker started by rlpulse: not running (stale pid file {broker_pid_file(settings)})")
    else:
        say(f"broker started by rlpulse: not running ({envvars.HOME}={settings.home})")
    _refused(settings, 3.0)  # TLS or SASL refused: say why, not "no broker"
    answers = broker_answers(bootstrap, 3.0, **_security_kwargs(settings))
    say(f"{bootstrap}: {'a Kafka broker answers' if answers else 'no Kafka broker answers'}")
    if pid is None and (answers or port_open(host, port)):
        say(f"note: {bootstrap} is served by a process rlpulse did not start from {envvars.HOME}={settings.home}")
    elif not answers:
        say("start it with `rlpulse services up` (or `make services-up`)")
    return pid is not None and answers


def _security_kwargs(settings: Settings) -> dict[str, object]:
    return {k: v for k, v in settings.kafka_client_kwargs().items() if k != "bootstrap_servers"}


def _refused(settings: Settings, timeout: float) -> None:
    """ServicesError, naming what to fix and no secret, when the broker refuses our TLS or SASL
    settings: aiokafka's own clients would only retry, then say they could not bootstrap."""
    from rlpulse.base.kafka_check import check_connection

    problem = check_connection(settings, timeout)
    if problem is not None and problem.refused:
        raise ServicesError(problem.message)


def require_broker(settings: Settings, timeout: float = 10.0) -> None:
    """ServicesError, with what to do, unless a Kafka broker answers at the settings' bootstrap."""
    _refused(settings, timeout)
    if not broker_answers(settings.kafka_bootstrap, timeout, **_security_kwargs(settings)):
        raise ServicesError(f"no Kafka broker answers at {settings.kafka_bootstrap}. Start the local one with "
                            "`rlpulse services up` (or `make services-up`), or point --bootstrap / "
                            f"{envvars.KAFKA_BOOTSTRAP} at yours")


def main(settings: Settings, action: str, brokers: int | None = None) -> int:
    """Run ``up``, ``down`` or ``status``; the exit code: 0 ok, 1 failed, 3 ``status`` says not running.

    ``brokers``: how many nodes ``up`` starts; None: the cluster formed in this home (``rlpulse.cluster``), if any, else one."""
    try:
        formed = cluster.formed_size(settings)
        if action == "up" and (brokers or formed or 1) > 1:
            cluster.up(settings, brokers or formed)
        elif action == "up":
            if cluster.running(settings):
                raise ServicesError(f"the Kafka cluster rlpulse started from {envvars.HOME}={settings.home} runs: "
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
