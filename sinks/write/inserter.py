"""Runs one INSERT of container bytes, bounded in time, on a thread; one class per backend.

Used by ``rlpulse.sinks.write.writer`` (which decides what to do with each error): ClickHouse's error
codes and how to read them, the insert's time limit (:class:`InsertTimeout`), and the faults
injected on purpose in the real insert path (``rlpulse.base.faults``).
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
from abc import ABC, abstractmethod
from urllib.parse import urlsplit

from clickhouse_connect.driver.exceptions import DatabaseError

from rlpulse.base.faults import FAULTS_ENV, Faults
from rlpulse.sinks.store.avro_sql import InsertPlan
from rlpulse.sinks.store.clickhouse import Store
from rlpulse.base.errors import Error

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


def error_code(exc: BaseException) -> int | None:
    """ClickHouse's error code of ``exc``: the driver's structured code, else the ``Code: N.`` in its text."""
    code = getattr(exc, "code", None)
    if isinstance(code, int):
        return code
    match = _CODE.search(str(exc))
    return int(match.group(1)) if match else None


class InsertTimeout(Error):
    """An insert ran past its time limit and was stopped (or, in an engine that cannot stop it, left behind)."""


class InsertStillRunning(Error, OSError):
    """An earlier insert that ran past its limit has not ended yet: an outage, retried until it has."""


SLOW_INSERT_MARK = b"rlpulse-fault:slow-insert"  # the bytes that trigger the slow_insert fault (rlpulse.base.faults)


class InsertFault:
    """The ``insert_error`` fault injected on purpose for the tests (``rlpulse.base.faults``):
    ``RLPULSE_FAULTS="insert_error=252:3"`` makes the first 3 inserts raise the error ClickHouse
    raises for code 252 (TOO_MANY_PARTS), in the real insert path, before ClickHouse is called;
    ``insert_error=252`` makes every insert raise it."""

    def __init__(self, code: int, count: int | None = None):
        self.code, self.left = code, count

    @classmethod
    def from_faults(cls, faults: Faults) -> InsertFault | None:
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


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


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

    def _cleanup(self) -> None:  # noqa: B027 - an optional hook: most backends keep nothing
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
            future.add_done_callback(_retrieved)  # what it ends with, nobody awaits: not an unretrieved error
            raise InsertTimeout(f"insert ran past its limit of {self.limit_s:g}s and was stopped") from None
        except asyncio.CancelledError:  # the sink gave up the checkpoint: nothing more is sent for it
            cancel.set()
            self._given_up = thread
            future.add_done_callback(_retrieved)
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
