"""Writes one table's batch of Avro containers to ClickHouse, with the retry policy.

The batch's messages are grouped by writer schema; each group is concatenated into one
container (``rlpulse.schemas.codec.concat``: blocks copied, nothing decoded) and ClickHouse decodes it
in one ``INSERT … SELECT`` (see ``rlpulse.sinks.avro_sql``). Retry policy, per insert (:func:`classify`):

* ClickHouse rejects the data (a parse or type error, a value that does not fit, a corrupt Avro
  block: :data:`CONTENT_CODES`): split the group in halves by message, recursively, until the
  bad message stands alone; dead-letter it with ClickHouse's reason and insert the rest.
* ClickHouse unreachable, busy or not ready (too many parts, memory, read-only, timeouts, an
  unknown table): keep the rows, back off (doubling, capped), retry for as long as it lasts.
  The writer tells its ``on_retry`` hook, so the sink pauses consumption meanwhile; nothing is
  dropped and the offsets stay uncommitted.
* An insert that runs past its time limit (``limit_s``; ClickHouse's own ``max_execution_time``
  stops it cooperatively, the sink stops waiting a little later): its messages are inserted one
  at a time, and the one still too slow alone is dead-lettered with the reason. A stuck insert
  can never hold the sink, nor a stop (SIGTERM), for longer than its limit.
* Any other error is retried the same way, with a log line naming it every few tries. A good
  batch must never reach the dead-letter topic because of an error nobody classified: a stalled
  sink is visible (lag, log) and heals itself once the cause is fixed; dead-lettered rows would
  need a replay by hand. Only errors known to be about the data are dead-lettered.

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
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

from clickhouse_connect.driver.exceptions import DatabaseError, DataError, OperationalError

from rlpulse.schemas.codec import DecodeError, Header, concat
from rlpulse.schemas.faults import FAULTS_ENV, Faults
from rlpulse.sinks.avro_sql import IncompatibleSchema, InsertPlan, Plans
from rlpulse.sinks.clickhouse import Store

log = logging.getLogger(__name__)

# ClickHouse error codes that say "not this data": the rows cannot be parsed or do not fit the
# table. Only these dead-letter (after bisecting down to the message ClickHouse refuses).
CONTENT_CODES = {
    6: "CANNOT_PARSE_TEXT", 25: "CANNOT_PARSE_ESCAPE_SEQUENCE", 26: "CANNOT_PARSE_QUOTED_STRING",
    27: "CANNOT_PARSE_INPUT_ASSERTION_FAILED", 32: "ATTEMPT_TO_READ_AFTER_EOF", 33: "CANNOT_READ_ALL_DATA",
    38: "CANNOT_PARSE_DATE", 41: "CANNOT_PARSE_DATETIME", 53: "TYPE_MISMATCH", 69: "ARGUMENT_OUT_OF_BOUND",
    70: "CANNOT_CONVERT_TYPE", 72: "CANNOT_PARSE_NUMBER", 117: "INCORRECT_DATA", 128: "TOO_LARGE_ARRAY_SIZE",
    130: "CANNOT_READ_ARRAY_FROM_TEXT", 131: "TOO_LARGE_STRING_SIZE", 190: "SIZES_OF_ARRAYS_DONT_MATCH",
    321: "VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE", 349: "CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN",
    407: "DECIMAL_OVERFLOW", 691: "UNKNOWN_ELEMENT_OF_ENUM", 748: "AVRO_EXCEPTION",
}
# Codes that say "not now" (busy: timeouts, memory, too many parts, read-only) or "the store is
# not ready" (unknown table or database, access denied): an outage, retried for as long as it
# lasts, so a dropped table or a bad deploy never dead-letters every message.
OUTAGE_CODES = {
    159: "TIMEOUT_EXCEEDED", 164: "READONLY", 202: "TOO_MANY_SIMULTANEOUS_QUERIES", 209: "SOCKET_TIMEOUT",
    210: "NETWORK_ERROR", 236: "ABORTED", 241: "MEMORY_LIMIT_EXCEEDED", 242: "TABLE_IS_READ_ONLY",
    252: "TOO_MANY_PARTS", 285: "TOO_FEW_LIVE_REPLICAS", 319: "UNKNOWN_STATUS_OF_INSERT", 425: "SYSTEM_ERROR",
    439: "CANNOT_SCHEDULE_TASK", 999: "KEEPER_EXCEPTION", 16: "NO_SUCH_COLUMN_IN_TABLE", 60: "UNKNOWN_TABLE",
    81: "UNKNOWN_DATABASE", 192: "UNKNOWN_USER", 194: "REQUIRED_PASSWORD", 497: "ACCESS_DENIED",
    516: "AUTHENTICATION_FAILED",
}
_CODE = re.compile(r"\bCode:\s*(\d+)")
LOG_EVERY = 10  # a failing insert logs its first tries, then every LOG_EVERY-th


def error_code(exc: BaseException) -> int | None:
    """ClickHouse's error code of ``exc``: the driver's structured code, else the ``Code: N.`` in its text."""
    code = getattr(exc, "code", None)
    if isinstance(code, int):
        return code
    match = _CODE.search(str(exc))
    return int(match.group(1)) if match else None


class InsertTimeout(Exception):
    """An insert ran past its time limit and was stopped (or, in an engine that cannot stop it, left behind)."""


class InsertStillRunning(OSError):
    """An earlier insert that ran past its limit has not ended yet: an outage, retried until it has."""


SLOW_INSERT_MARK = b"rlpulse-fault:slow-insert"  # the bytes that trigger the slow_insert fault (rlpulse.schemas.faults)


def classify(exc: BaseException) -> str:
    """'rejected' (the rows: bisect and dead-letter), 'slow' (past the time limit: one message at a
    time, dead-letter the one too slow alone), 'outage' (known: retry) or 'unknown' (retry, logged as such)."""
    if isinstance(exc, InsertTimeout):
        return "slow"
    if isinstance(exc, (IncompatibleSchema, DecodeError, DataError)):
        return "rejected"  # our own checks of the container, or the driver's of the data
    code = error_code(exc)
    if code in CONTENT_CODES:
        return "rejected"
    if code in OUTAGE_CODES or isinstance(exc, OSError):  # OSError: refused, reset, timed out, disk full
        return "outage"
    # The driver raises OperationalError for a transport failure (no code) or a retried request.
    return "outage" if isinstance(exc, OperationalError) and code is None else "unknown"


class InsertFault:
    """The ``insert_error`` fault injected on purpose for the tests (``rlpulse.schemas.faults``):
    ``RLPULSE_FAULTS="insert_error=252:3"`` makes the first 3 inserts raise the error ClickHouse
    raises for code 252 (TOO_MANY_PARTS), in the real insert path, before ClickHouse is called;
    ``insert_error=252`` makes every insert raise it."""

    def __init__(self, code: int, count: int | None = None):
        self.code, self.left = code, count

    @classmethod
    def from_faults(cls, faults: Faults) -> "InsertFault | None":
        code = faults.insert_error_code
        return None if code is None else cls(code, faults.insert_error_count)

    def maybe_raise(self) -> None:
        if self.left is not None:
            if self.left <= 0:
                return
            self.left -= 1
        name = OUTAGE_CODES.get(self.code) or CONTENT_CODES.get(self.code) or "UNCLASSIFIED"
        raise DatabaseError(f"Code: {self.code}. DB::Exception: fault injected on purpose ({FAULTS_ENV} insert_error). "
                            f"({name})", code=self.code, name=name)


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


class Inserter(ABC):
    """Runs one INSERT of container bytes on a daemon thread; one subclass per backend, as each
    hands ClickHouse the bytes its own way (:func:`inserter_for` picks it by the store's URL).

    ``faults`` (``Settings.faults``) are the faults injected on purpose by the fault tests:
    ``insert_error`` raises a ClickHouse error for the first inserts, ``kill_after_inserts``
    SIGKILLs this process after its N-th insert, before the offset commit, ``slow_insert`` hangs
    an insert of a marked container.

    ``limit_s`` bounds each insert's time: ClickHouse is asked to stop it at ``limit_s``
    (``max_execution_time``, checked between blocks) and :meth:`run` stops waiting
    :data:`STOP_GRACE_S` later, raising :class:`InsertTimeout`.
    """

    STOP_GRACE_S = 2.0

    def __init__(self, store: Store, faults: Faults | None = None, limit_s: float = 30.0):
        faults = faults or Faults()
        self.store = store
        self.limit_s = limit_s
        self._running: threading.Thread | None = None
        self._given_up: threading.Thread | None = None  # the last insert whose wait ran out or was cancelled
        self._cancel = threading.Event()  # set: the running insert was given up; not sent if not sent yet
        self._kill_after = faults.kill_after_inserts
        self._fault = InsertFault.from_faults(faults)
        self._slow = faults.slow_insert
        self.inserts = 0

    @abstractmethod
    def _send(self, plan: InsertPlan, data: bytes, dedup_token: str) -> None:
        """Have ClickHouse run ``plan`` on ``data``. Blocking."""

    def _cleanup(self) -> None:
        """Remove what the backend keeps between inserts (close() calls it once nothing runs)."""

    def insert(self, plan: InsertPlan, data: bytes, dedup_token: str, cancel: threading.Event | None = None) -> None:
        """Blocking. Raises what clickhouse-connect raises."""
        if self._fault is not None:
            self._fault.maybe_raise()
        if self._slow and SLOW_INSERT_MARK in data:
            log.warning("fault injection: this insert hangs %ds", self._slow)
            if cancel is not None and cancel.wait(self._slow):  # stopped, as ClickHouse stops a query
                raise InsertTimeout("stopped while it hung (fault injection)")
        if cancel is not None and cancel.is_set():
            raise InsertTimeout("given up before it was sent")
        self._send(plan, data, dedup_token)
        self.inserts += 1
        if self._kill_after and self.inserts >= self._kill_after:
            log.warning("fault injection: SIGKILL after %d inserts, before the offset commit", self.inserts)
            os.kill(os.getpid(), signal.SIGKILL)

    async def run(self, plan: InsertPlan, data: bytes, dedup_token: str) -> None:
        """:meth:`insert` on a daemon thread, for at most ``limit_s`` (then :class:`InsertTimeout`).
        A stopping sink may abandon the wait sooner; :meth:`close` then waits a bounded time."""
        given_up = self._given_up
        if given_up is not None and given_up.is_alive():  # an insert given up still runs in the engine
            raise InsertStillRunning("an earlier insert that ran past its limit is still running")
        loop = asyncio.get_running_loop()
        cancel = self._cancel = threading.Event()
        future: asyncio.Future[None] = loop.create_future()

        def settle(error: BaseException | None) -> None:
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(None)

        def work() -> None:
            error = None
            try:
                self.insert(plan, data, dedup_token, cancel)
            except BaseException as exc:  # handed to the awaiting task
                error = exc
            try:
                loop.call_soon_threadsafe(settle, error)
            except RuntimeError:  # the loop is closed: the sink stopped and nobody waits
                pass

        thread = threading.Thread(target=work, name="rlpulse-insert", daemon=True)
        self._running = thread
        started = loop.time()
        thread.start()
        try:
            await asyncio.wait_for(asyncio.shield(future), self.limit_s + self.STOP_GRACE_S)
        except asyncio.TimeoutError:
            cancel.set()
            self._given_up = thread
            raise InsertTimeout(f"insert ran past its limit of {self.limit_s:g}s and was stopped") from None
        except asyncio.CancelledError:  # the sink gave up the checkpoint: nothing more is sent for it
            cancel.set()
            self._given_up = thread
            raise
        except Exception as exc:
            if error_code(exc) == 159 and loop.time() - started >= 0.9 * self.limit_s:  # our max_execution_time
                raise InsertTimeout(f"insert ran past its limit of {self.limit_s:g}s and ClickHouse stopped it") from exc
            raise

    def close(self, wait_s: float = 1.0) -> bool:
        """Stop what runs and remove the temp files; False when an insert is still running after
        ``wait_s`` (an engine stuck inside a statement). It is left behind: a stop must not wait
        on it (its checkpoint is not committed, so its messages are read again)."""
        self._cancel.set()
        running = self._running
        if running is not None and running.is_alive():
            running.join(wait_s)
            if running.is_alive():
                log.error("an insert is still running %.0fs after the stop; left behind uncommitted", wait_s)
                return False
        self._cleanup()
        return True


class ChdbInserter(Inserter):
    """chDB: the statement reads the container from a private temp file."""

    def __init__(self, store: Store, faults: Faults | None = None, limit_s: float = 30.0):
        super().__init__(store, faults, limit_s)
        self._dir: str | None = self._private_dir(store)
        self._seq = 0
        self._lock = threading.Lock()

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

    def _send(self, plan: InsertPlan, data: bytes, dedup_token: str) -> None:
        with self._lock:
            self._seq += 1
            path = os.path.join(self._dir, f"{self._seq}.avro")  # type: ignore[arg-type]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            # ClickHouse stops the statement itself at the limit (checked between blocks)
            sql = plan.sql_from_file(self.store.database, path, dedup_token) + f", max_execution_time = {self.limit_s:g}"
            self.store.client.command(sql)
        finally:
            os.unlink(path)

    def _cleanup(self) -> None:
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


class HttpInserter(Inserter):
    """A ClickHouse server: the container is the request body (``INSERT … FROM input()``)."""

    def _send(self, plan: InsertPlan, data: bytes, dedup_token: str) -> None:
        self.store.client.command(plan.sql_from_input(self.store.database), data=data,
                                  settings={"insert_deduplication_token": dedup_token, "max_execution_time": self.limit_s})


def inserter_for(store: Store, faults: Faults | None = None, limit_s: float = 30.0) -> Inserter:
    """The inserter of ``store``'s backend: chDB for a ``chdb:`` URL, else a server over HTTP."""
    return (ChdbInserter if store.url.startswith("chdb:") else HttpInserter)(store, faults, limit_s)


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:limit]


def describe(exc: BaseException, limit: int = 200) -> str:
    """``Type NAME (code N): first line`` (the URL a driver error may name carries no password)."""
    code = error_code(exc)
    if code is None:
        return f"{type(exc).__name__}: {_first_line(exc, limit)}"
    name = getattr(exc, "name", None) or OUTAGE_CODES.get(code) or CONTENT_CODES.get(code) or "error"
    return f"{type(exc).__name__} {name} (code {code}): {_first_line(exc, limit)}"


@dataclass(frozen=True)
class Backoff:
    """Seconds before retry ``n`` (from 1): ``first`` doubling up to ``cap``."""

    first: float = 0.2
    cap: float = 10.0

    def delay(self, n: int) -> float:
        return min(self.first * 2 ** min(n - 1, 30), self.cap)


class TableWriter:
    """Writes batches of one table; rows ClickHouse rejects go to ``dead_letter`` one message each.

    ``on_retry(table, tries, error)`` is called before each back-off of a failing insert: the
    sink pauses consumption until the checkpoint being written is in.
    """

    def __init__(self, table: str, inserter: Inserter, plans: Plans, dead_letter: DeadLetter,
                 backoff: Backoff | None = None, on_retry: Callable[[str, int, BaseException], None] | None = None):
        self.table = table
        self._inserter = inserter
        self._plans = plans
        self._dead_letter = dead_letter
        self._backoff = backoff or Backoff()
        self._on_retry = on_retry
        self.rows = 0  # rows written (records in the messages inserted)
        self.dead_letters = 0
        self.retries = 0  # failed inserts retried (outages and unknown errors)

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
        tries = 0
        dedup = token(self.table, schema_json, group)
        data: bytes | None = None
        loop = asyncio.get_running_loop()
        started = loop.time()
        while True:
            try:
                if data is None:  # once, not on every retry; a failure here is classified like the insert's
                    data = concat([e.msg.value for e in group], [e.header for e in group])
                await self._inserter.run(plan, data, dedup)
            except Exception as exc:  # classified below: the driver raises many types
                kind = classify(exc)
                if kind == "rejected":
                    await self._bisect(plan, schema_json, group, exc)
                    return
                if kind == "slow":
                    await self._one_at_a_time(plan, schema_json, group, exc)
                    return
                tries += 1
                self.retries += 1
                delay = self._backoff.delay(tries)
                if self._on_retry is not None:
                    self._on_retry(self.table, tries, exc)
                if tries <= 3 or tries % LOG_EVERY == 0:
                    what = ("ClickHouse refused" if kind == "outage" else
                            "unclassified error (retried as an outage, never dead-lettered)")
                    log.warning("insert of %d messages into %s: %s: %s; try %d failed, %.1fs so far; retrying in %.1fs "
                                "(consumption paused, offsets not committed)", len(group), self.table, what,
                                describe(exc), tries, loop.time() - started, delay)
                await asyncio.sleep(delay)
                continue
            self.rows += sum(e.records for e in group)
            if tries:
                log.info("insert of %d messages into %s succeeded after %d failed tries in %.1fs",
                         len(group), self.table, tries, loop.time() - started)
            return

    async def _bisect(self, plan: InsertPlan, schema_json: bytes, group: list[Entry], exc: Exception) -> None:
        if len(group) == 1:
            await self._reject(group[0], f"ClickHouse rejected the {self.table} rows: {type(exc).__name__}: {_first_line(exc)}")
            return
        middle = len(group) // 2
        for half in (group[:middle], group[middle:]):
            await self._insert(plan, schema_json, half)

    async def _one_at_a_time(self, plan: InsertPlan, schema_json: bytes, group: list[Entry], exc: Exception) -> None:
        """An insert past its limit: each message alone (not halves: each half holding the slow one
        would cost a whole limit again); the one too slow alone is dead-lettered."""
        if len(group) == 1:
            await self._reject(group[0], f"{self.table} insert stopped: {exc}")
            return
        log.warning("insert of %d messages into %s: %s; inserting them one at a time", len(group), self.table, exc)
        for entry in group:
            await self._insert(plan, schema_json, [entry])

    async def _reject(self, entry: Entry, reason: str) -> None:
        msg = entry.msg
        log.warning("dead letter from %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, reason)
        await self._dead_letter(msg, reason)
        self.dead_letters += 1
