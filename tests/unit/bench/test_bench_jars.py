"""The jar folder the bench's Kafka tools run from: fetched once per jar set, again when the pom changes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rlpulse import kafka_jvm
from rlpulse.base.settings import Settings


@pytest.fixture
def mvn_calls(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(kafka_jvm.subprocess, "run", fake_run)
    monkeypatch.setattr(kafka_jvm, "require_tools", lambda *tools: None)
    return calls


def test_fetched_once_per_jar_set_and_again_for_a_changed_pom(tmp_path: Path, mvn_calls: list[list[str]],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings.load({}, home=tmp_path)
    libs = kafka_jvm.fetch_jars(settings)
    assert len(mvn_calls) == 1 and f"-DoutputDirectory={libs}" in mvn_calls[0]
    kafka_jvm.fetch_jars(settings)
    assert len(mvn_calls) == 1  # the marker names this jar set: nothing to do

    (libs / ".complete").write_text(kafka_jvm.KAFKA_VERSION + "\n")  # a folder fetched before kafka-tools was added
    kafka_jvm.fetch_jars(settings)
    assert len(mvn_calls) == 2

    changed = tmp_path / "pom.xml"
    changed.write_text(kafka_jvm.POM.read_text().replace("</dependencies>", "<!-- another tool --></dependencies>"))
    monkeypatch.setattr(kafka_jvm, "POM", changed)
    kafka_jvm.fetch_jars(settings)
    assert len(mvn_calls) == 3


def test_the_pom_asks_for_the_broker_and_its_load_tools() -> None:
    pom = kafka_jvm.POM.read_text()
    for artifact in ("kafka_2.13", "kafka-tools", "slf4j-reload4j"):
        assert f"<artifactId>{artifact}</artifactId>" in pom
