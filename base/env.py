"""Every ``RLPULSE_*`` environment variable, named once, with what it means.

Code that reads, sets or names a variable imports its constant from here: ``Settings._ENV``
(``rlpulse.base.settings``) maps the settings' variables to their fields, and the few read
where they act (the alert webhook, the read endpoint's port, the bench's reader password) are
read through these names too. ``tests/unit/base/test_env_names.py`` checks that no other ``RLPULSE_``
name appears anywhere in the repository and that docs/reference/settings.md (generated from
here by ``rlpulse reference``) documents each one.

This module imports nothing: every part of the project (the SDK, the streams, the sink, the
wiring) may import it.
"""

from __future__ import annotations

SETTINGS = "settings"  # a field of Settings (flags, then the variable, then the default)
COMMAND = "command"  # read by one command where it acts, outside Settings
DEPLOY = "deploy"  # read by the ClickHouse and Grafana containers (docker-compose.yml, deploy/)
TESTS = "tests"  # read by the test suite only

VARIABLES: dict[str, tuple[str, str]] = {}  # name -> (kind, meaning)


def _var(name: str, kind: str, meaning: str) -> str:
    if name in VARIABLES:
        raise ValueError(f"{name} is listed twice")
    VARIABLES[name] = (kind, meaning)
    return name


# Settings (rlpulse.base.settings.Settings._ENV), in the order of docs/reference/settings.md.
KAFKA_BOOTSTRAP = _var("RLPULSE_KAFKA_BOOTSTRAP", SETTINGS, "Kafka bootstrap servers, host:port[,host:port...]")
CLICKHOUSE_URL = _var("RLPULSE_CLICKHOUSE_URL", SETTINGS, "the ClickHouse store: chdb:///path or http://user:pass@host:8123/db")
HOME = _var("RLPULSE_HOME", SETTINGS, "the folder of the local broker, the chDB store and the logs")
TOPIC_PREFIX = _var("RLPULSE_TOPIC_PREFIX", SETTINGS, "prefix of every topic name, the Faust app id and the groups")
PARTITIONS = _var("RLPULSE_PARTITIONS", SETTINGS, "partitions of the pipeline's topics when they are created")
WINDOW = _var("RLPULSE_WINDOW", SETTINGS, "length of the streams' tumbling windows")
ALLOWED_LATENESS = _var("RLPULSE_ALLOWED_LATENESS", SETTINGS, "how late an event may arrive for its window")
STALL_AFTER = _var("RLPULSE_STALL_AFTER", SETTINGS,
                   "stall window of a run with no step time yet (first_step_stalled, and stalled_run before its 1st interval)")
STALL_MIN = _var("RLPULSE_STALL_MIN", SETTINGS,
                 "floor of a run's own stall window (factor x its median step time); never above RLPULSE_STALL_AFTER")
STALL_MAX = _var("RLPULSE_STALL_MAX", SETTINGS, "ceiling of a run's own stall window (may exceed RLPULSE_STALL_AFTER)")
STALL_FACTOR = _var("RLPULSE_STALL_FACTOR", SETTINGS,
                    "a run's stall window is this many times its median time between step_count increases")
SILENT_AFTER = _var("RLPULSE_SILENT_AFTER", SETTINGS, "a run with no event at all this long fires silent_run")
HEARTBEAT_INTERVAL = _var("RLPULSE_HEARTBEAT_INTERVAL", SETTINGS, "how often the SDK sends a run's heartbeat")
STREAMS_COMMIT_INTERVAL = _var("RLPULSE_STREAMS_COMMIT_INTERVAL", SETTINGS, "how often the streams commit offsets")
KAFKA_SECURITY_PROTOCOL = _var("RLPULSE_KAFKA_SECURITY_PROTOCOL", SETTINGS,
                               "PLAINTEXT, SSL, SASL_SSL or SASL_PLAINTEXT")
KAFKA_SASL_MECHANISM = _var("RLPULSE_KAFKA_SASL_MECHANISM", SETTINGS, "PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512")
KAFKA_SASL_USERNAME = _var("RLPULSE_KAFKA_SASL_USERNAME", SETTINGS, "the SASL user")
KAFKA_SASL_PASSWORD = _var("RLPULSE_KAFKA_SASL_PASSWORD", SETTINGS, "the SASL user's password")
KAFKA_SSL_CAFILE = _var("RLPULSE_KAFKA_SSL_CAFILE", SETTINGS, "PEM CA bundle the broker's certificate is checked against")
KAFKA_SSL_CERTFILE = _var("RLPULSE_KAFKA_SSL_CERTFILE", SETTINGS, "a client certificate (PEM) for mTLS")
KAFKA_SSL_KEYFILE = _var("RLPULSE_KAFKA_SSL_KEYFILE", SETTINGS, "the client certificate's key (PEM)")
KAFKA_SSL_KEY_PASSWORD = _var("RLPULSE_KAFKA_SSL_KEY_PASSWORD", SETTINGS, "the client key's password, if encrypted")
KAFKA_BATCH_MAX_BYTES = _var("RLPULSE_KAFKA_BATCH_MAX_BYTES", SETTINGS,
                             "bytes a consumed compressed record batch may inflate to; over it, a dead letter (docs/security.md)")
KAFKA_BATCH_MAX_RATIO = _var("RLPULSE_KAFKA_BATCH_MAX_RATIO", SETTINGS,
                             "above 1 MiB, a consumed compressed record batch may inflate to at most this many times its size")
KAFKA_CODECS = _var("RLPULSE_KAFKA_CODECS", SETTINGS,
                    "the record batch codecs consumers accept, comma-separated (none: uncompressed batches only)")
TTL_RAW_DAYS = _var("RLPULSE_TTL_RAW_DAYS", SETTINGS, "days ClickHouse keeps the raw events: spans, steps, hardware")
TTL_AGGREGATE_DAYS = _var("RLPULSE_TTL_AGGREGATE_DAYS", SETTINGS,
                          "days ClickHouse keeps windows, step figures, histograms, alerts")
SPAN_CAP = _var("RLPULSE_SPAN_CAP", SETTINGS,
                "trajectories per (run, attempt, step) whose spans the sink keeps in full; others lose their content (0: all)")
SINK_CONTENT_MAX_CHARS = _var("RLPULSE_SINK_CONTENT_MAX_CHARS", SETTINGS,
                              "characters the sink keeps of any one span attribute value (0: no cap)")
CLICKHOUSE_CLUSTER = _var("RLPULSE_CLICKHOUSE_CLUSTER", SETTINGS, "a remote_servers cluster: migrations ON CLUSTER")
SINK_RAW = _var("RLPULSE_SINK_RAW", SETTINGS, "0: the sink leaves the raw topics to ClickHouse's Kafka engine")
FAULTS = _var("RLPULSE_FAULTS", SETTINGS, "faults injected on purpose by the fault tests (rlpulse.base.faults)")
ALERT_GRADER_FAILURE_RATE = _var("RLPULSE_ALERT_GRADER_FAILURE_RATE", SETTINGS,
                                 "a grader term failing more often than this in a window fires")
ALERT_GRADER_MIN_GRADED = _var("RLPULSE_ALERT_GRADER_MIN_GRADED", SETTINGS,
                               "a window with fewer scores than this never fires grader_failure_rate")
ALERT_CLIPPED_RISING_STEPS = _var("RLPULSE_ALERT_CLIPPED_RISING_STEPS", SETTINGS,
                                  "the clipped ratio rising over this many steps fires")
ALERT_REWARD_ZERO_FRACTION = _var("RLPULSE_ALERT_REWARD_ZERO_FRACTION", SETTINGS,
                                  "a step whose rewards are this often <= 0 fires")
ALERT_STALENESS_MAX = _var("RLPULSE_ALERT_STALENESS_MAX", SETTINGS,
                           "a step whose rollouts' staleness (step - policy_version) exceeds this fires policy_stale")
ALERT_XID_QUIET_AFTER = _var("RLPULSE_ALERT_XID_QUIET_AFTER", SETTINGS,
                             "an XID alert resolves after this long without a new XID")
ALERT_ENGINE_KV_USAGE = _var("RLPULSE_ALERT_ENGINE_KV_USAGE", SETTINGS,
                             "engine_saturated: KV-cache usage (0..1) at or above which an engine with requests waiting is full")
ALERT_ENGINE_SATURATED_AFTER = _var("RLPULSE_ALERT_ENGINE_SATURATED_AFTER", SETTINGS,
                                    "an engine saturated for longer than this fires engine_saturated")

# Read by one command where it acts.
ALERTS_WEBHOOK = _var("RLPULSE_ALERTS_WEBHOOK", COMMAND,
                      "`rlpulse alerts`' webhook URL (kept out of the process list, unlike --webhook)")
READ_PORT = _var("RLPULSE_READ_PORT", COMMAND, "port of the sink's read-only query endpoint (default: a free one)")
BENCH_READ_PASSWORD = _var("RLPULSE_BENCH_READ_PASSWORD", COMMAND,
                           "the read endpoint's password, handed by the bench to its reader child")
TRACE_CONTENT = _var("RLPULSE_TRACE_CONTENT", COMMAND,
                     "1: traced LLM and tool spans record message content (rlpulse.producers.tracing; off by default)")
OTLP_TOKEN = _var("RLPULSE_OTLP_TOKEN", COMMAND,
                  "the bearer token `rlpulse otlp` requires (needed to bind beyond loopback; never a flag)")
UI_TOKEN = _var("RLPULSE_UI_TOKEN", COMMAND, "`rlpulse ui`'s token (default: a new random one at every start)")
PROMETHEUS_TOKEN = _var("RLPULSE_PROMETHEUS_TOKEN", COMMAND,
                            "`rlpulse prometheus`'s bearer token (required when it binds other than loopback)")
PROMETHEUS_GRACE = _var("RLPULSE_PROMETHEUS_GRACE", COMMAND,
                        "how long `rlpulse prometheus` keeps serving a run after it ended (default 15m)")

# Read by the containers docker-compose.yml starts.
SINK_PASSWORD = _var("RLPULSE_SINK_PASSWORD", DEPLOY, "password of ClickHouse's rlpulse_sink user")
READER_PASSWORD = _var("RLPULSE_READER_PASSWORD", DEPLOY, "password of ClickHouse's read-only rlpulse_reader user")
CLUSTER_SECRET = _var("RLPULSE_CLUSTER_SECRET", DEPLOY, "the secret the ClickHouse cluster's servers share")

# Read by the tests.
TEST_ARTIFACTS = _var("RLPULSE_TEST_ARTIFACTS", TESTS, "where tests write screenshots and other artefacts")
FUZZ_EXAMPLES = _var("RLPULSE_FUZZ_EXAMPLES", TESTS, "examples per property of the codec fuzz test (300)")


def of_kind(kind: str) -> list[str]:
    """The variables of one kind (SETTINGS, COMMAND, DEPLOY, TESTS), in listing order."""
    return [name for name, (k, _) in VARIABLES.items() if k == kind]
