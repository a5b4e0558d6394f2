"""A local Kafka cluster of several KRaft nodes: ``rlpulse services up --brokers 3``.

Every node is broker and controller in one JVM (combined mode, as the single broker of
``rlpulse.services``), started from the same jars (``rlpulse.kafka_jvm``, which this module and
``rlpulse.services`` share; ``services`` imports this module, never the reverse). The nodes form
one controller quorum (a static ``controller.quorum.voters`` naming all of them) and share one
cluster id, formatted into each node's storage. Node k (1-based) listens for clients on P + 2(k-1)
and for the quorum on the port above, P being the bootstrap's first port: 9092, 9094, 9096
(controllers 9093, 9095, 9097) by default. Node k's config, data, pid file and log live in
``$RLPULSE_HOME/kafka/node-k``; ``up`` records the nodes' bootstrap string in the home, as the
single broker's address is.

Replication is min(3, nodes) with ``min.insync.replicas=2`` from three up, for the brokers'
own topics (committed offsets, transaction state) and, through ``rlpulse.schemas.topics.ensure_topics``,
the pipeline's: with one node of three down, ``acks=all`` producers and group commits go on.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from rlpulse import kafka_jvm
from rlpulse.kafka_jvm import ServicesError, say as _say
from rlpulse.progress import Ticker
from rlpulse.base import env as envvars
from rlpulse.base.settings import Settings

START_TIMEOUT = 120.0  # several JVMs starting at once on a small machine, then electing a controller


def replication(size: int) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) of a ``size``-node cluster: the pipeline's topics' rule."""
    from rlpulse.schemas.topics import replication_for

    return replication_for(size)


def node_dir(settings: Settings, node: int) -> Path:
    return kafka_jvm.kafka_dir(settings) / f"node-{node}"


def ports(base: int, node: int) -> tuple[int, int]:
    """(client port, controller port) of ``node`` (1-based) when node 1 listens on ``base``."""
    return base + 2 * (node - 1), base + 2 * (node - 1) + 1


def bootstrap(host: str, base: int, size: int) -> str:
    """The bootstrap string naming every node: a client still starts when any one node is down."""
    return ",".join(f"{host}:{ports(base, n)[0]}" for n in range(1, size + 1))


def node_properties(node: int, size: int, host: str, base: int, data: Path) -> str:
    """Node ``node``'s server.properties in a cluster of ``size`` on ``host``."""
    port, controller = ports(base, node)
    voters = ",".join(f"{n}@{host}:{ports(base, n)[1]}" for n in range(1, size + 1))
    factor, min_isr = replication(size)
    return (
        "# Written by `rlpulse services up --brokers N` on every start; edits are overwritten.\n"
        "process.roles=broker,controller\n"
        f"node.id={node}\n"
        f"controller.quorum.voters={voters}\n"
        f"listeners=PLAINTEXT://{host}:{port},CONTROLLER://{host}:{controller}\n"
        f"advertised.listeners=PLAINTEXT://{host}:{port}\n"
        "controller.listener.names=CONTROLLER\n"
        "inter.broker.listener.name=PLAINTEXT\n"
        "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT\n"
        f"log.dirs={data}\n"
        "num.partitions=1\n"
        "auto.create.topics.enable=true\n"  # as the single broker; ensure_topics creates ours first
        f"default.replication.factor={factor}\n"
        f"min.insync.replicas={min_isr}\n"
        f"offsets.topic.replication.factor={factor}\n"
        f"transaction.state.log.replication.factor={factor}\n"
        f"transaction.state.log.min.isr={min_isr}\n"
        "unclean.leader.election.enable=false\n"  # a replica that missed acknowledged writes never leads
        "group.initial.rebalance.delay.ms=0\n"
        "log.retention.hours=168\n"
        # Three JVMs starting on two busy cores: a node whose quorum was still forming gave up registering
        # after Kafka's 60 s and exited ("unable to register with the controller quorum"); up waits 120 s.
        "initial.broker.registration.timeout.ms=180000\n"
    )


def formed_size(settings: Settings) -> int:
    """How many nodes the cluster formed in this home has (0: none was)."""
    kdir = kafka_jvm.kafka_dir(settings)
    return len(list(kdir.glob("node-*/server.properties"))) if kdir.is_dir() else 0


def node_pid(settings: Settings, node: int) -> int | None:
    """Pid of node ``node`` if the process named in its pid file still runs as that node."""
    try:
        pid = int((node_dir(settings, node) / "broker.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    server = node_dir(settings, node) / "server.properties"
    return pid if kafka_jvm.pid_alive(pid) and kafka_jvm.is_kafka_with(pid, server) else None


def running(settings: Settings) -> list[int]:
    """The nodes of this home's cluster whose process runs."""
    return [n for n in range(1, formed_size(settings) + 1) if node_pid(settings, n) is not None]


def live_brokers(bootstrap_servers: str, timeout: float = 5.0) -> set[int]:
    """Ids of the brokers the cluster's metadata lists now (a fenced, dead broker is not listed)."""
    return kafka_jvm.metadata_brokers(bootstrap_servers, timeout)


def _cluster_id(settings: Settings) -> str:
    """The id every node is formatted with, kept in ``kafka/cluster.id`` so a node added or
    re-formatted later joins the same cluster."""
    path = kafka_jvm.kafka_dir(settings) / "cluster.id"
    if not path.exists():
        kafka_jvm.write_private(path, kafka_jvm.new_cluster_id() + "\n")
    return path.read_text().strip()


def start_node(settings: Settings, node: int, size: int) -> int:
    """Write node ``node``'s config, format its storage (once) and start it; its pid. Returns at
    once: a node alone does not answer until a majority of the quorum runs."""
    host, base = kafka_jvm.host_port(settings.kafka_bootstrap)
    libs = kafka_jvm.fetch_jars(settings)
    ndir = node_dir(settings, node)
    ndir.mkdir(mode=0o700, parents=True, exist_ok=True)
    server, data, log = ndir / "server.properties", ndir / "data", ndir / "broker.log"
    kafka_jvm.write_private(server, node_properties(node, size, host, base, data))
    log4j = kafka_jvm.write_log4j(ndir / "log4j.properties", log)
    kafka_jvm.format_storage(data, libs, server, log4j, _cluster_id(settings))
    return kafka_jvm.launch(libs, server, log4j, log, ndir / "broker.pid").pid


def wait_brokers(settings: Settings, size: int, nodes: set[int], timeout: float = START_TIMEOUT) -> float:
    """Wait until every running node's own metadata lists every one of ``nodes``; seconds waited. ServicesError, with
    the log's tail, when a node's process exits or the time is up."""
    host, base = kafka_jvm.host_port(settings.kafka_bootstrap)
    servers = bootstrap(host, base, size)
    started = time.monotonic()
    # Every node asked alone must list them all: a node's metadata cache learns of the others a
    # moment after the first one does, and topics created through a node that lists two of three
    # got two copies (CI saw it).
    def each_running() -> list[str]:
        return [f"{host}:{ports(base, n)[0]}" for n in range(1, size + 1) if node_pid(settings, n) is not None]

    with Ticker(f"waiting for Kafka nodes {sorted(nodes)} to join the cluster at {servers}", say=_say):
        while not all(nodes <= live_brokers(server, 3.0) for server in each_running()):
            gone = [n for n in sorted(nodes) if node_pid(settings, n) is None]
            if gone or time.monotonic() - started > timeout:
                node = (gone or sorted(nodes))[0]
                what = "exited" if gone else f"has not joined within {timeout:.0f}s"
                log = node_dir(settings, node) / "broker.log"
                raise ServicesError(f"Kafka node {node} {what}. Last lines of {log}:\n{kafka_jvm.log_tail(log)}")
            time.sleep(0.5)
    return time.monotonic() - started


def up(settings: Settings, size: int) -> None:
    """Start every node of a ``size``-node cluster that does not run yet; return once all have joined."""
    if size < 2:
        raise ValueError("a cluster has two nodes or more; the single broker is rlpulse.services.up")
    host, base = kafka_jvm.host_port(settings.kafka_bootstrap)
    formed = formed_size(settings)
    kdir = kafka_jvm.kafka_dir(settings)
    if formed and formed != size:
        raise ServicesError(f"the cluster under {kdir} was formed with {formed} nodes, not {size}: start it with "
                            f"--brokers {formed}, or remove {kdir}/node-* (its data) to form another")
    if kafka_jvm.broker_pid(settings) is not None:
        raise ServicesError(f"the single broker rlpulse started from {envvars.HOME}={settings.home} runs on "
                            f"{host}:{base}: `rlpulse services down` first")
    if host not in kafka_jvm.LOCAL_HOSTS:
        raise ServicesError(f"{envvars.KAFKA_BOOTSTRAP} is {settings.kafka_bootstrap}: "
                            "`services up` only starts brokers on this machine (e.g. 127.0.0.1:9092)")
    missing = [n for n in range(1, size + 1) if node_pid(settings, n) is None]
    for node in missing:
        for port in ports(base, node):
            if kafka_jvm.port_open(host, port):
                raise ServicesError(f"{host}:{port} (Kafka node {node}) is already in use by a process not started "
                                    f"by rlpulse ({envvars.HOME}={settings.home}). Stop it, or pick another first "
                                    f"port with {envvars.KAFKA_BOOTSTRAP} (the nodes take it and the next "
                                    f"{2 * size - 1})")
    kafka_jvm.private_kafka_dir(settings)
    for node in missing:
        (node_dir(settings, node) / "broker.pid").unlink(missing_ok=True)  # stale: that process is gone
        _say(f"started Kafka node {node} (pid {start_node(settings, node, size)}) on {host}:{ports(base, node)[0]}")
    waited = wait_brokers(settings, size, set(range(1, size + 1)))
    servers = bootstrap(host, base, size)
    factor, min_isr = replication(size)
    _say(f"Kafka {kafka_jvm.KAFKA_VERSION} cluster of {size} up in {waited:.1f}s (logs: {kdir}/node-*/broker.log); "
         f"replication factor {factor}, min.insync.replicas {min_isr}")
    kafka_jvm.record_address(settings, servers)  # bare commands with this home find the cluster
    _say(f"bootstrap: {servers} (recorded in this home; elsewhere: export {envvars.KAFKA_BOOTSTRAP}={servers})")


def kill_node(settings: Settings, node: int, sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to node ``node`` (a crash, for the fault tests); its pid."""
    pid = node_pid(settings, node)
    if pid is None:
        raise ServicesError(f"Kafka node {node} of the cluster under {kafka_jvm.kafka_dir(settings)} is not running")
    os.kill(pid, sig)
    while sig == signal.SIGKILL and kafka_jvm.pid_alive(pid):
        time.sleep(0.05)
    return pid


def down(settings: Settings) -> None:
    """Stop every node of this home's cluster: SIGTERM to all at once, SIGKILL to any still up
    after kafka_jvm.STOP_TIMEOUT (the last nodes may find no quorum to shut down cleanly with)."""
    pids = {n: node_pid(settings, n) for n in range(1, formed_size(settings) + 1)}
    live = {n: pid for n, pid in pids.items() if pid is not None}
    kafka_jvm.forget_address(settings)
    for n in pids:
        if n not in live:
            (node_dir(settings, n) / "broker.pid").unlink(missing_ok=True)
    if not live:
        _say(f"no Kafka node started by rlpulse is running ({envvars.HOME}={settings.home})")
        return
    started = time.monotonic()
    for pid in live.values():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    killed = []
    for node, pid in live.items():
        while kafka_jvm.pid_alive(pid) and time.monotonic() - started < kafka_jvm.STOP_TIMEOUT:
            time.sleep(0.2)
        if kafka_jvm.pid_alive(pid):
            killed.append(node)
            kafka_jvm.stop(pid)  # SIGTERM again, then SIGKILL
        (node_dir(settings, node) / "broker.pid").unlink(missing_ok=True)
    how = f"; killed {killed} (they ignored SIGTERM)" if killed else ""
    _say(f"Kafka nodes {sorted(live)} stopped in {time.monotonic() - started:.1f}s{how}")


def status(settings: Settings) -> bool:
    """Print each node and what the cluster's metadata lists; True if every node runs and is listed."""
    host, base = kafka_jvm.host_port(settings.kafka_bootstrap)
    size = formed_size(settings)
    _say(f"rlpulse home: {settings.home} ({envvars.HOME} overrides it)")
    _say(kafka_jvm.address_line(settings))
    _say(f"Kafka cluster of {size} nodes formed under {kafka_jvm.kafka_dir(settings)}")
    servers = bootstrap(host, base, size)
    listed = live_brokers(servers, 3.0)
    for node in range(1, size + 1):
        pid = node_pid(settings, node)
        state = f"running (pid {pid})" if pid is not None else "not running"
        member = "listed in the metadata" if node in listed else "not listed in the metadata"
        _say(f"node {node} on {host}:{ports(base, node)[0]}: {state}, {member} "
             f"(log: {node_dir(settings, node) / 'broker.log'})")
    _say(f"bootstrap: {servers}")
    healthy = len(listed) == size and len(running(settings)) == size
    if not healthy:
        _say("start the nodes not running with `rlpulse services up`")
    return healthy
