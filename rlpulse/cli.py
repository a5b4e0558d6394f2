"""The ``rlpulse`` command line: one subcommand per process of the pipeline."""

from __future__ import annotations

import argparse
import logging
import os
import sys

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


def cmd_streams(args: argparse.Namespace) -> int:
    from streams.app import run_worker

    settings = _settings(args)
    run_worker(settings, loglevel="DEBUG" if args.verbose else "INFO")
    return 0


def cmd_sink(args: argparse.Namespace) -> int:
    import asyncio

    from schemas.topics import ensure_topics
    from sinks.clickhouse import migrate, open_store
    from sinks.read_endpoint import serve_reads
    from sinks.sink import serve

    settings = _settings(args)
    ensure_topics(settings)
    with open_store(settings.clickhouse_dsn, owner="rlpulse sink") as store:
        migrate(store, settings.ttl_raw_days, settings.ttl_aggregate_days, cluster=settings.clickhouse_cluster)
        with serve_reads(store, port=args.read_port):  # a chDB store: read-only queries on loopback meanwhile
            asyncio.run(serve(settings, store, batch_rows=args.batch_rows, flush_interval=args.flush_interval))
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from sinks.clickhouse import migrate, open_store

    settings = _settings(args)
    cluster = settings.clickhouse_cluster
    if args.kafka_engine:
        from sinks.kafka_engine import refuse_chdb

        refuse_chdb(settings.clickhouse_dsn)
    with open_store(settings.clickhouse_dsn, owner="rlpulse migrate") as store:
        applied = migrate(store, settings.ttl_raw_days, settings.ttl_aggregate_days, cluster=cluster)
        where = f"database {store.database}" + (f" on cluster {cluster}" if cluster else "")
        print(f"{store.url}: {where}: " + (f"applied {', '.join(applied)}" if applied else "up to date"))
        if args.kafka_engine:
            from sinks import kafka_engine
            from sinks.clickhouse import table_columns

            engine = kafka_engine.KafkaEngine(args.kafka_engine_brokers or settings.kafka_bootstrap, settings.topic_prefix,
                                              args.kafka_engine_consumers)
            for statement in kafka_engine.statements(store.database, table_columns(store), engine, cluster,
                                                     settings.ttl_raw_days):
                store.client.command(statement)
            print(f"Kafka engine: {', '.join(settings.topic(t) for t in kafka_engine.RAW_TOPICS)} load into "
                  f"{store.database} in group {engine.group} from {engine.broker_list}; errors in "
                  f"{store.database}.{kafka_engine.ERRORS_TABLE}. Run the sinks with RLPULSE_SINK_RAW=0")
    return 0


def cmd_query(args: argparse.Namespace) -> int:
    from sinks import queries
    from sinks.clickhouse import open_reader

    if args.list:
        if args.sql or args.saved:
            raise ValueError("--list takes no SQL and no --saved")
        saved = queries.list_saved()
        width = max((len(n) for n in saved), default=0)
        for name, about in saved.items():
            params = queries.placeholders(queries.load_saved(name))
            takes = ("  (--param " + ", ".join(f"{n}: {t}" for n, t in params.items()) + ")") if params else ""
            print(f"{name.ljust(width)}  {about}{takes}")
        return 0
    if bool(args.sql) == bool(args.saved):
        raise ValueError("give either SQL or --saved NAME (or --list)")
    params = queries.parse_params(args.param)
    if args.saved:
        queries.load_saved(args.saved)  # an unknown name fails before opening the store
    settings = _settings(args)
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
                from sinks.clickhouse import require_database

                require_database(store)  # an empty store: say so, and what fills it
            print(f"rlpulse query: ClickHouse refused the query: {exc}", file=sys.stderr)
            return 1
    sys.stdout.write(queries.render(columns, rows, args.format))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    import json

    from producers.simulator import SimConfig, simulate
    from schemas.topics import ensure_topics

    settings = _settings(args)
    ensure_topics(settings)
    config = SimConfig(project=args.project, runs=args.runs, steps=args.steps, rollouts_per_step=args.rollouts,
                       terms=tuple(args.terms.split(",")), failure_rate=args.failure_rate, clip_rate=args.clip_rate,
                       seed=args.seed, stall_s=args.stall_s, silent_run=args.silent_run, gpu=args.gpu)
    truth = simulate(settings, config, progress=print)
    if args.ground_truth:
        with open(args.ground_truth, "w") as f:
            json.dump(truth.as_dict(), f, indent=2, sort_keys=True)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from rlpulse.demo import run_demo

    return run_demo(_settings(args))


def cmd_status(args: argparse.Namespace) -> int:
    from rlpulse import services
    from rlpulse.pipeline import STREAMS_TOPICS, existing_groups, partition_lag
    from schemas.catalogue import RAW_TOPICS, sink_topics

    settings = _settings(args)
    code = services.main(settings, "status")
    if code != 0:
        return code
    groups = [(settings.app_id, STREAMS_TOPICS), (settings.sink_group, sink_topics(settings.sink_raw))]
    known = existing_groups(settings)
    # Shown when they exist: `rlpulse alerts`' group, and ClickHouse's Kafka engine (migrate --kafka-engine).
    groups += [(g, t) for g, t in ((f"{settings.topic_prefix}-alerts", ("alerts",)),
                                   (f"{settings.topic_prefix}-ch-kafka", RAW_TOPICS)) if g in known]
    for group, topics in groups:
        try:
            rows = partition_lag(settings, group, topics)
        except RuntimeError as exc:  # topics not created yet
            print(f"consumer group {group}: {exc}")
            continue
        per_topic = {settings.topic(t): 0 for t in topics}
        for topic, _partition, committed, end in rows:
            per_topic[topic] += max(end - committed, 0)
        print(f"consumer group {group}: lag " + ", ".join(f"{t} {n}" for t, n in per_topic.items())
              + ("" if group in known else " (the group has not committed yet)"))
        # one line per partition: topic[partition]  committed / end = lag
        names = [f"{topic}[{partition}]" for topic, partition, _, _ in rows]
        width = max(map(len, names), default=0)
        digits = max((len(str(end)) for *_, end in rows), default=1)
        for name, (_, _, committed, end) in zip(names, rows):
            print(f"  {name.ljust(width)}  {committed:>{digits}} / {end:>{digits}} = {max(end - committed, 0)}")
    return 0


def cmd_dlq(args: argparse.Namespace) -> int:
    import asyncio

    from schemas.catalogue import DLQ_TOPIC
    from sinks.dlq import LEDGER_TOPIC, read_dead_letters, replay_dead_letters
    from sinks.report import print_table

    settings = _settings(args)
    if args.action == "replay":
        report = asyncio.run(replay_dead_letters(settings, args.topic, args.reason, args.dry_run))
        print_table(["source", "to", "reason"], [(r["source"], r["to"], r["reason"]) for r in report.replayed])
        print(f"{'would replay' if args.dry_run else 'replayed'} {len(report.replayed)} dead letters; skipped "
              f"{report.already} replayed before, {report.filtered} not matching the filters, "
              f"{report.unroutable} without a source topic")
        return 0
    letters = asyncio.run(read_dead_letters(settings.kafka_client_kwargs(), settings.topic(DLQ_TOPIC), args.limit,
                                            settings.topic(LEDGER_TOPIC)))
    print_table(["source", "bytes", "replayed to", "reason"],
                [(d["source"], d["bytes"], d["replayed"], d["reason"]) for d in letters])
    print(f"{len(letters)} dead letters on {settings.topic(DLQ_TOPIC)}")
    return 0


def cmd_alerts(args: argparse.Namespace) -> int:
    import asyncio

    from sinks.alert_feed import serve_alerts

    from rlpulse.settings import parse_duration

    settings = _settings(args)
    # The URL carries its token (Slack, Teams): from the environment it stays out of `ps`.
    webhook = args.webhook or os.environ.get("RLPULSE_ALERTS_WEBHOOK") or None
    asyncio.run(serve_alerts(settings, webhook, args.from_beginning, args.once, group=args.group,
                             give_up_after_s=parse_duration(args.give_up_after), timeout_s=parse_duration(args.webhook_timeout)))
    return 0


def cmd_gpu_poller(args: argparse.Namespace) -> int:
    from producers.gpu_poller import main as poll
    from rlpulse.settings import parse_duration

    indices = [int(i) for i in args.gpus.split(",")] if args.gpus else None
    return poll(_settings(args), indices=indices, sample_interval=parse_duration(args.sample_interval),
                export_interval=parse_duration(args.export_interval), run_id=args.run_id, attempt=args.attempt,
                role=args.role, rank=args.rank, project=args.project, node=args.node, pod=args.pod)


def cmd_report(args: argparse.Namespace) -> int:
    from sinks.clickhouse import open_reader
    from sinks.report import print_report

    if bool(args.html) != bool(args.run):
        raise ValueError("RUN and --html go together: rlpulse report RUN --html out.html")
    if not args.html and (args.step is not None or args.sample is not None):
        raise ValueError("--step and --sample choose the trajectories of the HTML page: "
                         "rlpulse report RUN --html out.html --step N --sample ID")
    if args.step is not None and args.step < 0:
        raise ValueError(f"--step must be 0 or more, got {args.step}")
    settings = _settings(args)
    with open_reader(settings.clickhouse_dsn, owner="rlpulse report") as store:
        _require_rows(store, args.run if args.html else None, args.project)
        if args.html:
            from sinks.html_report import write_report

            out = write_report(store, args.run, args.html, attempt=args.attempt, step=args.step, sample=args.sample)
            print(f"wrote {out}")
        else:
            print_report(store, project=args.project)
    return 0


def _require_rows(store, run: str | None, project: str | None) -> None:
    """NoDataError, naming what there is instead, when the store is empty or has no rows of ``run``/``project``."""
    from sinks.clickhouse import NoDataError, no_data, require_database
    from sinks.html_report import latest_attempt
    from sinks.report import has_rows, latest_names, stored_rows

    require_database(store)
    if not stored_rows(store):
        raise no_data(store, "its tables are empty")
    if run is not None and latest_attempt(store, run) is None:
        raise NoDataError(f"no rows name run {run!r} in {store.url}. Latest runs: {', '.join(latest_names(store, 'run_id'))}")
    if project is not None and not has_rows(store, "project", project):
        raise NoDataError(f"no rows of project {project!r} in {store.url}. "
                          f"Latest projects: {', '.join(latest_names(store, 'project'))}")


def cmd_watch(args: argparse.Namespace) -> int:
    from sinks.clickhouse import open_reader
    from sinks.watch import watch

    from rlpulse.settings import parse_duration

    interval = parse_duration(args.interval)
    if interval <= 0:
        raise ValueError(f"--interval must be above 0, got {args.interval}")
    if not args.verbose:  # the driver's retry warnings would scroll through the live view
        for name in ("urllib3", "clickhouse_connect"):
            logging.getLogger(name).setLevel(logging.ERROR)
    settings = _settings(args)
    return watch(settings.clickhouse_dsn, lambda dsn: open_reader(dsn, owner="rlpulse watch"), interval,
                 project=args.project, show_all=args.all, once=args.once)


def _bench_options():
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
    """What `make bench` runs: the local broker up, then bench/run.py with this interpreter."""
    import os
    import subprocess
    from pathlib import Path

    from rlpulse import services

    root = Path(__file__).resolve().parents[1]
    options = _bench_options()
    if options is None:
        raise RuntimeError(f"rlpulse bench runs from a source checkout: no bench/ beside {root / 'rlpulse'}")
    settings = _settings(args)
    if services.main(settings, "up") != 0:
        return 1
    env = dict(os.environ, RLPULSE_KAFKA_BOOTSTRAP=settings.kafka_bootstrap)
    return subprocess.call([sys.executable, str(root / "bench" / "run.py"), *options.to_argv(args)], env=env, cwd=root)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlpulse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("services", help="start, stop or inspect the local Kafka broker")
    p.add_argument("action", choices=["up", "down", "status"])
    _add_common(p)
    p.set_defaults(func=cmd_services)

    p = sub.add_parser("streams", help="run the Faust stream processors (a worker)")
    _add_common(p)
    p.set_defaults(func=cmd_streams)

    p = sub.add_parser("sink", help="write the topics into ClickHouse")
    p.add_argument("--batch-rows", type=int, default=5000, help="insert when this many rows are buffered")
    p.add_argument("--flush-interval", type=float, default=1.0, help="seconds between checkpoints")
    p.add_argument("--read-port", type=int, default=None, help="port of the read-only query endpoint on 127.0.0.1 "
                   "(chDB store only; default RLPULSE_READ_PORT, else a free port, published in the store's 'endpoint' file)")
    _add_common(p)
    p.set_defaults(func=cmd_sink)

    p = sub.add_parser("migrate", help="create or upgrade the ClickHouse tables",
                       description="Applies the migrations not applied yet. With RLPULSE_CLICKHOUSE_CLUSTER=name, "
                       "ON CLUSTER: replicated <table>_local parts and Distributed tables under the tables' names.")
    p.add_argument("--kafka-engine", action="store_true",
                   help="also create ClickHouse Kafka engine tables and materialized views that load the raw topics "
                   "(spans, steps, hardware) into their tables (a ClickHouse server only; then run the sinks with "
                   "RLPULSE_SINK_RAW=0)")
    p.add_argument("--kafka-engine-brokers", metavar="HOST:PORT,...",
                   help="the brokers as the ClickHouse server reaches them (default: --bootstrap)")
    p.add_argument("--kafka-engine-consumers", type=int, default=1, metavar="N",
                   help="consumers per Kafka table on each server (kafka_num_consumers; default 1)")
    _add_common(p)
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("query", help="run a read-only SQL query, or a saved one (--saved NAME, --list)")
    p.add_argument("sql", nargs="?", help="SQL; {name:Type} placeholders take --param values")
    p.add_argument("--saved", metavar="NAME", help="run the saved query NAME (sinks/queries/NAME.sql)")
    p.add_argument("--list", action="store_true", help="list the saved queries")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="value of a {NAME:Type} placeholder, parsed by ClickHouse as Type (repeatable)")
    p.add_argument("--format", choices=["table", "csv", "json"], default="table", help="output format")
    _add_common(p)
    p.set_defaults(func=cmd_query)

    p = sub.add_parser("simulate", help="publish simulated training runs through the SDK")
    p.add_argument("--project", default="sim")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rollouts", type=int, default=8, help="rollouts per step")
    p.add_argument("--terms", default="judge,format", help="reward terms, comma-separated")
    p.add_argument("--failure-rate", type=float, default=0.2, help="share of grader calls that fail")
    p.add_argument("--clip-rate", type=float, default=0.15, help="share of completions truncated at max tokens")
    p.add_argument("--stall-s", type=float, default=0.0, help="the last run stalls after step 0 for this long")
    p.add_argument("--silent-run", action="store_true", help="add a run that dies after one step without RUN_END")
    p.add_argument("--gpu", action="store_true", help="a simulated GPU per run (the first with an XID and a slowdown)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--ground-truth", help="write what was sent as JSON to this file")
    _add_common(p)
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("demo", help="the main job: services, simulated runs, streams, sink, report")
    _add_common(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("dlq", help="show the dead letters (source, reason); `dlq replay` puts them back once the cause is fixed",
                       description="`rlpulse dlq` lists the last dead letters: source topic/partition/offset, size, "
                       "reason, and where a replay sent each. `rlpulse dlq replay` republishes each dead letter not "
                       "replayed yet (original bytes and key) to its source topic, where the sink reads it again; "
                       "what it replayed is recorded (topic <prefix>.dlq-replayed, group <prefix>-dlq-replay), so a "
                       "second replay sends nothing twice.")
    p.add_argument("action", nargs="?", choices=["list", "replay"], default="list", help="list (default) or replay")
    p.add_argument("--limit", type=int, default=100, help="list: the last N dead letters")
    p.add_argument("--topic", help="replay: only letters from this source topic (short name such as spans, or full)")
    p.add_argument("--reason", help="replay: only letters whose reason contains this text (any case)")
    p.add_argument("--dry-run", action="store_true", help="replay: print what would be replayed, send nothing")
    _add_common(p)
    p.set_defaults(func=cmd_dlq)

    p = sub.add_parser("alerts", help="print alerts as they fire and resolve; optionally POST each to a webhook",
                       description="Reads the alerts topic in a consumer group and commits an alert only once the "
                       "webhook accepted it (or it was given up on), so alerts fired while this was down, or read "
                       "but not delivered when it stopped, are posted at the next start: at least once. Each POST "
                       "carries alert_id (JSON body) and an Idempotency-Key header with the same value, one per "
                       "alert transition, for the receiver to drop duplicates. Logs name only the webhook's "
                       "scheme and host.")
    p.add_argument("--webhook", help="POST each alert as JSON to this URL (retried with backoff; see --give-up-after). "
                   "RLPULSE_ALERTS_WEBHOOK keeps the URL and its token out of the process list")
    p.add_argument("--group", help="consumer group whose committed offsets say where to resume (default <prefix>-alerts)")
    p.add_argument("--from-beginning", action="store_true",
                   help="a group with no committed offset starts at the beginning of the topic, not its end")
    p.add_argument("--once", action="store_true", help="stop once what is on the topic now is printed, posted and committed")
    p.add_argument("--give-up-after", default="10m",
                   help="once the webhook has failed every call for this long, an alert that fails is logged, counted "
                   "and skipped instead of retried (a 4xx refusal is at once)")
    p.add_argument("--webhook-timeout", default="5s", help="time limit of one POST")
    _add_common(p)
    p.set_defaults(func=cmd_alerts)

    p = sub.add_parser("gpu-poller", help="publish NVML figures, XIDs and placements of this host's GPUs")
    p.add_argument("--gpus", help="GPU indices, comma-separated (default: all visible)")
    p.add_argument("--sample-interval", default="5s", help="NVML read interval")
    p.add_argument("--export-interval", default="15s", help="publish interval (means, ORs, latest values)")
    p.add_argument("--run-id", help="publish a placement for this run while polling")
    p.add_argument("--attempt", type=int, default=1)
    p.add_argument("--role", default="trainer")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--project", default="")
    p.add_argument("--node", default="")
    p.add_argument("--pod", default="")
    _add_common(p)
    p.set_defaults(func=cmd_gpu_poller)

    p = sub.add_parser("status", help="local services and consumer lag of the streams and the sink")
    _add_common(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("bench", help="the benchmarks of `make bench`: SDK, Kafka ceilings, drain, latency, memory")
    bench_options = _bench_options()
    if bench_options is not None:
        bench_options.add_arguments(p)
    p.add_argument("--bootstrap", dest="kafka_bootstrap", help="Kafka bootstrap servers (RLPULSE_KAFKA_BOOTSTRAP)")
    # topics and chDB stores are the benchmark's own, under fresh prefixes
    p.set_defaults(func=cmd_bench, clickhouse_url=None, topic_prefix=None, verbose=False)

    p = sub.add_parser("report", help="print figures read from ClickHouse, or write one run's charts as HTML")
    p.add_argument("run", nargs="?", help="run_id; with --html, the run the page shows")
    p.add_argument("--html", metavar="PATH", help="write a self-contained HTML page of RUN's charts to PATH")
    p.add_argument("--attempt", type=int, help="attempt of RUN (default: the latest one with data)")
    p.add_argument("--project", help="only this project (text report)")
    p.add_argument("--step", type=int, help="with --html: the step whose trajectories the page shows "
                   "(default: the latest step with rollouts)")
    p.add_argument("--sample", metavar="ID", help="with --html: the sample (prompt) whose trajectories the page "
                   "shows (default: the step's first sample by id; the page lists the others)")
    _add_common(p)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("watch", help="a live terminal view of the active runs (step, pace, reward, alerts, GPUs)",
                       description="One line per active run, refreshed from ClickHouse: step, steps per minute, "
                       "reward mean and clipped ratio of the latest step, grader failure rate, state "
                       "(RUNNING, STALLED, SILENT, ENDED); then the runs' GPUs and open alerts. A run is active "
                       "when it reported in the last 10 minutes or has an open stall or silence alert; ended "
                       "runs are dimmed. Ctrl-C quits.")
    p.add_argument("--interval", default="2s", help="refresh interval (500ms, 2s, 1m)")
    p.add_argument("--project", help="only this project")
    p.add_argument("--all", action="store_true", help="every run in the database, not only the active ones")
    p.add_argument("--once", action="store_true", help="print one frame and exit (scripts, tests)")
    _add_common(p)
    p.set_defaults(func=cmd_watch)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Whatever this process and its children create (the chDB store's files, which chDB makes
    # itself; the broker's data; logs; an HTML page of a run) is readable by its owner only.
    from rlpulse.settings import PRIVATE_UMASK

    os.umask(PRIVATE_UMASK)
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "verbose", False):
        logging.getLogger("aiokafka").setLevel(logging.WARNING)  # its INFO lines are for debugging
    try:
        if args.command in _NEEDS_BROKER:  # fail at once, in one line, rather than in a client's retries
            from rlpulse import services

            services.require_broker(_settings(args))
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `rlpulse query ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141
    except KeyboardInterrupt:
        print(f"rlpulse {args.command}: interrupted", file=sys.stderr)
        return 130
    except ValueError as exc:  # bad settings or arguments: one clear line, no traceback
        print(f"rlpulse {args.command}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        # Known operational failures (store busy, no data, broker unreachable, pipeline stuck): one
        # line. Anything else is a bug and keeps its traceback.
        message = _known_failure(exc, args)
        if message is None:
            raise
        print(f"rlpulse {args.command}: {message}", file=sys.stderr)
        return 1


# Commands that cannot do anything without the broker (`demo` and `bench` start it themselves;
# the GPU poller's SDK buffers and retries while it is away).
_NEEDS_BROKER = {"simulate", "streams", "sink", "dlq", "alerts"}


def _known_failure(exc: Exception, args: argparse.Namespace) -> str | None:
    """The one-line message for an expected failure; None for anything else."""
    kind = type(exc).__module__
    if kind.startswith("aiokafka") and type(exc).__name__ in ("KafkaConnectionError", "NoBrokersAvailable"):
        try:
            bootstrap = _settings(args).kafka_bootstrap
        except ValueError:
            bootstrap = "the bootstrap servers"
        return (f"lost the Kafka broker at {bootstrap} ({exc}). Check it with `rlpulse services status`; "
                "start the local one with `rlpulse services up`")
    if kind.startswith(("clickhouse_connect", "chdb")):
        from sinks.queries import _one_line

        return f"ClickHouse failed: {_one_line(exc, limit=300)}"
    if isinstance(exc, (RuntimeError, ConnectionError, TimeoutError)) or (
            isinstance(exc, OSError) and exc.filename is not None):  # a path that cannot be read or written
        return str(exc)
    return None


if __name__ == "__main__":
    sys.exit(main())
