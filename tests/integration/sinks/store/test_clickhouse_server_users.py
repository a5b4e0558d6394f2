"""The compose stack's ClickHouse users on a real server (testcontainers; skipped where no Docker engine answers).

The server gets deploy/clickhouse/users.d/rlpulse.xml and config.d/rlpulse.xml as docker-compose.yml
mounts them. The sink user runs every migration and the sink's kind of INSERT (input(), a dedup
token setting); the reader can SELECT (with the max_execution_time Grafana's plugin sends) and
nothing else; the image's passwordless admin does not answer from outside the container.
(tests/unit/sinks/store/test_clickhouse_users.py checks the same grants in chDB, without Docker.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from rlpulse.sinks.store.clickhouse import MIGRATIONS, migrate, open_store
from tests.clickhouse_users import CONFIG_FILE, READER, SINK, USERS_FILE
from tests.integration.conftest import _docker_answers

pytestmark = [pytest.mark.integration, pytest.mark.containers]  # make test-containers runs it
SINK_PASSWORD, READER_PASSWORD = "sink-test-pw", "reader-test-pw"
STEPS = "project String, run_id String, step Int64, time_ns Int64"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """host:port of a ClickHouse server with the compose stack's users."""
    reason = _docker_answers()
    if reason:
        pytest.skip(reason)
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.wait_strategies import HttpWaitStrategy

    container = (DockerContainer("clickhouse/clickhouse-server:25.8").with_exposed_ports(8123)
                 .with_env("RLPULSE_SINK_PASSWORD", SINK_PASSWORD).with_env("RLPULSE_READER_PASSWORD", READER_PASSWORD)
                 .with_copy_into_container(USERS_FILE, "/etc/clickhouse-server/users.d/rlpulse.xml")
                 .with_copy_into_container(CONFIG_FILE, "/etc/clickhouse-server/config.d/rlpulse.xml")
                 .waiting_for(HttpWaitStrategy(8123, "/ping")))
    with container as ch:
        yield f"{ch.get_container_host_ip()}:{ch.get_exposed_port(8123)}"


def url(user: str, password: str, server: str) -> str:
    return f"http://{user}:{password}@{server}/rlpulse"


def test_the_sink_user_migrates_and_inserts_as_the_sink_does(server: str) -> None:
    with open_store(url(SINK, SINK_PASSWORD, server), owner="test") as store:
        assert migrate(store) == sorted(p.stem for p in MIGRATIONS.glob("*.sql"))
        assert migrate(store) == []
        # The sink's INSERT on a server: the body read by input(), the dedup token as a setting.
        sql = (f"INSERT INTO rlpulse.steps (project, run_id, step, time_ns) SELECT project, run_id, step, time_ns "
               f"FROM input('{STEPS}') FORMAT CSV")
        store.client.command(sql, data=f'"p","r1",7,{time.time_ns()}\n'.encode(),
                             settings={"insert_deduplication_token": "test-0-0"})
        assert store.client.query("SELECT run_id, step FROM rlpulse.steps").result_rows == [("r1", 7)]
        for denied in ("CREATE TABLE default.x (a Int8) ENGINE = Memory",
                       "ALTER TABLE rlpulse.spans MODIFY TTL toDateTime(end_time) + INTERVAL 1 DAY",
                       "TRUNCATE TABLE rlpulse.steps"):
            with pytest.raises(Exception, match="ACCESS_DENIED"):
                store.client.command(denied)


def test_the_reader_selects_and_cannot_write(server: str) -> None:
    with open_store(url(SINK, SINK_PASSWORD, server), owner="test") as store:
        migrate(store)
    with open_store(url(READER, READER_PASSWORD, server), owner="test") as reader:
        client = reader.client
        assert client.query("SELECT count() FROM rlpulse.spans").result_rows == [(0,)]
        # Grafana's plugin (clickhouse-go) sends max_execution_time with every query.
        assert client.query("SELECT getSetting('readonly')", settings={"max_execution_time": 35}).result_rows == [(1,)]
        with pytest.raises(Exception, match="READONLY"):
            client.query("SELECT 1", settings={"max_threads": 1})
        with pytest.raises(Exception, match="ACCESS_DENIED"):
            client.command("INSERT INTO rlpulse.steps (run_id) VALUES ('x')")
        with pytest.raises(Exception, match="ACCESS_DENIED"):
            client.command("CREATE TABLE rlpulse.x (a Int8) ENGINE = Memory")
        with pytest.raises(Exception, match="ACCESS_DENIED"):
            client.command("DROP TABLE rlpulse.spans")


def test_the_admin_answers_only_inside_the_container(server: str) -> None:
    with pytest.raises(ConnectionError, match="authentication failed"):
        open_store(f"http://default:@{server}/rlpulse", owner="test")
