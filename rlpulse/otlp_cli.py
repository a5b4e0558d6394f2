"""The ``rlpulse otlp`` and ``rlpulse otlp-ingest`` subcommands: OpenTelemetry in."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from rlpulse.base import env as envvars


def add(sub: Any, add_common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register the subcommands on ``sub`` (the CLI's subparsers)."""
    p = sub.add_parser(
        "otlp-ingest",
        help="turn the OTLP topics (the Collector's kafka exporter, `rlpulse otlp`) into rlpulse's records",
        description="Reads <prefix>.otlp-spans and <prefix>.otlp-metrics, translates each OTLP request "
                    "(spans with GenAI or OpenInference attributes; seed 001's metrics) into rlpulse's records and "
                    "publishes them; a request that cannot be used goes to the dead-letter topic with the reason.")
    add_common(p)
    p.set_defaults(func=cmd_otlp_ingest)

    p = sub.add_parser(
        "otlp",
        help="OTLP/HTTP receiver (/v1/traces, /v1/metrics) writing to the OTLP topics",
        description="For a laptop or one box; where the OpenTelemetry Collector runs, use its kafka exporter "
                    f"(deploy/otelcol/). Beyond loopback, clients must send the bearer token in {envvars.OTLP_TOKEN}.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=4318, help="port (default 4318, OTLP/HTTP's)")
    add_common(p)
    p.set_defaults(func=cmd_otlp)


def cmd_otlp_ingest(args: argparse.Namespace) -> int:
    from rlpulse.commands import bound_batches, settings_of
    from rlpulse.producers.otlp.ingest import run_ingest

    settings = settings_of(args)
    bound_batches(settings)  # the Collector's kafka exporter may compress with any codec
    return run_ingest(settings)


def cmd_otlp(args: argparse.Namespace) -> int:
    from rlpulse.commands import settings_of
    from rlpulse.producers.otlp.receiver import run_receiver

    return run_receiver(settings_of(args), args.host, args.port, os.environ.get(envvars.OTLP_TOKEN) or None)
