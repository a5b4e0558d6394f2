"""Settings: flags, then ``RLPULSE_*`` environment variables, then defaults.

One immutable :class:`Settings` object is built at the edge (CLI, test fixture) and passed
down; nothing reads the environment behind the caller's back.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Mapping

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


def _default_home(package_dir: Path | None = None, env: Mapping[str, str] | None = None) -> Path:
    """``<checkout>/.rlpulse`` when running from a source checkout, else ``$XDG_DATA_HOME/rlpulse``
    (``~/.local/share/rlpulse``). One home per checkout: ``make`` and a bare ``rlpulse`` run there
    find the same broker and the same chDB store."""
    root = checkout_root(package_dir)
    if root is not None:
        return root / ".rlpulse"
    env = os.environ if env is None else env
    base = env.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "rlpulse"


# What rlpulse and the processes it starts create (the chDB store, the broker's data, logs, pid
# files) is the owner's only: the store holds every run's data, the logs name hosts and runs.
PRIVATE_UMASK = 0o077


def private_dir(path: Path) -> Path:
    """``path`` (and missing parents) as a directory only its owner can enter, whatever the umask.

    An existing directory is tightened too: one made by an older version with 0755 stops
    exposing what is in it.
    """
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):  # Path.mkdir(parents=True) would make the parents with the umask's mode
        folder.mkdir(mode=0o700, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


def private_file(path: Path, append: bool = True) -> int:
    """An fd of ``path`` opened for writing, created (or tightened) to 0600 for its owner alone."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o600)
    if os.fstat(fd).st_mode & 0o077:
        os.fchmod(fd, 0o600)
    return fd


@dataclasses.dataclass(frozen=True)
class AlertThresholds:
    """When the stream alert rules fire (each fires once per episode and resolves once)."""

    grader_failure_rate: float = 0.2  # failures / graded of a term in one window, above this fires
    grader_min_graded: int = 10  # a window with fewer scores than this never fires
    clipped_rising_steps: int = 3  # clipped ratio rising over this many consecutive steps fires
    reward_zero_fraction: float = 0.5  # a step whose rewards are this often <= 0 fires
    xid_quiet_after: float = 900.0  # an XID alert resolves after this long without a new XID


@dataclasses.dataclass(frozen=True)
class Settings:
    kafka_bootstrap: str = "127.0.0.1:9092"
    clickhouse_url: str = ""  # empty: a chDB store under ``home``
    topic_prefix: str = "rlpulse"
    home: Path = dataclasses.field(default_factory=_default_home)
    partitions: int = 2
    window: float = 60.0
    allowed_lateness: float = 10.0
    stall_after: float = 900.0
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
    alerts: AlertThresholds = dataclasses.field(default_factory=AlertThresholds)
    ttl_raw_days: int = 90  # spans, steps, GPU samples, placements
    ttl_aggregate_days: int = 365  # windows, step figures, histograms, alerts

    # Environment variable -> field, with the parser for its text.
    _ENV = {
        "RLPULSE_KAFKA_BOOTSTRAP": ("kafka_bootstrap", str),
        "RLPULSE_CLICKHOUSE_URL": ("clickhouse_url", str),
        "RLPULSE_TOPIC_PREFIX": ("topic_prefix", str),
        "RLPULSE_HOME": ("home", Path),
        "RLPULSE_PARTITIONS": ("partitions", int),
        "RLPULSE_WINDOW": ("window", parse_duration),
        "RLPULSE_ALLOWED_LATENESS": ("allowed_lateness", parse_duration),
        "RLPULSE_STALL_AFTER": ("stall_after", parse_duration),
        "RLPULSE_SILENT_AFTER": ("silent_after", parse_duration),
        "RLPULSE_HEARTBEAT_INTERVAL": ("heartbeat_interval", parse_duration),
        "RLPULSE_STREAMS_COMMIT_INTERVAL": ("streams_commit_interval", parse_duration),
        "RLPULSE_KAFKA_SECURITY_PROTOCOL": ("kafka_security_protocol", str),
        "RLPULSE_KAFKA_SASL_MECHANISM": ("kafka_sasl_mechanism", str),
        "RLPULSE_KAFKA_SASL_USERNAME": ("kafka_sasl_username", str),
        "RLPULSE_KAFKA_SASL_PASSWORD": ("kafka_sasl_password", str),
        "RLPULSE_KAFKA_SSL_CAFILE": ("kafka_ssl_cafile", str),
        "RLPULSE_TTL_RAW_DAYS": ("ttl_raw_days", int),
        "RLPULSE_TTL_AGGREGATE_DAYS": ("ttl_aggregate_days", int),
        "RLPULSE_ALERT_GRADER_FAILURE_RATE": ("alerts.grader_failure_rate", float),
        "RLPULSE_ALERT_GRADER_MIN_GRADED": ("alerts.grader_min_graded", int),
        "RLPULSE_ALERT_CLIPPED_RISING_STEPS": ("alerts.clipped_rising_steps", int),
        "RLPULSE_ALERT_REWARD_ZERO_FRACTION": ("alerts.reward_zero_fraction", float),
        "RLPULSE_ALERT_XID_QUIET_AFTER": ("alerts.xid_quiet_after", parse_duration),
    }

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **flags: object) -> "Settings":
        """Build settings from ``flags`` (None values ignored), then ``env``, then defaults."""
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
                values[field] = parse_duration(value) if field in _DURATION_FIELDS else value
        settings = cls(**values)  # type: ignore[arg-type]
        if settings.partitions < 1:
            raise ValueError("RLPULSE_PARTITIONS must be at least 1")
        return settings

    def topic(self, name: str) -> str:
        """Full topic name for a short name such as ``spans`` or ``dlq``."""
        return f"{self.topic_prefix}.{name}"

    @property
    def app_id(self) -> str:
        """Faust application id (and consumer-group stem); derives from the topic prefix."""
        return f"{self.topic_prefix}-streams"

    @property
    def sink_group(self) -> str:
        return f"{self.topic_prefix}-sink"

    @property
    def clickhouse_dsn(self) -> str:
        return self.clickhouse_url or f"chdb://{self.home / 'clickhouse'}"

    def kafka_client_kwargs(self) -> dict[str, object]:
        """Keyword arguments for aiokafka clients: bootstrap servers and security settings."""
        kwargs: dict[str, object] = {"bootstrap_servers": self.kafka_bootstrap}
        if self.kafka_security_protocol != "PLAINTEXT":
            kwargs["security_protocol"] = self.kafka_security_protocol
            if self.kafka_security_protocol in ("SSL", "SASL_SSL"):
                from aiokafka.helpers import create_ssl_context

                kwargs["ssl_context"] = create_ssl_context(cafile=self.kafka_ssl_cafile or None)
            if self.kafka_sasl_mechanism:
                kwargs["sasl_mechanism"] = self.kafka_sasl_mechanism
                kwargs["sasl_plain_username"] = self.kafka_sasl_username
                kwargs["sasl_plain_password"] = self.kafka_sasl_password
        return kwargs


_DURATION_FIELDS = {"window", "allowed_lateness", "stall_after", "silent_after", "heartbeat_interval",
                    "streams_commit_interval"}
