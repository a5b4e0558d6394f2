"""The compose `cluster` profile (ClickHouse Keeper, two shards, the pipeline in cluster mode) and its
config files under deploy/clickhouse/cluster/.

There is no Docker where this was written, so the profile has not been started: this checks that
the YAML and every XML file it mounts load, and that they agree with one another (hosts, ports,
cluster name, macros, users) and with the single-server users file.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.clickhouse_users import SINK, privileges

REPO = Path(__file__).resolve().parents[3]
CLUSTER_DIR = REPO / "deploy" / "clickhouse" / "cluster"
CLUSTER_SERVICES = {"clickhouse-keeper", "ch-shard1", "ch-shard2", "streams-cluster", "sink-cluster"}


@pytest.fixture(scope="module")
def compose() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def mounts(service: dict) -> dict[str, Path]:
    """Container path -> host file, for the read-only file mounts of a service."""
    out = {}
    for volume in service.get("volumes", []):
        host, container, *_ = volume.split(":")
        if host.startswith("./"):
            out[container] = REPO / host[2:]
    return out


def test_the_profile_holds_keeper_two_shards_and_a_pipeline(compose: dict) -> None:
    services = compose["services"]
    assert {name for name, s in services.items() if "cluster" in s.get("profiles", [])} == CLUSTER_SERVICES
    assert all("profiles" not in services[name] for name in ("kafka", "clickhouse", "streams", "sink", "grafana"))
    for name in ("ch-shard1", "ch-shard2"):
        assert services[name]["image"] == services["clickhouse"]["image"]
        assert services[name]["hostname"] == name
    assert services["clickhouse-keeper"]["image"].startswith("clickhouse/clickhouse-keeper:")
    assert {s["ports"][0] for s in (services["ch-shard1"], services["ch-shard2"])} == {"127.0.0.1:8124:8123",
                                                                                       "127.0.0.1:8125:8123"}
    for name in ("streams-cluster", "sink-cluster"):
        env = services[name]["environment"]
        assert env["RLPULSE_CLICKHOUSE_CLUSTER"] == "rlpulse"
        assert re.fullmatch(r"http://rlpulse_cluster_sink:\$\{RLPULSE_SINK_PASSWORD:-[^}]+\}@ch-shard1:8123/rlpulse",
                            env["RLPULSE_CLICKHOUSE_URL"])
        assert set(services[name]["depends_on"]) == {"kafka", "ch-shard1", "ch-shard2"}
    assert services["sink-cluster"]["command"] == ["sink"] and services["streams-cluster"]["command"] == ["streams"]


def test_every_mounted_file_exists_and_parses(compose: dict) -> None:
    seen = set()
    for name in CLUSTER_SERVICES:
        for _container, host in mounts(compose["services"][name]).items():
            assert host.is_file(), (name, host)
            ET.parse(host)  # raises on malformed XML
            seen.add(host)
    assert {p for p in CLUSTER_DIR.rglob("*.xml")} <= seen  # no config file left unmounted


def test_the_shards_keeper_and_cluster_agree(compose: dict) -> None:
    services = compose["services"]
    cluster = ET.parse(CLUSTER_DIR / "cluster.xml").getroot()
    keeper = ET.parse(CLUSTER_DIR / "keeper.xml").getroot()
    assert cluster.findtext("zookeeper/node/host") == "clickhouse-keeper" == keeper.findtext(
        "keeper_server/raft_configuration/server/hostname")
    assert cluster.findtext("zookeeper/node/port") == keeper.findtext("keeper_server/tcp_port")
    (rlpulse,) = list(cluster.find("remote_servers"))
    assert rlpulse.tag == "rlpulse" and rlpulse.find("secret").get("from_env") == "RLPULSE_CLUSTER_SECRET"
    hosts = [shard.findtext("replica/host") for shard in rlpulse.findall("shard")]
    assert hosts == ["ch-shard1", "ch-shard2"]
    macros = {}
    for host in hosts:
        service = services[host]
        assert "RLPULSE_CLUSTER_SECRET" in service["environment"]
        files = mounts(service)
        assert files["/etc/clickhouse-server/config.d/cluster.xml"] == CLUSTER_DIR / "cluster.xml"
        m = ET.parse(files["/etc/clickhouse-server/config.d/macros.xml"]).getroot()
        macros[host] = (m.findtext("macros/shard"), m.findtext("macros/replica"))
    assert macros == {"ch-shard1": ("01", "ch-shard1"), "ch-shard2": ("02", "ch-shard2")}


def test_the_cluster_sink_has_the_single_server_grants_and_what_cluster_mode_adds(compose: dict) -> None:
    users = ET.parse(CLUSTER_DIR / "users.d" / "rlpulse-cluster.xml").getroot()
    user = users.find("users/rlpulse_cluster_sink")
    assert user.find("password").get("from_env") == "RLPULSE_SINK_PASSWORD"
    granted: dict[str, set[str]] = {}
    for q in user.findall("grants/query"):
        m = re.match(r"GRANT (.+) ON (\S+)$", " ".join(q.text.split()))
        granted.setdefault(m[2], set()).update(p.strip() for p in m[1].split(","))
    assert granted["rlpulse.*"] - privileges(SINK)["rlpulse.*"] == {"CREATE VIEW", "DROP VIEW"}
    assert privileges(SINK)["rlpulse.*"] <= granted["rlpulse.*"]
    assert granted["*.*"] == {"CLUSTER", "KAFKA"}
    profile = users.find(f"profiles/{user.findtext('profile')}")
    assert profile.findtext("distributed_foreground_insert") == "1"
    assert users.findtext("profiles/rlpulse_reader/distributed_product_mode") == "local"
