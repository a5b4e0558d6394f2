"""Opening ClickHouse through clickhouse-connect: chDB in-process (``chdb:///path``) or a server URL.

chDB lets one process open a store at a time, so the process that opens one holds an
exclusive lock file in it and a second process gets a clear error naming the holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import clickhouse_connect

from rlpulse.base import env as envvars
from rlpulse.base.files import private_dir
from rlpulse.base.errors import Error
from rlpulse.base.urls import mask_url, split_url

MIGRATIONS = Path(__file__).parent / "migrations"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class StoreBusyError(Error, RuntimeError):
    """The chDB store is open in another process."""


class NoDataError(Error, RuntimeError):
    """The store has none of the data asked for (no rlpulse database yet, no rows of a run)."""


def no_data(store: Store, why: str) -> NoDataError:
    """The error for a store nothing was written to yet, with what fills one."""
    return NoDataError(f"{store.url} has no data yet ({why}). Run `rlpulse demo`, or the pipeline (`rlpulse streams`, "
                       f"`rlpulse sink`); or set {envvars.HOME} / {envvars.CLICKHOUSE_URL} to the store that has your data")


def require_database(store: Store) -> None:
    """NoDataError unless the store has the pipeline's database (an empty store has none until a sink or migrate ran)."""
    found = store.client.query("SELECT count() FROM system.databases WHERE name = {db:String}",
                               parameters={"db": store.database}).result_rows[0][0]
    if not found:
        raise no_data(store, f"no database {store.database}")


@contextlib.contextmanager
def _quiet(*loggers: str):
    """Silence the driver's own warnings for a failure this module reports in one line itself."""
    saved = [(logging.getLogger(name), logging.getLogger(name).level) for name in loggers]
    for logger, _ in saved:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


def _connect_reason(exc: BaseException) -> str:
    """Why a connection to a server failed, in words, without the URL (the driver's text may carry it)."""
    text = str(exc)
    if "Connection refused" in text:
        return "connection refused (is the server running, on that host and port?)"
    if "Name or service not known" in text or "Failed to resolve" in text or "nodename nor servname" in text:
        return "unknown host"
    if "AUTHENTICATION_FAILED" in text or "Authentication failed" in text or re.search(r"status 40[13]\b", text):
        return "authentication failed (check the user and password)"
    if "timed out" in text.lower() or "Timeout" in text:
        return "no answer (timed out)"
    status = re.search(r"HTTP status (\d+)", text)
    if status:
        return f"HTTP status {status.group(1)} (is that a ClickHouse server's HTTP port?)"
    return type(exc).__name__


@dataclass
class Store:
    """A ClickHouse connection and the database the pipeline uses."""

    client: Any
    database: str
    url: str  # with any password masked; safe to print
    _lock_fd: int | None = None
    endpoint: str | None = None  # the owner's read endpoint, when the chDB store is read through it

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _lock_store(path: Path, owner: str) -> int:
    private_dir(path)  # the store is every run's data: its owner's only (chDB's own files follow the umask)
    lock_path = path / "rlpulse.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    if os.fstat(fd).st_mode & 0o077:  # a lock file made 0644 by an older version
        os.fchmod(fd, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise StoreBusyError(
            f"the chDB store {path} is open in {holder}; chDB allows one process per store. "
            f"Stop that process, or point {envvars.CLICKHOUSE_URL} at a ClickHouse server."
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} ({owner})".encode(), 0)
    return fd


def open_store(dsn: str, owner: str = "rlpulse", database: str | None = None) -> Store:
    """Connect to ``dsn``; ``owner`` names this process in the chDB lock so a second one can say who holds it."""
    parts = split_url(dsn, envvars.CLICKHOUSE_URL)  # a URL that cannot be read: a ValueError quoting none of it
    if parts.scheme == "chdb":
        path = Path(parts.path)
        fd = _lock_store(path, owner)
        try:
            client = clickhouse_connect.get_client(dsn=f"chdb://{path}")
        except Exception:
            os.close(fd)
            raise
        # a chDB URL names a local path and holds no credentials; the sink reads that path from store.url
        return Store(client=client, database=database or "rlpulse", url=dsn, _lock_fd=fd)
    if parts.scheme in ("http", "https", "clickhouse"):
        db = database or parts.path.strip("/") or "rlpulse"
        try:
            with _quiet("clickhouse_connect", "urllib3"):
                client = clickhouse_connect.get_client(dsn=urlunsplit(parts._replace(path="/default")))
        except Exception as exc:
            # The driver's message can carry the URL; re-raise with the password masked and a reason of our own.
            raise ConnectionError(f"cannot connect to ClickHouse at {mask_url(dsn)}: {_connect_reason(exc)}. Check "
                                  f"{envvars.CLICKHOUSE_URL} (or --clickhouse-url)") from None
        return Store(client=client, database=db, url=mask_url(dsn))
    raise ValueError(f"{envvars.CLICKHOUSE_URL}: unsupported scheme {parts.scheme!r}; use chdb:///path or http://user:pass@host:8123/db")


def open_reader(dsn: str, owner: str = "rlpulse") -> Store:
    """Open ``dsn`` for read-only work (query, report, watch).

    A chDB store held by a sink is reached through the sink's read endpoint
    (``rlpulse.sinks.read.read_endpoint``): the Store's client is then a clickhouse-connect HTTP client on
    loopback, and ``store.endpoint`` its URL. A free store is opened directly; one held by a
    process that serves no reads (``rlpulse migrate``) raises StoreBusyError.
    """
    try:
        return open_store(dsn, owner=owner)
    except StoreBusyError:
        from rlpulse.sinks.store.endpoint_file import find_endpoint

        found = find_endpoint(Path(urlsplit(dsn).path))
        if found is None:
            raise
    url = found.url
    parts = urlsplit(url)
    try:
        client = clickhouse_connect.get_client(host=parts.hostname, port=parts.port, username=found.user,
                                               password=found.password)
    except Exception as exc:
        raise StoreBusyError(f"the chDB store {urlsplit(dsn).path} is held by a sink whose read endpoint "
                             f"{mask_url(url)} does not answer ({type(exc).__name__}); is the sink still running?") from None
    return Store(client=client, database="rlpulse", url=dsn, endpoint=url)


def migrate(store: Store, ttl_raw_days: int = 90, ttl_aggregate_days: int = 365, until: str | None = None,
            cluster: str = "") -> list[str]:
    """Apply the numbered migrations not yet recorded; safe to run twice. Returns those applied now.

    The TTLs (raw events, aggregates) apply to the tables a migration creates; change them on
    existing tables with ``ALTER TABLE … MODIFY TTL``. ``until`` (a migration's name) stops
    after that one: a test can build an old store and migrate it forward. ``cluster`` (a
    ``remote_servers`` name) runs each statement in its cluster form (``rlpulse.sinks.store.cluster_ddl``):
    replicated ``<table>_local`` parts and a Distributed table under each table's own name.
    """
    from rlpulse.sinks.store import cluster_ddl
    db = store.database
    if not _NAME.match(db):
        raise ValueError(f"invalid database name {db!r}")
    if cluster:
        cluster_ddl.check_name(f"cluster ({envvars.CLICKHOUSE_CLUSTER})", cluster)
    client = store.client
    for statement in cluster_ddl.bootstrap_statements(db, cluster) if cluster else bootstrap_statements(db):
        client.command(statement)
    done = {row[0] for row in client.query(f"SELECT version FROM {db}.schema_migrations").result_rows}
    applied = []
    for path in sorted(MIGRATIONS.glob("*.sql")):
        if until is not None and path.stem > until:
            break
        if path.stem in done:
            continue
        for statement in migration_statements(path, db, ttl_raw_days, ttl_aggregate_days, cluster):
            client.command(statement)
        client.insert(f"{db}.schema_migrations", [[path.stem]], column_names=["version"])
        applied.append(path.stem)
    return applied


def bootstrap_statements(db: str) -> list[str]:
    """What migrate() runs before any migration: the database and the table recording the applied ones."""
    return [f"CREATE DATABASE IF NOT EXISTS {db}",
            f"CREATE TABLE IF NOT EXISTS {db}.schema_migrations (version String, applied_at DateTime DEFAULT now()) "
            "ENGINE = ReplacingMergeTree ORDER BY version"]


def migration_statements(path: Path, db: str, ttl_raw_days: int = 90, ttl_aggregate_days: int = 365,
                         cluster: str = "") -> list[str]:
    """The statements of migration file ``path`` as migrate() runs them (the compose stack's sink user
    must be granted what these need: deploy/clickhouse/users.d/rlpulse.xml); with ``cluster``, their
    ON CLUSTER forms (``rlpulse.sinks.store.cluster_ddl``)."""
    sql = path.read_text().replace("{db}", db).replace("{ttl_raw_days}", str(int(ttl_raw_days)))
    statements = _statements(sql.replace("{ttl_aggregate_days}", str(int(ttl_aggregate_days))))
    if not cluster:
        return statements
    from rlpulse.sinks.store.cluster_ddl import cluster_statements

    return [out for statement in statements for out in cluster_statements(statement, cluster)]


def table_columns(store: Store) -> dict[str, dict[str, str]]:
    """Each table of the database: the columns an INSERT may name, with their types, in order."""
    rows = store.client.query(
        "SELECT table, name, type FROM system.columns WHERE database = {db:String} "
        "AND default_kind NOT IN ('MATERIALIZED', 'ALIAS') ORDER BY table, position",
        parameters={"db": store.database}).result_rows
    out: dict[str, dict[str, str]] = {}
    for table, name, type_ in rows:
        out.setdefault(table, {})[name] = type_
    return out


def _statements(sql: str) -> list[str]:
    lines = [line for line in sql.splitlines() if not line.strip().startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]
