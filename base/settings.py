"""Settings: flags, then ``RLPULSE_*`` environment variables, then defaults.

The Kafka bootstrap has one step more before its default: the address of the broker the home
started (``rlpulse services up`` records it in ``broker_address_file(home)``).

One immutable :class:`Settings` object is built at the edge (CLI, test fixture) and passed
down; nothing reads the environment behind the caller's back.
"""

from __future__ import annotations

import dataclasses
import os
import re
import ssl
from pathlib import Path
from typing import Any, ClassVar
from collections.abc import Callable, Mapping

from rlpulse.base import env as envvars
from rlpulse.base.faults import Faults

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str | float | int) -> float:
    """Parse ``500ms``, ``10s``, ``15m``, ``1h`` or a bare number of seconds into seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"invalid duration {text!r}: expected a number with ms, s, m or h, e.g. 500ms, 10s, 15m")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def _upper(text: str) -> str:
    return text.strip().upper()


def _flag(text: str) -> bool:
    """1/0, true/false, yes/no, on/off (any case)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected 1 or 0 (true/false, yes/no, on/off), not {text!r}")


# Kafka's record batch codecs (rlpulse.schemas.compression.CODECS: base imports nothing above it).
BATCH_CODECS = ("gzip", "snappy", "lz4", "zstd")


def _codecs(text: str) -> str:
    """``gzip,snappy,lz4,zstd``, any of them, or ``none``: the codecs, lower case, in that order."""
    named = {c.strip().lower() for c in text.split(",") if c.strip()}
    unknown = sorted(named - set(BATCH_CODECS) - {"none"})
    if unknown or ("none" in named and len(named) > 1):
        raise ValueError(f"expected codecs among {', '.join(BATCH_CODECS)} (comma-separated), or none; not {text!r}")
    return ",".join(c for c in BATCH_CODECS if c in named) or "none"


_PROJECT_NAME = re.compile(r"""^name\s*=\s*["']rlpulse["']\s*$""", re.MULTILINE)


def checkout_root(package_dir: Path | None = None) -> Path | None:
    """The source checkout this ``rlpulse`` package runs from (an editable install), else None.

    A checkout is the folder above the package holding a ``Makefile`` and a ``pyproject.toml``
    that names the ``rlpulse`` project; an installed wheel sits in site-packages, which has neither.
    """
    root = (package_dir or Path(__file__).resolve().parent).parent
    try:
        return root if (root / "Makefile").is_file() and _PROJECT_NAME.search((root / "pyproject.toml").read_text()) else None
    except OSError:
        return None


def default_home(package_dir: Path | None = None, env: Mapping[str, str] | None = None) -> Path:
    """``<checkout>/.rlpulse`` when running from a source checkout, else ``$XDG_DATA_HOME/rlpulse``
    (``~/.local/share/rlpulse``). One home per checkout: ``make`` and a bare ``rlpulse`` run there
    find the same broker and the same chDB store."""
    root = checkout_root(package_dir)
    if root is not None:
        return root / ".rlpulse"
    env = os.environ if env is None else env
    base = env.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "rlpulse"


def broker_address_file(home: Path) -> Path:
    """Where ``rlpulse services up`` records the bootstrap servers of the broker (or cluster) it
    started from ``home`` (0600; ``services down`` removes it)."""
    return home / "kafka" / "bootstrap"


def recorded_bootstrap(home: Path) -> str | None:
    """The bootstrap servers recorded in ``home`` by ``services up``; None when none is."""
    try:
        return broker_address_file(home).read_text().strip() or None
    except OSError:
        return None


@dataclasses.dataclass(frozen=True)
class AlertThresholds:
    """When the stream alert rules fire (each fires once per episode and resolves once)."""

    grader_failure_rate: float = 0.2  # failures / graded of a term in one window, above this fires
    grader_min_graded: int = 10  # a window with fewer scores than this never fires
    clipped_rising_steps: int = 3  # clipped ratio rising over this many consecutive steps fires
    reward_zero_fraction: float = 0.5  # a step whose rewards are this often <= 0 fires
    # A step trained on rollouts generated more than this many steps before it fires (staleness =
    # step - policy_version; synchronous trainers keep 0, asynchronous ones a bound of a few steps).
    staleness_max: int = 4
    xid_quiet_after: float = 900.0  # an XID alert resolves after this long without a new XID
    # engine_saturated: a vLLM engine with requests waiting and its KV cache at least this full, for
    # longer than engine_saturated_after (seconds of the samples' own time), fires.
    engine_kv_usage: float = 0.95
    engine_saturated_after: float = 120.0


@dataclasses.dataclass(frozen=True)
class Settings:
    kafka_bootstrap: str = "127.0.0.1:9092"
    # empty: a chDB store under ``home``. Out of repr() (it may hold user:password@, as the Kafka
    # passwords below): print it through rlpulse.base.urls.mask_url.
    clickhouse_url: str = dataclasses.field(default="", repr=False)
    topic_prefix: str = "rlpulse"
    home: Path = dataclasses.field(default_factory=default_home)
    partitions: int = 2
    window: float = 60.0
    allowed_lateness: float = 10.0
    stall_after: float = 900.0
    # A run's own stall window once it has shown its step time (streams/stall.py): stall_factor x
    # the median time between its step_count increases, clamped to [min(stall_min, stall_after),
    # stall_max]. The ceiling is its own (24 h), not stall_after: a run whose normal step is
    # slower than stall_after must not fire on every step.
    stall_min: float = 60.0
    stall_max: float = 86400.0
    stall_factor: float = 5.0
    silent_after: float = 300.0
    heartbeat_interval: float = 15.0
    # How often the streams commit offsets. Faust defaults to 2.8 s; 1 s moves a backlog's last
    # figures into ClickHouse sooner (`make bench`: drain 47.3k -> 48.9k events/s) for one more
    # commit request a second.
    streams_commit_interval: float = 1.0
    # Kafka security; the password is kept out of repr() so it never lands in a log line.
    kafka_security_protocol: str = "PLAINTEXT"
    kafka_sasl_mechanism: str = ""
    kafka_sasl_username: str = ""
    kafka_sasl_password: str = dataclasses.field(default="", repr=False)
    kafka_ssl_cafile: str = ""
    # A client certificate (mTLS) for SSL and SASL_SSL: a PEM certificate, its PEM key (may be
    # the same file), and the key's password if it is encrypted.
    kafka_ssl_certfile: str = ""
    kafka_ssl_keyfile: str = ""
    kafka_ssl_key_password: str = dataclasses.field(default="", repr=False)
    # What a consumed compressed record batch may inflate to (rlpulse.schemas.compression, installed by the
    # commands that consume): 64 MiB, and above 1 MiB at most 2000x its compressed size. Our writers'
    # batches hold at most 1 MiB (their max_batch_size); 64 MiB is four times the container decoder's
    # 16 MiB a message, so whatever it can judge message by message still reaches it. 2000x is above
    # deflate's own ceiling (~1,032x), so only zstd (whose RLE blocks reach 30,000x) meets it first.
    kafka_batch_max_bytes: int = 64 << 20
    kafka_batch_max_ratio: float = 2000.0
    kafka_codecs: str = ",".join(BATCH_CODECS)
    alerts: AlertThresholds = dataclasses.field(default_factory=AlertThresholds)
    ttl_raw_days: int = 90  # spans, steps, GPU samples, placements, engine samples, capacity
    ttl_aggregate_days: int = 365  # windows, step figures, histograms, alerts
    # Content kept within bounds by the sink (sinks/write/content_bounds.py); the streams' figures count
    # every event whatever these say. The trajectories per (run, attempt, step) kept in full (0: all),
    # and the characters kept of any one span attribute value (the SDK's own limit, for other writers).
    span_cap: int = 0
    sink_content_max_chars: int = 64 * 1024
    # A remote_servers cluster name: migrations create replicated <table>_local parts and
    # Distributed tables ON CLUSTER (sinks/store/cluster_ddl.py). Empty: one server (or chDB).
    clickhouse_cluster: str = ""
    # False when ClickHouse's Kafka engine loads the raw topics (`rlpulse migrate --kafka-engine`):
    # the sink then reads the derived topics only, so no raw event has two writers.
    sink_raw: bool = True
    # Faults injected on purpose by the fault tests (base/faults.py); none unless RLPULSE_FAULTS says.
    faults: Faults = dataclasses.field(default_factory=Faults)

    # Environment variable (named in rlpulse.base.env) -> field, with the parser for its text.
    _ENV: ClassVar[dict[str, tuple[str, Callable[[str], Any]]]] = {
        envvars.KAFKA_BOOTSTRAP: ("kafka_bootstrap", str),
        envvars.CLICKHOUSE_URL: ("clickhouse_url", str),
        envvars.TOPIC_PREFIX: ("topic_prefix", str),
        envvars.HOME: ("home", Path),
        envvars.PARTITIONS: ("partitions", int),
        envvars.WINDOW: ("window", parse_duration),
        envvars.ALLOWED_LATENESS: ("allowed_lateness", parse_duration),
        envvars.STALL_AFTER: ("stall_after", parse_duration),
        envvars.STALL_MIN: ("stall_min", parse_duration),
        envvars.STALL_MAX: ("stall_max", parse_duration),
        envvars.STALL_FACTOR: ("stall_factor", float),
        envvars.SILENT_AFTER: ("silent_after", parse_duration),
        envvars.HEARTBEAT_INTERVAL: ("heartbeat_interval", parse_duration),
        envvars.STREAMS_COMMIT_INTERVAL: ("streams_commit_interval", parse_duration),
        envvars.KAFKA_SECURITY_PROTOCOL: ("kafka_security_protocol", _upper),
        envvars.KAFKA_SASL_MECHANISM: ("kafka_sasl_mechanism", _upper),
        envvars.KAFKA_SASL_USERNAME: ("kafka_sasl_username", str),
        envvars.KAFKA_SASL_PASSWORD: ("kafka_sasl_password", str),
        envvars.KAFKA_SSL_CAFILE: ("kafka_ssl_cafile", str),
        envvars.KAFKA_SSL_CERTFILE: ("kafka_ssl_certfile", str),
        envvars.KAFKA_SSL_KEYFILE: ("kafka_ssl_keyfile", str),
        envvars.KAFKA_SSL_KEY_PASSWORD: ("kafka_ssl_key_password", str),
        envvars.KAFKA_BATCH_MAX_BYTES: ("kafka_batch_max_bytes", int),
        envvars.KAFKA_BATCH_MAX_RATIO: ("kafka_batch_max_ratio", float),
        envvars.KAFKA_CODECS: ("kafka_codecs", _codecs),
        envvars.TTL_RAW_DAYS: ("ttl_raw_days", int),
        envvars.TTL_AGGREGATE_DAYS: ("ttl_aggregate_days", int),
        envvars.SPAN_CAP: ("span_cap", int),
        envvars.SINK_CONTENT_MAX_CHARS: ("sink_content_max_chars", int),
        envvars.CLICKHOUSE_CLUSTER: ("clickhouse_cluster", str),
        envvars.SINK_RAW: ("sink_raw", _flag),
        envvars.FAULTS: ("faults", Faults.parse),
        envvars.ALERT_GRADER_FAILURE_RATE: ("alerts.grader_failure_rate", float),
        envvars.ALERT_GRADER_MIN_GRADED: ("alerts.grader_min_graded", int),
        envvars.ALERT_CLIPPED_RISING_STEPS: ("alerts.clipped_rising_steps", int),
        envvars.ALERT_REWARD_ZERO_FRACTION: ("alerts.reward_zero_fraction", float),
        envvars.ALERT_STALENESS_MAX: ("alerts.staleness_max", int),
        envvars.ALERT_XID_QUIET_AFTER: ("alerts.xid_quiet_after", parse_duration),
        envvars.ALERT_ENGINE_KV_USAGE: ("alerts.engine_kv_usage", float),
        envvars.ALERT_ENGINE_SATURATED_AFTER: ("alerts.engine_saturated_after", parse_duration),
    }

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **flags: object) -> Settings:
        """Build settings from ``flags`` (None values ignored), then ``env``, then defaults; the
        bootstrap's default is the broker recorded in the home, if one is, else 127.0.0.1:9092."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        alerts: dict[str, object] = {}
        for var, (field, parse) in cls._ENV.items():  # type: ignore[attr-defined]
            raw = env.get(var)
            if raw not in (None, ""):
                try:
                    parsed = parse(raw)
                except ValueError as exc:
                    raise ValueError(f"{var}: {exc}") from None
                if field.startswith("alerts."):
                    alerts[field.split(".", 1)[1]] = parsed
                else:
                    values[field] = parsed
        if alerts:
            values["alerts"] = AlertThresholds(**alerts)  # type: ignore[arg-type]
        for field, value in flags.items():
            if value is not None:
                if isinstance(value, (str, int, float)) and field in _DURATION_FIELDS:
                    values[field] = parse_duration(value)
                else:
                    values[field] = value
        if "kafka_bootstrap" not in values:
            # One home, one address: the broker this home started, on whatever port it listens,
            # comes before the default for a command given neither --bootstrap nor the variable.
            recorded = recorded_bootstrap(Path(values.get("home") or default_home()))  # type: ignore[arg-type]
            if recorded:
                values["kafka_bootstrap"] = recorded
        settings = cls(**values)  # type: ignore[arg-type]
        if settings.partitions < 1:
            raise ValueError(f"{envvars.PARTITIONS} must be at least 1")
        for var, value in ((envvars.SPAN_CAP, settings.span_cap), (envvars.SINK_CONTENT_MAX_CHARS,
                                                                    settings.sink_content_max_chars)):
            if not 0 <= value <= 1 << 30:  # a bound that still fits the SQL's UInt32 arithmetic
                raise ValueError(f"{var} must be from 0 (no cap) to {1 << 30}, got {value}")
        return settings

    def __post_init__(self) -> None:
        _check_kafka_security(self)
        _check_stall(self)
        _check_batches(self)

    def env(self) -> dict[str, str]:
        """The variables that give a child process these settings: every one of ``_ENV`` but the
        faults, which a test switches on for the one process it names (``Faults.env()``). The store
        is named in full (``clickhouse_dsn``) so the child opens this one; the passwords are
        included (a process's environment is its owner's only)."""
        out: dict[str, str] = {}
        for var, (field, parse) in self._ENV.items():  # type: ignore[attr-defined]
            if field == "faults":
                continue
            owner, _, name = field.rpartition(".")
            value = self.clickhouse_dsn if field == "clickhouse_url" else getattr(self.alerts if owner else self, name)
            out[var] = f"{value}s" if parse is parse_duration else ("1" if value else "0") if parse is _flag else str(value)
        return out

    def topic(self, name: str) -> str:
        """Full topic name for a short name such as ``spans`` or ``dlq``."""
        return f"{self.topic_prefix}.{name}"

    @property
    def app_id(self) -> str:
        """Faust application id (and consumer-group stem); derives from the topic prefix."""
        return f"{self.topic_prefix}-streams"

    @property
    def kafka_batch_codecs(self) -> tuple[str, ...]:
        """The record batch codecs consumers accept (``kafka_codecs``; none: an empty tuple)."""
        return tuple(c for c in _codecs(self.kafka_codecs).split(",") if c in BATCH_CODECS)

    @property
    def sink_group(self) -> str:
        return f"{self.topic_prefix}-sink"

    @property
    def clickhouse_dsn(self) -> str:
        return self.clickhouse_url or f"chdb://{self.home / 'clickhouse'}"

    def kafka_ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context of SSL and SASL_SSL (None otherwise): the broker's certificate checked
        against ``kafka_ssl_cafile`` (else the system's CAs) and its host name; the client
        certificate loaded when one is set. ValueError, naming the variable, for a file that
        cannot be loaded (never the key's password)."""
        if self.kafka_security_protocol not in ("SSL", "SASL_SSL"):
            return None
        try:
            context = ssl.create_default_context(cafile=self.kafka_ssl_cafile or None)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(
                f"{envvars.KAFKA_SSL_CAFILE}: cannot load CA certificates from {self.kafka_ssl_cafile}: {_ssl_reason(exc)}"
            ) from None
        if self.kafka_ssl_certfile:
            try:
                context.load_cert_chain(
                    self.kafka_ssl_certfile, self.kafka_ssl_keyfile or None, password=self.kafka_ssl_key_password or None
                )
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(
                    f"{envvars.KAFKA_SSL_CERTFILE}/{envvars.KAFKA_SSL_KEYFILE}: cannot load the client certificate "
                    f"{self.kafka_ssl_certfile} with key {self.kafka_ssl_keyfile or '(in the same file)'}: "
                    f"{_ssl_reason(exc)} (a wrong or missing {envvars.KAFKA_SSL_KEY_PASSWORD} reads so too)"
                ) from None
        return context

    def kafka_client_kwargs(self) -> dict[str, object]:
        """Keyword arguments for aiokafka clients: bootstrap servers and security settings.

        ``rlpulse.streams.app._credentials`` gives Faust the same settings in its own form."""
        kwargs: dict[str, object] = {"bootstrap_servers": self.kafka_bootstrap}
        if self.kafka_security_protocol != "PLAINTEXT":
            kwargs["security_protocol"] = self.kafka_security_protocol
            context = self.kafka_ssl_context()
            if context is not None:
                kwargs["ssl_context"] = context
            if self.kafka_security_protocol.startswith("SASL_"):
                kwargs["sasl_mechanism"] = self.kafka_sasl_mechanism
                kwargs["sasl_plain_username"] = self.kafka_sasl_username
                kwargs["sasl_plain_password"] = self.kafka_sasl_password
        return kwargs


KAFKA_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


def _ssl_reason(exc: Exception) -> str:
    return getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc)


def _check_kafka_security(s: Settings) -> None:
    """ValueError, naming the variable and never a secret, for Kafka security settings that cannot
    work: without this an aiokafka client would connect with no credentials while Faust used PLAIN."""
    protocol = s.kafka_security_protocol
    if protocol not in KAFKA_PROTOCOLS:
        raise ValueError(f"{envvars.KAFKA_SECURITY_PROTOCOL}: {protocol!r} is not one of {', '.join(KAFKA_PROTOCOLS)}")
    if protocol.startswith("SASL_"):
        if s.kafka_sasl_mechanism not in SASL_MECHANISMS:
            got = f"is {s.kafka_sasl_mechanism!r}" if s.kafka_sasl_mechanism else "is not set"
            raise ValueError(f"{envvars.KAFKA_SASL_MECHANISM} {got}: {protocol} needs one of {', '.join(SASL_MECHANISMS)}")
        for var, value in (
            (envvars.KAFKA_SASL_USERNAME, s.kafka_sasl_username),
            (envvars.KAFKA_SASL_PASSWORD, s.kafka_sasl_password),
        ):
            if not value:
                raise ValueError(f"{var} is not set: {protocol} with {s.kafka_sasl_mechanism} needs a username and a password")
    elif s.kafka_sasl_mechanism:
        raise ValueError(
            f"{envvars.KAFKA_SASL_MECHANISM} is {s.kafka_sasl_mechanism} but {envvars.KAFKA_SECURITY_PROTOCOL} "
            f"is {protocol}: SASL needs SASL_SSL (or SASL_PLAINTEXT)"
        )
    tls_files = (
        (envvars.KAFKA_SSL_CAFILE, s.kafka_ssl_cafile),
        (envvars.KAFKA_SSL_CERTFILE, s.kafka_ssl_certfile),
        (envvars.KAFKA_SSL_KEYFILE, s.kafka_ssl_keyfile),
    )
    for var, path in tls_files:
        if path and protocol not in ("SSL", "SASL_SSL"):
            raise ValueError(
                f"{var} is set but {envvars.KAFKA_SECURITY_PROTOCOL} is {protocol}: TLS files are used with SSL or SASL_SSL"
            )
        if path and not os.access(path, os.R_OK):
            raise ValueError(f"{var}: {path} does not exist or cannot be read")
    if s.kafka_ssl_keyfile and not s.kafka_ssl_certfile:
        raise ValueError(
            f"{envvars.KAFKA_SSL_KEYFILE} is set without {envvars.KAFKA_SSL_CERTFILE}: the key goes with a client certificate"
        )


def _check_stall(s: Settings) -> None:
    """The stall window's bounds make sense: positive, floor below ceiling, factor at least 1
    (below 1 every normal step would be later than its own window)."""
    for var, value in ((envvars.STALL_AFTER, s.stall_after), (envvars.STALL_MIN, s.stall_min),
                       (envvars.STALL_MAX, s.stall_max)):
        if not value > 0:
            raise ValueError(f"{var} must be a positive duration, got {value}s")
    if s.stall_min > s.stall_max:
        raise ValueError(f"{envvars.STALL_MIN} ({s.stall_min:g}s) is above {envvars.STALL_MAX} ({s.stall_max:g}s): "
                         f"the floor of a run's stall window must not exceed its ceiling")
    if not 1.0 <= s.stall_factor < float("inf"):
        raise ValueError(f"{envvars.STALL_FACTOR} must be a number of at least 1, got {s.stall_factor}")


def _check_batches(s: Settings) -> None:
    """The decompression bound makes sense: at least 1 MiB (below it the ratio never applies) and at
    most 2 GiB, a ratio of at least 1, codecs Kafka has."""
    if not 1 << 20 <= s.kafka_batch_max_bytes <= 1 << 31:
        raise ValueError(f"{envvars.KAFKA_BATCH_MAX_BYTES} must be from {1 << 20} (1 MiB) to {1 << 31} bytes, "
                         f"got {s.kafka_batch_max_bytes}")
    if not 1.0 <= s.kafka_batch_max_ratio < float("inf"):
        raise ValueError(f"{envvars.KAFKA_BATCH_MAX_RATIO} must be a number of at least 1, got {s.kafka_batch_max_ratio}")
    _codecs(s.kafka_codecs)


_DURATION_FIELDS = {"window", "allowed_lateness", "stall_after", "stall_min", "stall_max", "silent_after",
                    "heartbeat_interval", "streams_commit_interval"}
