"""The settings' flags every ``rlpulse`` command takes (``add_common``), and the Kafka flags a command
that reads ClickHouse only refuses."""

from __future__ import annotations

import argparse

from rlpulse.base import env as envvars


class _NoKafka(argparse.Action):
    """A Kafka flag given to a command that reads ClickHouse only: a usage error (exit 2) that says
    why, under the command's own usage line. Hidden from --help; without it argparse would report
    "unrecognized arguments" under the top-level usage, having taken the flag's value for a
    positional (``query --bootstrap h:1 "SELECT 1"``: ``h:1`` as the SQL)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string}: {parser.prog} reads ClickHouse only and takes no Kafka flags "
                     "(--bootstrap, --topic-prefix)")


def add_common(parser: argparse.ArgumentParser, kafka: bool = True,
                verbose_help: str = "debug logging") -> None:
    """The settings' flags; ``kafka=False`` for a command that reads ClickHouse only (no --bootstrap,
    no --topic-prefix: a flag it would ignore is not offered, and passing one is a usage error)."""
    if kafka:
        parser.add_argument("--bootstrap", dest="kafka_bootstrap", help=f"Kafka bootstrap servers ({envvars.KAFKA_BOOTSTRAP})")
    else:
        parser.add_argument("--bootstrap", "--topic-prefix", dest="kafka_flag", nargs="?", action=_NoKafka,
                            help=argparse.SUPPRESS)
    parser.add_argument(
        "--clickhouse-url",
        dest="clickhouse_url",
        help=f"chdb:///path or http://user:pass@host:8123/db ({envvars.CLICKHOUSE_URL})",
    )
    if kafka:
        parser.add_argument("--topic-prefix", dest="topic_prefix", help=f"prefix of every topic name ({envvars.TOPIC_PREFIX})")
    else:  # Settings.load still takes them: from the environment, unused
        parser.set_defaults(kafka_bootstrap=None, topic_prefix=None)
    parser.add_argument("-v", "--verbose", action="store_true", help=verbose_help)
