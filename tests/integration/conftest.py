"""Backends for the integration tests: the same test bodies run against

* ``local``: the Kafka broker from the jars (``rlpulse services up``; ``make test`` starts it)
  and the ClickHouse engine in-process through chDB, a fresh store per test;
* ``containers``: Kafka and ClickHouse server containers from testcontainers, where a Docker
  engine answers (skipped with that reason where none does).

``--backend`` (``tests/conftest.py``) chooses: ``local`` by default, so a normal run has no
containers variants to skip; ``make test-containers`` runs with ``--backend=containers``, which
keeps the tests that take a backend and those marked ``containers`` (they need a Docker engine
of their own, whatever the backend); ``--backend=all`` runs both.

Every test gets its own topic prefix, so tests share a broker without seeing each other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import shutil
import socket
import uuid
import warnings
from pathlib import Path
from collections.abc import Callable, Iterator

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from rlpulse import cluster, services
from rlpulse.kafka_jvm import ServicesError
from rlpulse.pipeline import rewind
from rlpulse.base.settings import Settings
from rlpulse.schemas.catalogue import SINK_TOPICS
from tests.conftest import backends

# Every topic prefix handed out this session: the shared broker gets its topics back at the end.
# A broker that kept them held 4,681 topics after a few runs, and every client's metadata fetch
# (each carries every topic) slowed with them: the sink's start-up by a second.
PREFIXES: list[str] = []


def _docker_answers() -> str | None:
    """None when a Docker engine answers, else why not."""
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return None
    except Exception as exc:  # no socket, no daemon, no permission
        return f"no Docker engine answers ({type(exc).__name__}); the testcontainers backend needs one"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Each test that takes ``backend`` runs once per backend ``--backend`` asks for (a test marked
    ``containers`` only on the containers backend)."""
    if "backend" not in metafunc.fixturenames:
        return
    chosen = backends(metafunc.config)
    if metafunc.definition.get_closest_marker("containers"):
        chosen = ("containers",)  # deselected below unless --backend asks for it
    metafunc.parametrize("backend", chosen, indirect=True, scope="session")


@pytest.fixture(scope="session")
def backend(request) -> Iterator[dict[str, str]]:
    """Connection settings of one backend: kafka_bootstrap and clickhouse_url ('' = chDB per test)."""
    if request.param == "local":
        base = Settings.load()
        if not services.broker_answers(base.kafka_bootstrap, 10.0):
            pytest.fail(f"no Kafka broker answers at {base.kafka_bootstrap}: run `rlpulse services up` (make test does)")
        yield {"name": "local", "kafka_bootstrap": base.kafka_bootstrap, "clickhouse_url": ""}
        asyncio.run(_delete_topics(base, tuple(PREFIXES)))
        return
    reason = _docker_answers()
    if reason:
        pytest.skip(reason)
    from testcontainers.community.clickhouse import ClickHouseContainer
    from testcontainers.community.kafka import KafkaContainer

    # cp-kafka 7.9 is Apache Kafka 3.9.
    with KafkaContainer("confluentinc/cp-kafka:7.9.0").with_kraft() as kafka, ClickHouseContainer(
        "clickhouse/clickhouse-server:25.8", username="rlpulse", password="rlpulse", dbname="default"
    ).with_exposed_ports(8123) as ch:
        url = f"http://rlpulse:rlpulse@{ch.get_container_host_ip()}:{ch.get_exposed_port(8123)}/rlpulse_{uuid.uuid4().hex[:8]}"
        yield {"name": "containers", "kafka_bootstrap": kafka.get_bootstrap_server(), "clickhouse_url": url}


async def _delete_topics(settings: Settings, prefixes: tuple[str, ...]) -> None:
    """Delete the topics (Faust's changelogs too) of the prefixes this session handed out."""
    if not prefixes:
        return
    admin = AIOKafkaAdminClient(**settings.kafka_client_kwargs())
    await admin.start()
    try:
        ours = [t for t in await admin.list_topics() if t.startswith(prefixes)]
        for i in range(0, len(ours), 200):
            await admin.delete_topics(ours[i:i + 200])
    finally:
        await admin.close()


def fresh_settings(backend: dict[str, str], home: Path) -> Settings:
    """Fresh topics (by prefix), a fresh store under ``home``, short windows."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    PREFIXES.append(prefix)
    clickhouse_url = backend["clickhouse_url"] or f"chdb://{home / 'clickhouse'}"
    return dataclasses.replace(
        Settings.load(),
        kafka_bootstrap=backend["kafka_bootstrap"],
        clickhouse_url=clickhouse_url,
        topic_prefix=prefix,
        home=home,
        partitions=2,
        window=2.0,
        # generous: a slow CI machine must not turn on-time events late. Tests wait for their rows
        # (tests/integration/until.py), not for this, so it costs them nothing.
        allowed_lateness=5.0,
        heartbeat_interval=3600.0,
    )


@pytest.fixture(scope="module", autouse=True)
def _topics_deleted_after_each_module() -> Iterator[None]:
    """Each module's topics go when it ends, not only when the session does: by 80 % of `make
    test-all` the shared broker held thousands, every client's metadata fetch carried them all, and
    timing-bound tests there failed in CI while passing on a fresh broker."""
    first = len(PREFIXES)
    yield
    ours = tuple(PREFIXES[first:])
    if ours:
        try:
            asyncio.run(_delete_topics(Settings.load(), ours))
        except Exception as exc:  # a broker the module stopped, or the containers backend's: the session end retries
            warnings.warn(f"could not delete this module's topics: {exc}", stacklevel=1)


@pytest.fixture
def settings(backend: dict[str, str], tmp_path: Path) -> Settings:
    """Settings for one test."""
    return fresh_settings(backend, tmp_path)


@pytest.fixture(scope="module")
def module_settings(backend: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """Settings shared by a module's tests: one workload through one pipeline, read by several tests."""
    return fresh_settings(backend, tmp_path_factory.mktemp("module"))


@pytest.fixture
def artifacts_dir(request) -> Path:
    path = Path(os.environ.get("RLPULSE_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
    path = path / request.node.name.replace("/", "_")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def rewind_sink(settings: Settings) -> Callable[[], None]:
    """Commits offset 0 for the sink's group on every topic it reads: the next sink reads it all again."""
    return lambda: rewind(settings, settings.sink_group, SINK_TOPICS)


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (the broker's listener and its controller's), away from 9092
    and test_sdk_broker_down's 19292: two sessions on one machine each get their own."""
    for _ in range(100):
        port = random.randrange(20000, 30000, 2)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two free neighbouring ports in 20000-30000 for a test broker")


class OwnBroker:
    """A Kafka broker of one test's own, which the test may stop and start again; the shared
    broker never is. ``down`` then ``up`` keeps its data directory: topics, messages and
    committed offsets survive, as they would a broker restart in production."""

    def __init__(self, settings: Settings):
        self.settings = settings

    @property
    def bootstrap(self) -> str:
        return self.settings.kafka_bootstrap

    def up(self) -> None:
        services.up(self.settings)

    def down(self) -> None:
        services.down(self.settings)


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[OwnBroker]:
    """A broker on a free port of 127.0.0.1 with its home under ``tmp_path``, started; stopped at the end."""
    if shutil.which("java") is None or shutil.which("mvn") is None:
        pytest.skip("a broker of the test's own needs java and mvn")
    broker = OwnBroker(dataclasses.replace(Settings.load(), kafka_bootstrap=f"127.0.0.1:{_free_port_pair()}",
                                           home=tmp_path / "broker"))
    broker.up()
    try:
        yield broker
    finally:
        broker.down()


def _free_port_run(count: int) -> int:
    """A port p with p .. p + count - 1 all free, in 20000-30000 as ``_free_port_pair``."""
    for _ in range(100):
        port, held = random.randrange(20000, 30000 - count, 2), []
        try:
            for i in range(count):
                held.append(socket.socket())
                held[-1].bind(("127.0.0.1", port + i))
            return port
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no {count} free neighbouring ports in 20000-30000 for a test cluster")


class OwnCluster:
    """A Kafka cluster of one test's own (``rlpulse.cluster``: three KRaft nodes, one quorum),
    whose nodes the test may kill and start again; their data survives, as on a real restart."""

    def __init__(self, settings: Settings, size: int = 3):
        self.settings, self.size = settings, size

    @property
    def bootstrap(self) -> str:
        return self.settings.kafka_bootstrap

    def up(self) -> None:
        cluster.up(self.settings, self.size)

    def kill(self, node: int) -> int:
        """SIGKILL node ``node`` (a crash: no controlled shutdown); its pid."""
        return cluster.kill_node(self.settings, node)

    def start(self, node: int) -> float:
        """Start node ``node`` again; seconds until the cluster's metadata lists it."""
        cluster.start_node(self.settings, node, self.size)
        return cluster.wait_brokers(self.settings, self.size, {node})

    def down(self) -> None:
        cluster.down(self.settings)


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[OwnCluster]:
    """Three Kafka nodes on free ports of 127.0.0.1 with their home under ``tmp_path``, started;
    stopped at the end. The settings' bootstrap names all three."""
    if shutil.which("java") is None or shutil.which("mvn") is None:
        pytest.skip("a Kafka cluster of the test's own needs java and mvn")
    for attempt in (1, 2):
        base = _free_port_run(6)
        own = OwnCluster(dataclasses.replace(Settings.load(), kafka_bootstrap=cluster.bootstrap("127.0.0.1", base, 3),
                                             home=tmp_path / ("cluster" if attempt == 1 else "cluster-2")))
        try:
            own.up()
            break
        except ServicesError as exc:
            own.down()
            if attempt == 2:
                raise
            # Once in a fresh-clone CI run two nodes got a SIGTERM from outside 2 s after they
            # started (sender not found; their logs under tmp_path/cluster say so): form the
            # cluster once more on other ports, and say why. A second failure is the test's error.
            warnings.warn(f"own_cluster: forming the cluster failed, formed another: {str(exc).splitlines()[0]}",
                          stacklevel=1)
    try:
        yield own
    finally:
        own.down()
