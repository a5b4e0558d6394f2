"""The ``rlpulse`` command line: one subcommand per process of the pipeline."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from rlpulse import commands, otlp_cli, prometheus_cli, reference
from rlpulse.cli_flags import add_common as _add_common
from rlpulse.base import env as envvars
from rlpulse.base.terminal import TerminalSafeFormatter, terminal_safe_lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlpulse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("services", help="start, stop or inspect the local Kafka broker")
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument(
        "--brokers",
        type=int,
        choices=[1, 3, 5],
        default=None,
        help="up: a KRaft cluster of this many nodes on the bootstrap port and the ones after it, "
        f"replication 3 (default: the cluster formed in {envvars.HOME}, if any, else 1)",
    )
    _add_common(p)
    p.set_defaults(func=commands.cmd_services)

    p = sub.add_parser("streams", help="run the Faust stream processors (a worker)")
    _add_common(p)
    p.set_defaults(func=commands.cmd_streams)

    p = sub.add_parser("sink", help="write the topics into ClickHouse")
    # 25,000: a backlog drains in inserts of that many rows, four to five a second (with 5,000 the
    # sink made 266 parts, some 6,000 files, in a 1.2 M-event drain, which strace showed as over a
    # second in openat alone; file creation is slow on this machine's ext4): `bench --quick` sink
    # 6.7-9.1 -> 5.7-6.0 us an event, drain 87-105k -> 110k events/s, event ->
    # row p50 0.22-0.29 -> 0.47-0.53 s, p99 0.84 -> 0.87-0.91 s); live rows go in 0.4 s after
    # they arrive (Policy.live_interval) whatever the count.
    p.add_argument("--batch-rows", type=int, default=25_000,
                   help="insert when this many rows are buffered (default 25000; live rows go in within 0.4 s)")
    p.add_argument("--flush-interval", type=float, default=1.0, help="seconds between checkpoints")
    p.add_argument(
        "--read-port",
        type=int,
        default=None,
        help="port of the read-only query endpoint on 127.0.0.1 "
        f"(chDB store only; default {envvars.READ_PORT}, else a free port, published in the store's 'endpoint' file)",
    )
    _add_common(p)
    p.set_defaults(func=commands.cmd_sink)

    p = sub.add_parser(
        "migrate",
        help="create or upgrade the ClickHouse tables",
        description=f"Applies the migrations not applied yet. With {envvars.CLICKHOUSE_CLUSTER}=name, "
        "ON CLUSTER: replicated <table>_local parts and Distributed tables under the tables' names.",
    )
    p.add_argument(
        "--kafka-engine",
        action="store_true",
        help="also create ClickHouse Kafka engine tables and materialized views that load the raw topics "
        "(spans, steps, hardware) into their tables (a ClickHouse server only; then run the sinks with "
        f"{envvars.SINK_RAW}=0)",
    )
    p.add_argument(
        "--kafka-engine-brokers",
        metavar="HOST:PORT,...",
        help="the brokers as the ClickHouse server reaches them (default: --bootstrap)",
    )
    p.add_argument(
        "--kafka-engine-consumers",
        type=int,
        default=1,
        metavar="N",
        help="consumers per Kafka table on each server (kafka_num_consumers; default 1)",
    )
    _add_common(p)
    p.set_defaults(func=commands.cmd_migrate)

    p = sub.add_parser("query", help="run a read-only SQL query, or a saved one (--saved NAME, --list)")
    p.add_argument("sql", nargs="?", help="SQL; {name:Type} placeholders take --param values")
    p.add_argument("--saved", metavar="NAME", help="run the saved query NAME (sinks/read/queries/NAME.sql)")
    p.add_argument("--list", action="store_true", help="list the saved queries")
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="value of a {NAME:Type} placeholder, parsed by ClickHouse as Type (repeatable)",
    )
    p.add_argument("--format", choices=["table", "csv", "json"], default="table", help="output format")
    _add_common(p, kafka=False)
    p.set_defaults(func=commands.cmd_query)

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
    p.set_defaults(func=commands.cmd_simulate)

    p = sub.add_parser("demo", help="the main job: services, simulated runs, streams, sink, report")
    _add_common(p)
    p.set_defaults(func=commands.cmd_demo)

    p = sub.add_parser(
        "dlq",
        help="show the dead letters (source, reason); `dlq replay` puts them back once the cause is fixed",
        description="`rlpulse dlq` lists the last dead letters: source topic/partition/offset, size, "
        "reason, and where a replay sent each. `rlpulse dlq replay` republishes each dead letter not "
        "replayed yet (original bytes and key) to its source topic, where the sink reads it again; "
        "what it replayed is recorded (topic <prefix>.dlq-replayed, group <prefix>-dlq-replay), so a "
        "second replay sends nothing twice.",
    )
    p.add_argument("action", nargs="?", choices=["list", "replay"], default="list", help="list (default) or replay")
    p.add_argument("--limit", type=int, default=100, help="list: the last N dead letters")
    p.add_argument("--topic", help="replay: only letters from this source topic (short name such as spans, or full)")
    p.add_argument("--reason", help="replay: only letters whose reason contains this text (any case)")
    p.add_argument("--dry-run", action="store_true", help="replay: print what would be replayed, send nothing")
    _add_common(p)
    p.set_defaults(func=commands.cmd_dlq)

    p = sub.add_parser(
        "alerts",
        help="print alerts as they fire and resolve; optionally POST each to a webhook",
        description="Reads the alerts topic in a consumer group and commits an alert only once the "
        "webhook accepted it (or it was given up on), so alerts fired while this was down, or read "
        "but not delivered when it stopped, are posted at the next start: at least once. Each POST "
        "carries alert_id (JSON body) and an Idempotency-Key header with the same value, one per "
        "alert transition, for the receiver to drop duplicates. Logs name only the webhook's "
        "scheme and host.",
    )
    p.add_argument(
        "--webhook",
        help="POST each alert as JSON to this URL (retried with backoff; see --give-up-after). "
        f"{envvars.ALERTS_WEBHOOK} keeps the URL and its token out of the process list",
    )
    p.add_argument("--group", help="consumer group whose committed offsets say where to resume (default <prefix>-alerts)")
    p.add_argument(
        "--from-beginning",
        action="store_true",
        help="a group with no committed offset starts at the beginning of the topic, not its end",
    )
    p.add_argument("--once", action="store_true", help="stop once what is on the topic now is printed, posted and committed")
    p.add_argument(
        "--give-up-after",
        default="10m",
        help="once the webhook has failed every call for this long, an alert that fails is logged, counted "
        "and skipped instead of retried (a 4xx refusal is at once)",
    )
    p.add_argument("--webhook-timeout", default="5s", help="time limit of one POST")
    _add_common(p)
    p.set_defaults(func=commands.cmd_alerts)

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
    p.set_defaults(func=commands.cmd_gpu_poller)

    p = sub.add_parser(
        "engine-poller",
        help="scrape vLLM's Prometheus metrics for a run and publish engine samples",
        description="Scrapes each --metrics-url (vLLM's /metrics) every --interval with prometheus_client's parser and "
        "publishes one engine sample per engine and scrape on the hardware topic: requests running and waiting, KV-cache "
        "usage and awake as read, preemptions and tokens as rates, time to first token as p50/p90/p99 over the interval. "
        "Responses are read up to --max-bytes within --timeout, without redirects or proxies (pip install "
        "'rlpulse[engine]').",
    )
    p.add_argument("--metrics-url", action="append", required=True, metavar="URL", dest="metrics_urls",
                   help="a vLLM metrics endpoint, e.g. http://rollout-0:8000/metrics (repeat for several)")
    p.add_argument("--run-id", default="", help="the run the engines serve")
    p.add_argument("--attempt", type=int, default=1)
    p.add_argument("--project", default="")
    p.add_argument("--pod", default="", help="the rollout server's pod, for one --metrics-url (default: the engine is "
                   "named by its URL, as with several)")
    p.add_argument("--interval", default="5s", help="scrape interval")
    p.add_argument("--timeout", default="3s", help="time limit of one scrape, connect to last byte (TLS, status line, "
                   "headers and body included); the URLs are scraped at once")
    p.add_argument("--max-bytes", type=int, default=4 * 1024 * 1024, help="a larger response is refused (default 4 MiB)")
    _add_common(p)
    p.set_defaults(func=commands.cmd_engine_poller)

    p = sub.add_parser(
        "status",
        help="local services and consumer lag of the streams and the sink",
        description="Prints the local services, then one line per consumer group: its total lag, its partitions "
        "(and topics) and its members, naming the topics it is behind on. --detail (or -v) adds a line per "
        "partition: topic[partition]  committed / end = lag.",
    )
    p.add_argument("--detail", action="store_true", help="one line per partition under each group")
    _add_common(p, verbose_help="debug logging, and --detail")
    p.set_defaults(func=commands.cmd_status)

    p = sub.add_parser(
        "capacity",
        help="the latest capacity of each GPU pool and project, as the trainer service reported it",
        description="Per pool: DECLARED, OBSERVED (- until the service reads the cluster), devices GRANTED and QUEUED, "
        "the claims by claim state; per project its devices by claim state and its QUOTA. Each service instance's "
        "latest report, the max across instances (never the sum); a pool whose last claim ended reads 0.",
    )
    _add_common(p)
    p.set_defaults(func=commands.cmd_capacity)

    p = sub.add_parser(
        "retention",
        help="how long each table keeps its rows, per table and project (ClickHouse TTL), and what the sink kept out",
        description="`rlpulse retention` shows each table's retention (its default and the projects with their own) "
        "and the content the sink kept out (trajectories past the span cap, characters cut). `set` and `clear` change "
        "a table's TTL: rows whose event time is older are deleted, those already stored too. `clear --project P` puts "
        "P back under the table's default; `clear` alone puts the default back to "
        f"{envvars.TTL_RAW_DAYS} or {envvars.TTL_AGGREGATE_DAYS}. With a chDB store, stop the sink to change it.",
    )
    p.add_argument("action", nargs="?", choices=["show", "set", "clear"], default="show")
    p.add_argument("--table", help="set/clear: the table (spans, steps, step_stats, ...)")
    p.add_argument("--days", type=int, help="set: keep rows this many days (1 to 36500)")
    p.add_argument("--project", help="set/clear: this project's own retention; show: only this project")
    _add_common(p)
    p.set_defaults(func=commands.cmd_retention)

    p = sub.add_parser("bench", help="the benchmarks of `make bench`: SDK, Kafka ceilings, drain, latency, memory")
    bench_options = commands.bench_options()
    if bench_options is not None:
        bench_options.add_arguments(p)
    p.add_argument("--bootstrap", dest="kafka_bootstrap", help=f"Kafka bootstrap servers ({envvars.KAFKA_BOOTSTRAP})")
    # topics and chDB stores are the benchmark's own, under fresh prefixes
    p.set_defaults(func=commands.cmd_bench, clickhouse_url=None, topic_prefix=None, verbose=False)

    p = sub.add_parser("report", help="print figures read from ClickHouse, or write one run's charts as HTML")
    p.add_argument("run", nargs="?", help="run_id; with --html, the run the page shows")
    p.add_argument("--html", metavar="PATH", help="write a self-contained HTML page of RUN's charts to PATH")
    p.add_argument("--attempt", type=int, help="attempt of RUN (default: the latest one with data)")
    p.add_argument("--project", help="only this project (text report)")
    p.add_argument(
        "--step",
        type=int,
        help="with --html: the step whose trajectories the page shows (default: the latest step with rollouts)",
    )
    p.add_argument(
        "--sample",
        metavar="ID",
        help="with --html: the sample (prompt) whose trajectories the page "
        "shows (default: the step's first sample by id; the page lists the others)",
    )
    _add_common(p, kafka=False)
    p.set_defaults(func=commands.cmd_report)

    p = sub.add_parser(
        "export",
        help="trajectories out for training: (prompt, response, reward) triplets or OpenAI chat messages",
        description=f"Reads traced LLM calls (content recorded: {envvars.TRACE_CONTENT}=1) read-only from ClickHouse. "
        "triplets: one row per policy call (prompt, response, token ids when recorded, a placed reward, turn, final); "
        "messages: one row per trajectory (the policy's OpenAI chat conversation and its tools). A judge's calls (under a "
        "REWARD entry or GRADER span) are left out unless asked for. JSONL or Parquet, written by ClickHouse, a page of "
        "trajectories at a time (bounded memory whatever the count); the file appears whole once done.",
    )
    p.add_argument("what", choices=["triplets", "messages"])
    p.add_argument("-o", "--output", required=True, metavar="PATH", help="the file to write ('-': JSONL to stdout)")
    p.add_argument("--format", choices=["jsonl", "parquet"], help="default: from PATH's extension (.parquet, else jsonl)")
    p.add_argument("--project", help="only this project")
    p.add_argument("--run", dest="run_id", metavar="RUN_ID", help="only this run")
    p.add_argument("--min-step", type=int, help="only trajectories of this step or later")
    p.add_argument("--max-step", type=int, help="only trajectories of this step or earlier")
    p.add_argument("--sample", dest="sample_id", metavar="ID", help="only trajectories answering this sample (prompt)")
    p.add_argument("--min-reward", type=float, help="only trajectories whose reward is at least this (no reward: left out)")
    p.add_argument("--status", choices=["ok", "error", "unset"], help="only trajectories whose ROLLOUT span has this status")
    p.add_argument("--per-call", action="store_true",
                   help="messages: one conversation per call (its messages and reply), as TraceToMessages does")
    p.add_argument("--reward-to", choices=["last-call", "final", "every-call"], default="last-call",
                   help="last-call (default, as agent-lightning): each reward (emit_reward, the final one) to the last "
                   "policy call before it, others null; final: the final reward on the last policy call only; "
                   "every-call: the final reward on every policy call")
    p.add_argument("--include-grader-calls", action="store_true",
                   help="also the calls made under a REWARD entry or GRADER span (a judge), marked grader_call, no reward")
    p.add_argument("--page-size", type=int, default=256, help="trajectories per query (what one query holds in memory)")
    _add_common(p)
    p.set_defaults(func=commands.cmd_export)

    p = sub.add_parser(
        "watch",
        help="a live terminal view of the active runs (step, pace, reward, alerts, GPUs)",
        description="One line per active run, refreshed from ClickHouse: step, steps per minute, "
        "reward mean and clipped ratio of the latest step, grader failure rate, state "
        "(RUNNING, STALLED, SILENT; an ended run as FINISHED, FAILED or CANCELLED); then the runs' "
        "GPUs and open alerts. A run is active when it reported in the last 10 minutes or has an open "
        "stall or silence alert; ended runs are dimmed. Ctrl-C quits.",
    )
    p.add_argument("--interval", default="2s", help="refresh interval (500ms, 2s, 1m)")
    p.add_argument("--project", help="only this project")
    p.add_argument("--all", action="store_true", help="every run in the database, not only the active ones")
    p.add_argument("--once", action="store_true", help="print one frame and exit (scripts, tests)")
    p.add_argument(
        "--metric",
        action="append",
        default=[],
        metavar="NAME",
        help="a trainer scalar (as logged: loss, kl, clip_ratio/region_mean) shown as a column at its "
        "latest step; repeat for several",
    )
    _add_common(p, kafka=False)
    p.set_defaults(func=commands.cmd_watch)

    p = sub.add_parser(
        "ui",
        help="a local read-only web page: runs, a run's charts, a step's samples, a trajectory",
        description="Serves pages read from ClickHouse (through the sink's read endpoint while the sink holds a chDB "
        "store): the runs, a run's figures per step, a step's samples with their trajectories side by side, a "
        "trajectory's dialogue, tool calls, graders and span tree. Every view is a URL. Prints the address with a "
        f"token, as Jupyter does ({envvars.UI_TOKEN} sets it); a request without it gets 403.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8421, help="port (default 8421; 0: any free one)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a name (beyond loopback's and the bound address) a request's Host header may give, for a ui "
                   "bound beyond loopback and reached by a name; repeatable. Any other Host is answered 403 (DNS rebinding)")
    _add_common(p, kafka=False)
    p.set_defaults(func=commands.cmd_ui)

    otlp_cli.add(sub, _add_common)

    prometheus_cli.add(sub, _add_common)

    p = sub.add_parser("reference", help="write docs/reference/ from the code's catalogue (--check: exit 1 when stale)")
    p.add_argument("--out", default="docs/reference", help="the folder of the pages (default docs/reference)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 naming the pages that are stale")
    p.set_defaults(func=reference.cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Whatever this process and its children create (the chDB store's files, which chDB makes
    # itself; the broker's data; logs; an HTML page of a run) is readable by its owner only.
    from rlpulse.base.files import PRIVATE_UMASK

    os.umask(PRIVATE_UMASK)
    # Log lines quote hostile values (an alert's key in the webhook's lines, a decoder's reason for
    # a message anyone sent): the formatter writes their control characters as visible escapes.
    handler = logging.StreamHandler()
    handler.setFormatter(TerminalSafeFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO, handlers=[handler])
    if not getattr(args, "verbose", False):
        logging.getLogger("aiokafka").setLevel(logging.WARNING)  # its INFO lines are for debugging
    try:
        if args.command in _NEEDS_BROKER:  # fail at once, in one line, rather than in a client's retries
            from rlpulse import services

            services.require_broker(commands.settings_of(args))
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # output still buffered (stdout a pipe) meets a gone reader here, not at exit's flush
        return code
    except BrokenPipeError:  # `rlpulse query ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141
    except KeyboardInterrupt:
        print(f"rlpulse {args.command}: interrupted", file=sys.stderr)
        return 130
    except ValueError as exc:  # bad settings or arguments: one clear line, no traceback
        print(f"rlpulse {args.command}: {terminal_safe_lines(str(exc))}", file=sys.stderr)
        return 2
    except Exception as exc:
        # Known operational failures (store busy, no data, broker unreachable, pipeline stuck): one
        # line. Anything else is a bug and keeps its traceback.
        message = _known_failure(exc, args)
        if message is None:
            raise
        # A message may quote what the store or the broker holds (a run's name, ClickHouse's reason
        # with a value in it); one that spans lines on purpose (a log's tail) keeps its lines.
        print(f"rlpulse {args.command}: {terminal_safe_lines(message)}", file=sys.stderr)
        return 1


# Commands that cannot do anything without the broker (`demo` and `bench` start it themselves;
# the GPU poller's SDK buffers and retries while it is away).
_NEEDS_BROKER = {"simulate", "streams", "sink", "dlq", "alerts", "otlp", "otlp-ingest"}


def _known_failure(exc: Exception, args: argparse.Namespace) -> str | None:
    """The one-line message for an expected failure; None for anything else."""
    kind = type(exc).__module__
    if kind.startswith("aiokafka") and type(exc).__name__ in ("KafkaConnectionError", "NoBrokersAvailable"):
        try:
            bootstrap = commands.settings_of(args).kafka_bootstrap
        except ValueError:
            bootstrap = "the bootstrap servers"
        return (
            f"lost the Kafka broker at {bootstrap} ({exc}). Check it with `rlpulse services status`; "
            "start the local one with `rlpulse services up`"
        )
    if kind.startswith(("clickhouse_connect", "chdb")):
        from rlpulse.sinks.read.queries import one_line

        return f"ClickHouse failed: {one_line(exc, limit=300)}"
    if isinstance(exc, (RuntimeError, ConnectionError, TimeoutError)) or (
        isinstance(exc, OSError) and exc.filename is not None
    ):  # a path that cannot be read or written
        return str(exc)
    return None


if __name__ == "__main__":
    sys.exit(main())
