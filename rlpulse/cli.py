"""The ``rlpulse`` command line: one subcommand per process of the pipeline."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from rlpulse.settings import Settings


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", dest="kafka_bootstrap", help="Kafka bootstrap servers (RLPULSE_KAFKA_BOOTSTRAP)")
    parser.add_argument("--clickhouse-url", dest="clickhouse_url", help="chdb:///path or http://user:pass@host:8123/db (RLPULSE_CLICKHOUSE_URL)")
    parser.add_argument("--topic-prefix", dest="topic_prefix", help="prefix of every topic name (RLPULSE_TOPIC_PREFIX)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _settings(args: argparse.Namespace) -> Settings:
    return Settings.load(
        kafka_bootstrap=args.kafka_bootstrap, clickhouse_url=args.clickhouse_url, topic_prefix=args.topic_prefix
    )


def cmd_services(args: argparse.Namespace) -> int:
    from rlpulse import services

    return services.main(_settings(args), args.action)


COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlpulse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("services", help="start, stop or inspect the local Kafka broker")
    p.add_argument("action", choices=["up", "down", "status"])
    _add_common(p)
    p.set_defaults(func=cmd_services)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # bad settings or arguments: one clear line, no traceback
        print(f"rlpulse {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
