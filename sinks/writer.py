"""Writes one table's batch of Avro containers to ClickHouse, with the retry policy.

The batch's messages are grouped by writer schema; each group is concatenated into one
container (``schemas.codec.concat``: blocks copied, nothing decoded) and ClickHouse decodes it
in one ``INSERT … SELECT`` (see ``sinks.avro_sql``). Retry policy, per insert:

* ClickHouse unreachable, or busy (too many parts, memory, timeouts): keep the rows, back off,
  retry for as long as it lasts. Nothing is dropped and the offsets stay uncommitted.
* ClickHouse rejects the data: split the group in halves by message, recursively, until the
  bad message stands alone; dead-letter it with ClickHouse's reason and insert the rest.
* Any other error: retried twice, then treated as a rejection.

Each insert carries an ``insert_deduplication_token`` naming its table, writer schema and
topic-partition-offset ranges, so a retried insert, or a replay cut at the same offsets,
leaves the rows as they were.
"""

from __future__ import annotations

import asyncio
import glob
import hashlib
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

from clickhouse_connect.driver.exceptions import DataError, OperationalError

from schemas.codec import Header, concat
from sinks.avro_sql import IncompatibleSchema, InsertPlan, Plans
from sinks.clickhouse import Store

log = logging.getLogger(__name__)

# ClickHouse error codes that say "not now" (busy: timeouts, memory, too many parts) or "the store
# is not ready" (unknown table or database, access denied, syntax) rather than "not this data":
# retried like an outage, so a dropped table or a bad deploy never dead-letters every message.
_BUSY_CODES = {159, 164, 202, 209, 210, 236, 241, 242, 252, 285, 319, 425, 439, 999,
               16, 60, 62, 81, 192, 194, 497, 516}
_CODE = re.compile(r"Code: (\d+)\.")


@dataclass(frozen=True)
class Entry:
    """A consumed message whose framing checked out: the record, its header and its record count."""

    msg: Any  # aiokafka ConsumerRecord (topic, partition, offset, key, value)
    header: Header
    records: int


DeadLetter = Callable[[Any, str], Awaitable[None]]


def token(table: str, schema_json: bytes, entries: list[Entry]) -> str:
    """The insert's deduplication token: table, writer schema, and each partition's offset range."""
    ranges: dict[tuple[str, int], list[int]] = {}
    for e in entries:
        span = ranges.setdefault((e.msg.topic, e.msg.partition), [e.msg.offset, e.msg.offset])
        span[0], span[1] = min(span[0], e.msg.offset), max(span[1], e.msg.offset)
    digest = hashlib.sha1(schema_json).hexdigest()[:12]
    return f"{table};{digest};" + ";".join(f"{t}:{p}:{a}-{b}" for (t, p), (a, b) in sorted(ranges.items()))


class Inserter:
    """Runs one INSERT of container bytes: chDB reads a private temp file, a server the request body."""

    def __init__(self, store: Store):
        self.store = store
        self.embedded = store.url.startswith("chdb:")
        self._dir = self._private_dir(store) if self.embedded else None
        self._seq = 0
        self._lock = threading.Lock()
        # Fault injection for the crash tests: SIGKILL this process after N inserts, before the commit.
        self._kill_after = int(os.environ.get("RLPULSE_FAULT_KILL_AFTER_INSERTS", "0") or 0)
        self.inserts = 0

    @staticmethod
    def _private_dir(store: Store) -> str:
        """chDB's client cannot take binary data with a statement, so each container goes through
        a file only this user can read (0600), in a directory only this user can list (0700).
        It lives in the store, which this process holds locked: files a killed sink left behind
        are removed here, and nobody else's temp directory fills up."""
        root = urlsplit(store.url).path
        for stale in glob.glob(os.path.join(glob.escape(root), "sink-tmp-*")):
            shutil.rmtree(stale, ignore_errors=True)
        return tempfile.mkdtemp(prefix="sink-tmp-", dir=root)

    def insert(self, plan: InsertPlan, data: bytes, dedup_token: str) -> None:
        """Blocking; run it in a thread. Raises what clickhouse-connect raises."""
        db = self.store.database
        if self.embedded:
            with self._lock:
                self._seq += 1
                path = os.path.join(self._dir, f"{self._seq}.avro")  # type: ignore[arg-type]
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                self.store.client.command(plan.sql_from_file(db, path, dedup_token))
            finally:
                os.unlink(path)
        else:
            self.store.client.command(plan.sql_from_input(db), data=data,
                                      settings={"insert_deduplication_token": dedup_token})
        self.inserts += 1
        if self._kill_after and self.inserts >= self._kill_after:
            log.warning("fault injection: SIGKILL after %d inserts, before the offset commit", self.inserts)
            os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:limit]


def _kind(exc: Exception) -> str:
    """'outage' (retry forever), 'rejected' (bisect) or 'other' (retry twice, then bisect)."""
    if isinstance(exc, OperationalError) or isinstance(exc, (ConnectionError, TimeoutError)):
        return "outage"
    if isinstance(exc, IncompatibleSchema):
        return "rejected"
    match = _CODE.search(str(exc))
    if match:
        return "outage" if int(match.group(1)) in _BUSY_CODES else "rejected"
    return "rejected" if isinstance(exc, (DataError, ValueError, TypeError)) else "other"


class TableWriter:
    """Writes batches of one table; rows ClickHouse rejects go to ``dead_letter`` one message each."""

    def __init__(self, table: str, inserter: Inserter, plans: Plans, dead_letter: DeadLetter,
                 max_backoff: float = 10.0):
        self.table = table
        self._inserter = inserter
        self._plans = plans
        self._dead_letter = dead_letter
        self._max_backoff = max_backoff
        self.rows = 0  # rows written (records in the messages inserted)
        self.dead_letters = 0

    async def write(self, entries: list[Entry]) -> None:
        """Insert ``entries``: one INSERT per writer schema among them (usually one)."""
        groups: dict[tuple[bytes, str], list[Entry]] = {}
        for e in entries:
            if e.records:  # an empty container has nothing to insert; its offset is still committed
                groups.setdefault((e.header.schema_json, e.header.codec), []).append(e)
        for (schema_json, _), group in groups.items():
            try:
                plan = self._plans.plan(self.table, group[0].header.name, schema_json)
            except IncompatibleSchema as exc:  # checked at intake too; kept for direct callers
                for e in group:
                    await self._reject(e, f"writer schema does not resolve: {exc}")
                continue
            await self._insert(plan, schema_json, group)

    async def _insert(self, plan: InsertPlan, schema_json: bytes, group: list[Entry]) -> None:
        backoff, others = 0.2, 0
        dedup = token(self.table, schema_json, group)
        data: bytes | None = None
        while True:
            try:
                if data is None:  # once, not on every retry; a failure here is classified like the insert's
                    data = concat([e.msg.value for e in group], [e.header for e in group])
                await asyncio.to_thread(self._inserter.insert, plan, data, dedup)
                self.rows += sum(e.records for e in group)
                return
            except Exception as exc:  # classified below: the driver raises many types
                kind = _kind(exc)
                if kind == "other":
                    others += 1
                    kind = "rejected" if others > 2 else "other"
                if kind == "rejected":
                    await self._bisect(plan, schema_json, group, exc)
                    return
                log.warning("insert of %d messages into %s failed (%s: %s); retrying in %.1fs",
                            len(group), self.table, type(exc).__name__, _first_line(exc, 200), backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff)

    async def _bisect(self, plan: InsertPlan, schema_json: bytes, group: list[Entry], exc: Exception) -> None:
        if len(group) == 1:
            await self._reject(group[0], f"ClickHouse rejected the {self.table} rows: {type(exc).__name__}: {_first_line(exc)}")
            return
        middle = len(group) // 2
        for half in (group[:middle], group[middle:]):
            await self._insert(plan, schema_json, half)

    async def _reject(self, entry: Entry, reason: str) -> None:
        msg = entry.msg
        log.warning("dead letter from %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, reason)
        await self._dead_letter(msg, reason)
        self.dead_letters += 1
