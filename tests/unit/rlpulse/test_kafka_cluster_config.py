"""The local Kafka cluster's per-node config (rlpulse.cluster) and the topics' replication rule
(rlpulse.schemas.topics): what `rlpulse services up --brokers 3` writes, read back as Kafka would."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rlpulse import cluster
from rlpulse.cli import build_parser
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import replication_for, topic_specs


def _props(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_three_nodes_one_quorum_their_own_ports_and_data(tmp_path: Path) -> None:
    nodes = {n: _props(cluster.node_properties(n, 3, "127.0.0.1", 9092, tmp_path / f"node-{n}" / "data"))
             for n in (1, 2, 3)}
    voters = "1@127.0.0.1:9093,2@127.0.0.1:9095,3@127.0.0.1:9097"
    for n, port in ((1, 9092), (2, 9094), (3, 9096)):
        p = nodes[n]
        assert p["node.id"] == str(n)
        assert p["process.roles"] == "broker,controller"
        assert p["controller.quorum.voters"] == voters  # the same quorum on every node
        assert p["listeners"] == f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{port + 1}"
        assert p["advertised.listeners"] == f"PLAINTEXT://127.0.0.1:{port}"
        assert p["log.dirs"] == str(tmp_path / f"node-{n}" / "data")
        assert {k: p[k] for k in ("default.replication.factor", "min.insync.replicas", "offsets.topic.replication.factor",
                                  "transaction.state.log.replication.factor", "transaction.state.log.min.isr",
                                  "unclean.leader.election.enable")} == {
            "default.replication.factor": "3", "min.insync.replicas": "2", "offsets.topic.replication.factor": "3",
            "transaction.state.log.replication.factor": "3", "transaction.state.log.min.isr": "2",
            "unclean.leader.election.enable": "false"}
    assert cluster.bootstrap("127.0.0.1", 9092, 3) == "127.0.0.1:9092,127.0.0.1:9094,127.0.0.1:9096"
    assert cluster.ports(27100, 3) == (27104, 27105)


def test_replication_follows_the_brokers() -> None:
    assert [replication_for(n) for n in (1, 2, 3, 5)] == [(1, 1), (2, 1), (3, 2), (3, 2)]
    five = _props(cluster.node_properties(4, 5, "127.0.0.1", 9092, Path("/d")))
    assert (five["default.replication.factor"], five["min.insync.replicas"]) == ("3", "2")
    assert five["controller.quorum.voters"].count("@") == 5


def test_every_topic_of_the_pipeline_gets_three_copies_on_three_brokers() -> None:
    settings = dataclasses.replace(Settings(), topic_prefix="p")
    specs = topic_specs(settings, brokers=3)
    names = {s.name for s in specs}
    # Faust's changelogs and leader topic, the ticks and the dead letters too: none is left to Faust or the broker
    assert {"p.spans", "p.steps", "p.ticks", "p.dlq", f"{settings.app_id}-runs-changelog",
            f"{settings.app_id}-__assignor-__leader"} <= names
    assert {(s.replication_factor, s.topic_configs.get("min.insync.replicas")) for s in specs} == {(3, "2")}
    assert {(s.replication_factor, s.topic_configs.get("min.insync.replicas")) for s in topic_specs(settings)} == {(1, None)}


def test_brokers_flag() -> None:
    parser = build_parser()
    assert parser.parse_args(["services", "up", "--brokers", "3"]).brokers == 3
    assert parser.parse_args(["services", "up"]).brokers is None
    with pytest.raises(SystemExit):
        parser.parse_args(["services", "up", "--brokers", "2"])  # an even quorum survives no more failures than one node less
