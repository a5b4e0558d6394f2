"""A Kafka JVM started by `rlpulse services up` (broker, storage tool, SCRAM admin tool) gets an
allowlist of the user's environment, never the passwords and tokens a shell may hold (a
broker has no use for them and would keep them for its lifetime). The started broker's /proc environ
is checked in test_services.py."""

from __future__ import annotations

from rlpulse.kafka_jvm import JVM_ENV_ALLOWED, jvm_env


def test_only_the_allowlisted_names_pass() -> None:
    shell = {
        "PATH": "/usr/bin",
        "JAVA_HOME": "/usr/lib/jvm/java-17",
        "LANG": "C.UTF-8",
        "RLPULSE_KAFKA_SASL_PASSWORD": "hunter2",
        "RLPULSE_CLICKHOUSE_URL": "http://u:pw@h:8123/rlpulse",
        "AWS_SECRET_ACCESS_KEY": "k",
        "HF_TOKEN": "t",
        "COLUMNS": "80",  # the storage tool chokes on it
        "LD_PRELOAD": "/tmp/x.so",
        "KAFKA_OPTS": "-javaagent:/tmp/agent.jar",
    }
    assert jvm_env(shell) == {"PATH": "/usr/bin", "JAVA_HOME": "/usr/lib/jvm/java-17", "LANG": "C.UTF-8"}


def test_the_allowlist_holds_nothing_secret_or_injectable() -> None:
    assert "PATH" in JVM_ENV_ALLOWED
    assert not [n for n in JVM_ENV_ALLOWED if n.startswith(("RLPULSE_", "KAFKA_", "LD_", "AWS_")) or "PASS" in n]
