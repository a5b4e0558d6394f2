"""``rlpulse prometheus``: serve rlpulse's figures for Prometheus to scrape (docs/prometheus.md)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from rlpulse.base import env as envvars

DEFAULT_GRACE = "15m"


def add(sub: argparse._SubParsersAction, add_common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register the subcommand on ``rlpulse``'s parser."""
    p = sub.add_parser(
        "prometheus",
        help="serve the figures in Prometheus's text format on /metrics, read from ClickHouse at each scrape",
        description="Serves seed 001's metrics with the prefix rlpulse in place of akka_optimize_training "
        "(rlpulse_rl_step_count_total, rlpulse_job_placement, hw_power, ...), each computed from ClickHouse at a scrape "
        "(cached 1 s). A run drops out once it ended (RUN_END, or no row for --idle-after) more than --grace ago. "
        f"Off loopback, every request must carry Authorization: Bearer ${envvars.PROMETHEUS_TOKEN}.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; another one needs "
                   f"{envvars.PROMETHEUS_TOKEN})")
    p.add_argument("--port", type=int, default=9464, help="port (default 9464, as OpenTelemetry's Prometheus exporter; "
                   "0: a free one, printed)")
    p.add_argument("--grace", default=None, help=f"serve a run this long after it ended ({envvars.PROMETHEUS_GRACE}, "
                   f"default {DEFAULT_GRACE})")
    p.add_argument("--idle-after", default="1h", help="a run with no event for this long counts as ended (default 1h)")
    p.add_argument("--max-runs", type=int, default=1000, help="serve at most this many runs, newest first; the others "
                   "are counted in rlpulse_prometheus_series_dropped{what=\"runs\"} (default 1000)")
    p.add_argument("--sample-window", default="5m", help="GPU, engine and capacity samples older than this are not "
                   "served (default 5m, Prometheus's lookback)")
    p.add_argument("--query-timeout", default="10s", help="time limit of one scrape's queries (default 10s)")
    add_common(p)
    p.set_defaults(func=cmd)


def cmd(args: argparse.Namespace) -> int:
    from rlpulse.base.settings import parse_duration
    from rlpulse.commands import settings_of
    from rlpulse.sinks.prometheus.collector import Scraper
    from rlpulse.sinks.prometheus.figures import Scope
    from rlpulse.sinks.prometheus.server import PrometheusServer, check_token
    from rlpulse.base.urls import mask_url
    from rlpulse.sinks.store.clickhouse import open_reader

    token = check_token(args.host, os.environ.get(envvars.PROMETHEUS_TOKEN), envvars.PROMETHEUS_TOKEN)
    grace = args.grace if args.grace is not None else os.environ.get(envvars.PROMETHEUS_GRACE) or DEFAULT_GRACE
    scope = Scope(grace_s=parse_duration(grace), idle_after_s=parse_duration(args.idle_after), max_runs=args.max_runs,
                  window_s=parse_duration(args.sample_window), timeout_s=parse_duration(args.query_timeout))
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be from 0 to 65535, got {args.port}")
    dsn = settings_of(args).clickhouse_dsn
    scraper = Scraper(lambda: open_reader(dsn, owner="rlpulse prometheus"), scope)
    try:
        server = PrometheusServer(scraper, host=args.host, port=args.port, token=token)
    except OSError as exc:
        raise RuntimeError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    auth = "bearer token required" if token else "no token (loopback)"
    print(f"rlpulse prometheus: serving {server.url} from {mask_url(dsn)} ({auth})", flush=True)
    server.serve_forever()
    return 0
