"""Writes one table's batch of Avro containers to ClickHouse, with the retry policy.

The batch's messages are grouped by writer schema; each group is concatenated into one
container (``rlpulse.schemas.codec.concat``: blocks copied, nothing decoded) and ClickHouse decodes it
in one ``INSERT … SELECT`` (see ``rlpulse.sinks.store.avro_sql``). Retry policy, per insert (:func:`classify`):

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
import hashlib
import logging
from dataclasses import dataclass
from typing import Any
from collections.abc import Awaitable, Callable

from clickhouse_connect.driver.exceptions import DataError, OperationalError

from rlpulse.schemas.codec import DecodeError, Header, concat
from rlpulse.sinks.store.avro_sql import IncompatibleSchema, InsertPlan, Plans
from rlpulse.sinks.write.content_bounds import Bounds, bounded_plan
# The inserters (one per backend, bounded in time) and ClickHouse's error codes live in
# rlpulse.sinks.write.inserter; named here too, as the sink and the tests import them from the writer.
from rlpulse.sinks.write.inserter import (CONTENT_CODES, OUTAGE_CODES, SLOW_INSERT_MARK, ChdbInserter, HttpInserter,
                                    Inserter, InsertFault, InsertStillRunning, InsertTimeout, error_code, inserter_for)

__all__ = ["CONTENT_CODES", "OUTAGE_CODES", "SLOW_INSERT_MARK", "Backoff", "ChdbInserter", "Entry", "HttpInserter",
           "InsertFault", "InsertStillRunning", "InsertTimeout", "Inserter", "TableWriter", "classify", "describe",
           "error_code", "inserter_for", "token"]

log = logging.getLogger(__name__)

LOG_EVERY = 10  # a failing insert logs its first tries, then every LOG_EVERY-th


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
                 backoff: Backoff | None = None, on_retry: Callable[[str, int, BaseException], None] | None = None,
                 bounds: Bounds | None = None):
        self.table = table
        self._bounds = bounds or Bounds()  # the spans' content caps (rlpulse.sinks.write.content_bounds)
        if table == "spans" and self._bounds.active:  # what the store will lack, said once where it is decided
            cut = f"at {self._bounds.max_chars} characters" if self._bounds.max_chars else "never"
            log.info("spans: %s full trajectories per step, attribute values cut %s (content_capped and "
                     "content_cut_chars say what each row lost)", self._bounds.span_cap or "all", cut)
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
        run_plan: InsertPlan = plan
        loop = asyncio.get_running_loop()
        started = loop.time()
        while True:
            try:
                if data is None:  # once, not on every retry; a failure here is classified like the insert's
                    data = concat([e.msg.value for e in group], [e.header for e in group])
                    # Caps on: the same container, another SELECT (per insert, from the messages' keys only).
                    run_plan = bounded_plan(plan, self._bounds, {e.msg.key for e in group}) if self._bounds.active else plan
                await self._inserter.run(run_plan, data, dedup)
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
