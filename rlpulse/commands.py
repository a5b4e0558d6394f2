"""What each ``rlpulse`` subcommand does: one function per command, given the parsed arguments.

``rlpulse.cli`` builds the parser and maps failures to one-line messages; these functions only wire
settings to the modules that do the work (producers/, streams/, sinks/).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import sys

from rlpulse.base import env as envvars
from rlpulse.base.settings import Settings


def settings_of(args: argparse.Namespace) -> Settings:
    return Settings.load(
        kafka_bootstrap=args.kafka_bootstrap, clickhouse_url=args.clickhouse_url, topic_prefix=args.topic_prefix
    )


def bound_batches(settings: Settings) -> None:
    """Bound what this process's Kafka consumers decompress (``rlpulse.schemas.compression``): a
    record batch over it, or of a codec not accepted, becomes a dead letter instead of a crash."""
    from rlpulse.schemas.compression import install

    install(settings.kafka_batch_max_bytes, settings.kafka_batch_max_ratio, settings.kafka_batch_codecs)


def cmd_services(args: argparse.Namespace) -> int:
    from rlpulse import services

    return services.main(settings_of(args), args.action, args.brokers)


def cmd_streams(args: argparse.Namespace) -> int:
    from rlpulse.streams.app import run_worker

    settings = settings_of(args)
    bound_batches(settings)
    run_worker(settings, loglevel="DEBUG" if args.verbose else "INFO")
    return 0


def cmd_sink(args: argparse.Namespace) -> int:
    import asyncio

    from rlpulse.schemas.topics import ensure_topics
    from rlpulse.sinks.store.clickhouse import migrate, open_store
    from rlpulse.sinks.read.read_endpoint import serve_reads
    from rlpulse.sinks.write.sink import serve

    settings = settings_of(args)
    bound_batches(settings)
    ensure_topics(settings)
    with open_store(settings.clickhouse_dsn, owner="rlpulse sink") as store:
        migrate(store, settings.ttl_raw_days, settings.ttl_aggregate_days, cluster=settings.clickhouse_cluster)
        with serve_reads(store, port=args.read_port):  # a chDB store: read-only queries on loopback meanwhile
            asyncio.run(serve(settings, store, batch_rows=args.batch_rows, flush_interval=args.flush_interval))
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from rlpulse.sinks.store.clickhouse import migrate, open_store

    settings = settings_of(args)
    cluster = settings.clickhouse_cluster
    if args.kafka_engine:
        from rlpulse.sinks.store.kafka_engine import refuse_chdb

        refuse_chdb(settings.clickhouse_dsn)
    with open_store(settings.clickhouse_dsn, owner="rlpulse migrate") as store:
        applied = migrate(store, settings.ttl_raw_days, settings.ttl_aggregate_days, cluster=cluster)
        where = f"database {store.database}" + (f" on cluster {cluster}" if cluster else "")
        print(f"{store.url}: {where}: " + (f"applied {', '.join(applied)}" if applied else "up to date"))
        if args.kafka_engine:
            from rlpulse.sinks.store import kafka_engine
            from rlpulse.sinks.store.clickhouse import table_columns

            engine = kafka_engine.KafkaEngine(args.kafka_engine_brokers or settings.kafka_bootstrap, settings.topic_prefix,
                                              args.kafka_engine_consumers)
            for statement in kafka_engine.statements(store.database, table_columns(store), engine, cluster,
                                                     settings.ttl_raw_days):
                store.client.command(statement)
            print(f"Kafka engine: {', '.join(settings.topic(t) for t in kafka_engine.RAW_TOPICS)} load into "
                  f"{store.database} in group {engine.group} from {engine.broker_list}; errors in "
                  f"{store.database}.{kafka_engine.ERRORS_TABLE}. Run the sinks with {envvars.SINK_RAW}=0")
    return 0


def cmd_query(args: argparse.Namespace) -> int:
    from rlpulse.sinks.read import queries
    from rlpulse.sinks.store.clickhouse import open_reader

    if args.list:
        if args.sql or args.saved:
            raise ValueError("--list takes no SQL and no --saved")
        sys.stdout.write(saved_listing(queries.list_saved(), shutil.get_terminal_size().columns))
        return 0
    if bool(args.sql) == bool(args.saved):
        raise ValueError("give either SQL or --saved NAME (or --list)")
    params = queries.parse_params(args.param)
    if args.saved:
        queries.load_saved(args.saved)  # an unknown name fails before opening the store
    settings = settings_of(args)
    # This process's own store and client, used for the read-only query only (readonly=1 sticks to it).
    with open_reader(settings.clickhouse_dsn, owner="rlpulse query") as store:
        sql = queries.saved_sql(args.saved, params, store.database) if args.saved else args.sql
        try:
            columns, rows = queries.run_query(store.client, sql, params)
        except queries.ReadOnlyError as exc:
            print(f"rlpulse query: {exc}", file=sys.stderr)
            return 1
        except queries.QueryError as exc:
            if exc.code == "UNKNOWN_DATABASE":
                from rlpulse.sinks.store.clickhouse import require_database

                require_database(store)  # an empty store: say so, and what fills it
            print(f"rlpulse query: ClickHouse refused the query: {exc}", file=sys.stderr)
            return 1
    sys.stdout.write(queries.render(columns, rows, args.format))
    return 0


def saved_listing(saved: dict[str, str], columns: int) -> str:
    """``rlpulse query --list``: each saved query's name, then its whole description and parameters
    wrapped to ``columns`` (the terminal's width) under a hanging indent, never cut mid-sentence."""
    import textwrap

    from rlpulse.sinks.read import queries

    width = max((len(n) for n in saved), default=0)
    text_width = max(columns - width - 2, 30)  # a narrow terminal still gets readable lines
    out = []
    for name, about in saved.items():
        params = queries.placeholders(queries.load_saved(name))
        takes = ("(--param " + ", ".join(f"{n}: {t}" for n, t in params.items()) + ")") if params else ""
        lines = textwrap.wrap(f"{about} {takes}".strip(), text_width, break_on_hyphens=False) or [""]
        out.append(f"{name.ljust(width)}  {lines[0]}\n" + "".join(f"{'':{width}}  {line}\n" for line in lines[1:]))
    return "".join(out)


def _say(line: str) -> None:
    print(line, flush=True)


def cmd_simulate(args: argparse.Namespace) -> int:
    import json

    from rlpulse.producers.simulators.simulator import SimConfig, simulate
    from rlpulse.schemas.topics import ensure_topics

    settings = settings_of(args)
    ensure_topics(settings)
    config = SimConfig(project=args.project, runs=args.runs, steps=args.steps, rollouts_per_step=args.rollouts,
                       terms=tuple(args.terms.split(",")), failure_rate=args.failure_rate, clip_rate=args.clip_rate,
                       seed=args.seed, stall_s=args.stall_s, silent_run=args.silent_run, gpu=args.gpu)
    truth = simulate(settings, config, progress=_say)  # flushed: a pipe (tee, a test) sees each run as it ends
    if args.ground_truth:
        with open(args.ground_truth, "w") as f:
            json.dump(truth.as_dict(), f, indent=2, sort_keys=True)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from rlpulse.demo import run_demo

    return run_demo(settings_of(args))


def cmd_status(args: argparse.Namespace) -> int:
    from rlpulse.status import print_status

    return print_status(settings_of(args), detail=args.detail or args.verbose)


def cmd_dlq(args: argparse.Namespace) -> int:
    import asyncio

    from rlpulse.schemas.catalogue import DLQ_TOPIC
    from rlpulse.sinks.write.dlq import LEDGER_TOPIC, read_dead_letters, replay_dead_letters
    from rlpulse.base.terminal import print_table

    settings = settings_of(args)
    bound_batches(settings)
    if args.action == "replay":
        report = asyncio.run(replay_dead_letters(settings, args.topic, args.reason, args.dry_run))
        print_table(["source", "to", "reason"], [(r["source"], r["to"], r["reason"]) for r in report.replayed])
        print(f"{'would replay' if args.dry_run else 'replayed'} {len(report.replayed)} dead letters; skipped "
              f"{report.already} replayed before, {report.filtered} not matching the filters, "
              f"{report.unroutable} without a source topic, {report.truncated} kept truncated (too big to replay), "
              f"{report.foreign} naming a topic that is not the pipeline's, "
              f"{report.refused} the container decoder still refuses")
        return 0
    letters = asyncio.run(read_dead_letters(settings.kafka_client_kwargs(), settings.topic(DLQ_TOPIC), args.limit,
                                            settings.topic(LEDGER_TOPIC)))
    print_table(["source", "bytes", "replayed to", "reason"],
                [(d["source"], d["bytes"], d["replayed"], d["reason"]) for d in letters])
    print(f"{len(letters)} dead letters on {settings.topic(DLQ_TOPIC)}")
    return 0


def cmd_alerts(args: argparse.Namespace) -> int:
    import asyncio

    from rlpulse.sinks.alerts.alert_feed import serve_alerts

    from rlpulse.base.settings import parse_duration

    settings = settings_of(args)
    bound_batches(settings)
    # The URL carries its token (Slack, Teams): from the environment it stays out of `ps`.
    webhook = args.webhook or os.environ.get(envvars.ALERTS_WEBHOOK) or None
    asyncio.run(serve_alerts(settings, webhook, args.from_beginning, args.once, group=args.group,
                             give_up_after_s=parse_duration(args.give_up_after), timeout_s=parse_duration(args.webhook_timeout)))
    return 0


def cmd_gpu_poller(args: argparse.Namespace) -> int:
    from rlpulse.producers.pollers.gpu_poller import main as poll
    from rlpulse.base.settings import parse_duration

    indices = [int(i) for i in args.gpus.split(",")] if args.gpus else None
    return poll(settings_of(args), indices=indices, sample_interval=parse_duration(args.sample_interval),
                export_interval=parse_duration(args.export_interval), run_id=args.run_id, attempt=args.attempt,
                role=args.role, rank=args.rank, project=args.project, node=args.node, pod=args.pod)


def cmd_engine_poller(args: argparse.Namespace) -> int:
    from rlpulse.producers.pollers.engine_poller import main as poll
    from rlpulse.base.settings import parse_duration

    return poll(settings_of(args), args.metrics_urls, run_id=args.run_id, attempt=args.attempt, project=args.project,
                pod=args.pod, interval_s=parse_duration(args.interval), timeout_s=parse_duration(args.timeout),
                max_bytes=args.max_bytes)


def cmd_capacity(args: argparse.Namespace) -> int:
    from rlpulse.sinks.views.capacity import capacity_tables, render_capacity
    from rlpulse.sinks.store.clickhouse import open_reader

    settings = settings_of(args)
    with open_reader(settings.clickhouse_dsn, owner="rlpulse capacity") as store:
        pools, projects = capacity_tables(store)
    sys.stdout.write(render_capacity(pools, projects))
    return 0


def cmd_retention(args: argparse.Namespace) -> int:
    from rlpulse.sinks.views.retention_report import change_retention, show_retention

    if args.action == "show":
        if args.table is not None or args.days is not None:
            raise ValueError("show takes only --project; change retention with: rlpulse retention set --table T --days N")
        show_retention(settings_of(args), args.project)
        return 0
    if args.table is None:
        raise ValueError(f"{args.action} needs --table")
    if (args.action == "set") != (args.days is not None):
        raise ValueError("set needs --days N; clear takes no --days")
    change_retention(settings_of(args), args.table, args.days, args.project)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from rlpulse.sinks.store.clickhouse import open_reader
    from rlpulse.sinks.views.report import print_report

    if bool(args.html) != bool(args.run):
        raise ValueError("RUN and --html go together: rlpulse report RUN --html out.html")
    if not args.html and (args.step is not None or args.sample is not None):
        raise ValueError("--step and --sample choose the trajectories of the HTML page: "
                         "rlpulse report RUN --html out.html --step N --sample ID")
    if args.step is not None and args.step < 0:
        raise ValueError(f"--step must be 0 or more, got {args.step}")
    settings = settings_of(args)
    with open_reader(settings.clickhouse_dsn, owner="rlpulse report") as store:
        _require_rows(store, args.run if args.html else None, args.project)
        if args.html:
            from rlpulse.sinks.views.html_report import write_report

            out = write_report(store, args.run, args.html, attempt=args.attempt, step=args.step, sample=args.sample)
            print(f"wrote {out}")
        else:
            print_report(store, project=args.project)
    return 0


def _require_rows(store, run: str | None, project: str | None) -> None:
    """NoDataError, naming what there is instead, when the store is empty or has no rows of ``run``/``project``."""
    from rlpulse.sinks.store.clickhouse import NoDataError, no_data, require_database
    from rlpulse.sinks.views.html_report import latest_attempt
    from rlpulse.sinks.views.report import has_rows, latest_names, stored_rows

    from rlpulse.base.terminal import terminal_safe

    def latest(column: str) -> str:  # names anyone could have sent: a newline in one would forge a line
        return ", ".join(terminal_safe(name) for name in latest_names(store, column))

    require_database(store)
    if not stored_rows(store):
        raise no_data(store, "its tables are empty")
    if run is not None and latest_attempt(store, run) is None:
        raise NoDataError(f"no rows name run {run!r} in {store.url}. Latest runs: {latest('run_id')}")
    if project is not None and not has_rows(store, "project", project):
        raise NoDataError(f"no rows of project {project!r} in {store.url}. Latest projects: {latest('project')}")


def cmd_export(args: argparse.Namespace) -> int:
    from rlpulse.sinks.store.clickhouse import open_reader
    from rlpulse.sinks.views.export import Filters, Shape, export_to

    filters = Filters(project=args.project, run_id=args.run_id, min_step=args.min_step, max_step=args.max_step,
                      sample_id=args.sample_id, min_reward=args.min_reward, status=args.status)
    shape = Shape(per_call=args.per_call, reward_to=args.reward_to, include_grader_calls=args.include_grader_calls)
    if shape.per_call and args.what != "messages":
        raise ValueError("--per-call shapes messages (triplets are one row per call already)")
    filters.check()  # bad arguments fail before the store is opened
    shape.check()
    settings = settings_of(args)
    with open_reader(settings.clickhouse_dsn, owner="rlpulse export") as store:
        # As `report`: a run or project the store has no rows of is an error (exit 1, naming it and the latest
        # ones), checked before the file is opened, so no empty file is left to be taken for an export.
        _require_rows(store, args.run_id, args.project)
        done = export_to(store, args.what, args.output, args.format, filters, args.page_size, shape)
    # stderr: the output may be stdout
    print(f"rlpulse export: {done.rows} {args.what} rows of {done.trajectories} trajectories to {args.output} "
          f"({done.without_calls} selected trajectories had no LLM call; {done.pages} pages)", file=sys.stderr)
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    from rlpulse.sinks.store.clickhouse import open_reader
    from rlpulse.sinks.views.watch import watch

    from rlpulse.base.settings import parse_duration

    interval = parse_duration(args.interval)
    if interval <= 0:
        raise ValueError(f"--interval must be above 0, got {args.interval}")
    if not args.verbose:  # the driver's retry warnings would scroll through the live view
        for name in ("urllib3", "clickhouse_connect"):
            logging.getLogger(name).setLevel(logging.ERROR)
    settings = settings_of(args)
    return watch(settings.clickhouse_dsn, lambda dsn: open_reader(dsn, owner="rlpulse watch"), interval,
                 project=args.project, show_all=args.all, once=args.once, metrics=tuple(args.metric))


def cmd_ui(args: argparse.Namespace) -> int:
    from rlpulse.base.urls import mask_url
    from rlpulse.sinks.store.clickhouse import open_reader
    from rlpulse.sinks.views.ui_server import UiServer

    if not args.verbose:  # a page that cannot read says why itself; the driver's retries would fill the terminal
        for name in ("urllib3", "clickhouse_connect"):
            logging.getLogger(name).setLevel(logging.ERROR)
    dsn = settings_of(args).clickhouse_dsn
    for name in args.allow_host:  # a Host header names a host, no port, path or user: anything else is a typo
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]", name):
            raise ValueError(f"--allow-host {name[:80]!r} is not a host name or address (letters, digits, '.', '-', "
                             "'_'; an IPv6 address in [brackets]; no port)")
    try:  # a token from the environment stays out of `ps` and lets a script open the page
        server = UiServer(lambda: open_reader(dsn, owner="rlpulse ui"), mask_url(dsn), host=args.host, port=args.port,
                          token=os.environ.get(envvars.UI_TOKEN) or None, allowed_hosts=args.allow_host)
    except OSError as exc:
        raise RuntimeError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}; "
                           "choose another port with --port (0: any free one)") from None
    print(f"rlpulse ui: read-only pages of {mask_url(dsn)}", flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"rlpulse ui: listening on {args.host}, not loopback only: anyone who can reach it and has the token "
              "can read every run", flush=True)
    print(f"  open {server.token_url}\n  (Ctrl-C stops it)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # Ctrl-C is how a page server is stopped: not a failure
        pass
    finally:
        server.close()
    return 0


def bench_options():
    """bench/options.py of this checkout, loaded by path (bench/ is not an installed package); None without it."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "options.py"
    spec = importlib.util.spec_from_file_location("rlpulse_bench_options", path)
    if not path.exists() or spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cmd_bench(args: argparse.Namespace) -> int:
    """What `make bench` runs: the local broker up unless a broker already answers or the settings
    ask for TLS or SASL, then bench/run.py with this interpreter and these settings."""
    import subprocess
    from pathlib import Path

    from rlpulse import services
    from rlpulse.pipeline import settings_env

    root = Path(__file__).resolve().parents[1]
    options = bench_options()
    if options is None:
        raise RuntimeError(f"rlpulse bench runs from a source checkout: no bench/ beside {root / 'rlpulse'}")
    settings = settings_of(args)
    bootstrap, protocol = settings.kafka_bootstrap, settings.kafka_security_protocol
    if protocol != "PLAINTEXT":
        # `services up` starts a PLAINTEXT broker only: a secured bootstrap is someone's broker, used as it is
        print(f"rlpulse bench: measuring the broker at {bootstrap} over {protocol} as it is "
              "(not running `services up`, which starts a local PLAINTEXT broker only)", flush=True)
    elif services.broker_answers(bootstrap, 5.0):
        print(f"rlpulse bench: a Kafka broker answers at {bootstrap}: measuring it (not running `services up`)", flush=True)
    elif services.main(settings, "up") != 0:
        return 1
    if getattr(args, "output", None):  # the child runs in the checkout: a relative folder means the caller's
        args.output = str(Path(args.output).resolve())
    return subprocess.call([sys.executable, str(root / "bench" / "run.py"), *options.to_argv(args)],
                           env=settings_env(settings), cwd=root)
