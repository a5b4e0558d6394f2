"""The SQL side of the sink's read endpoint (``rlpulse.sinks.read.read_endpoint``): one request's query run
read-only on a chDB connection of its own, within :class:`ReadLimits`.

Before the query, on that connection: the request's settings, only those on an allowlist a reader
needs (:data:`READER_SETTINGS`, ``output_format_*``: no setting that carries an expression or names
a file; checked before any is applied), then the limits of :class:`ReadLimits` (a request may only
lower them), then ``readonly = 1``, so the engine itself refuses INSERT, DDL, ``SET`` and table functions that reach
outside with its READONLY error (code 164). Then a check with ClickHouse's own parser for what
readonly=1 lets through in chDB (the client-side parts of clickhouse-local run in-process):
``formatQuery`` proves it is one statement, ``EXPLAIN AST`` that it only reads, without
``INTO OUTFILE``, ``file()``, ``python()`` or ``KILL QUERY``.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from rlpulse.base.errors import Error

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The settings a reader may choose (URL parameters): result shape and size, output formatting, time
# zone, and lower limits. Nothing else: settings that carry expressions (additional_result_filter,
# additional_table_filters), name files (format_template_*, format_schema, output_format_schema) or
# switch engine features on would let a request read what the statement itself may not.
READER_SETTINGS = frozenset({
    "max_result_rows", "max_result_bytes", "result_overflow_mode", "max_execution_time", "timeout_overflow_mode",
    "max_threads", "max_final_threads", "max_memory_usage", "max_rows_to_read", "max_bytes_to_read",
    "read_overflow_mode", "max_block_size", "max_rows_to_group_by", "group_by_overflow_mode", "max_rows_to_sort",
    "max_bytes_to_sort", "sort_overflow_mode", "max_bytes_before_external_group_by", "max_bytes_before_external_sort",
    "extremes", "totals_mode", "join_use_nulls", "date_time_output_format", "date_time_input_format",
    "session_timezone", "use_client_time_zone", "final", "limit", "offset", "readonly",
})
READER_SETTING_PREFIXES = ("output_format_",)  # param_<name> values are query parameters, not settings
_EXPRESSION_OR_FILE = frozenset({"output_format_schema"})  # a prefix match that writes a file
MAX_SETTING_VALUE = 256  # characters: a reader's setting is a number, a word or a short pattern

# Statement kinds (the first word of EXPLAIN AST's top node) that only read.
_READ_KINDS = ("SelectWithUnionQuery", "SelectIntersectExceptQuery", "DescribeQuery", "Explain")
_READ_PREFIXES = ("Show", "SHOW ", "Exists")
# Nodes whose direct Literal child can only be an INTO OUTFILE target (or its compression).
_OUTPUT_NODES = _READ_KINDS + _READ_PREFIXES
# A request is answered by this multiple of its max_execution_time, even when the engine, which
# checks the limit only between blocks, has not stopped the query yet.
ABANDON_AFTER = 1.5
_DENIED_FUNCTION = re.compile(r"^\s*Function (file|python|arrowstream)\b", re.IGNORECASE | re.MULTILINE)

@dataclass(frozen=True)
class ReadLimits:
    """What one read may take from the sink's process. A request may ask for less, never more."""

    max_execution_time: int = 10  # seconds; the bound on how long one read competes with ingestion
    max_threads: int = 1  # one core: the sink's inserts keep the other
    max_memory_usage: int = 1 << 30
    max_result_rows: int = 10_000_000
    max_result_bytes: int = 256 << 20  # the answer is held in memory before it is sent
    max_concurrent: int = 2  # queries running at once; more wait up to max_execution_time, then 503
    max_connections: int = 32  # open HTTP connections; more are answered 503 and closed at once

    def clamped(self) -> dict[str, int]:
        return {"max_execution_time": self.max_execution_time, "max_threads": self.max_threads,
                "max_final_threads": self.max_threads, "max_memory_usage": self.max_memory_usage,
                "max_result_rows": self.max_result_rows, "max_result_bytes": self.max_result_bytes}


class QueryFailed(Error):
    """A ClickHouse error to send back: its code and its ``Code: N. DB::Exception: ...`` text."""

    def __init__(self, code: int, text: str):
        super().__init__(text)
        self.code = code
        self.text = text

    @classmethod
    def from_engine(cls, exc: BaseException) -> QueryFailed:
        text = str(exc).strip()
        text = text[text.find("Code: "):] if "Code: " in text else text
        m = re.match(r"Code: (\d+)\. DB::Exception: ", text)
        if m is None:
            return cls(1001, f"Code: 1001. DB::Exception: {text} (STD_EXCEPTION)")
        # A refused SETTINGS clause comes wrapped twice; the formatQuery check adds its own scope.
        text = text.replace(m.group(0) * 2, m.group(0))
        text = re.sub(r":? In scope SELECT formatQuery\(.*?\)\. \((\w+)\)", r". (\1)", text, flags=re.S)
        text = re.sub(r" \(version [^)]*\)", "", text)
        text = re.sub(r"\((\w+)\)\. \(\1\)", r"(\1)", text).replace(". . (", ". (")
        return cls(int(m.group(1)), text)


def refused(why: str) -> QueryFailed:
    return QueryFailed(164, f"Code: 164. DB::Exception: {why}: rlpulse reads the store read-only, one statement "
                            "at a time (SELECT, WITH, SHOW, DESCRIBE, EXISTS and EXPLAIN; data comes in through the "
                            "pipeline). (READONLY)")


@dataclass
class Answer:
    body: bytes
    fmt: str
    summary: dict[str, str]


def _escaped(text: str) -> str:
    """``text`` as a String query parameter value (parsed in ClickHouse's escaped format)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class Engine:
    """Runs one request's SQL on a connection of its own to the engine the sink hosts."""

    def __init__(self, store_path: str, limits: ReadLimits):
        import chdb

        self._connect = chdb.connect
        self._path = os.path.realpath(store_path)  # clickhouse-connect opened it by this spelling
        self.limits = limits
        self.slots = threading.BoundedSemaphore(limits.max_concurrent)
        self.abandoned = 0  # queries answered at their deadline while the engine went on
        with self._conn() as conn:
            self.timezone = conn.query("SELECT timezone()", "TabSeparatedRaw").bytes().decode().strip()
            self.version = conn.query("SELECT version()", "TabSeparatedRaw").bytes().decode().strip()

    @contextmanager
    def _conn(self) -> Iterator[Any]:
        conn = self._connect(self._path)
        try:
            yield conn
        finally:
            conn.close()

    def answer(self, sql: str, default_format: str, params: Mapping[str, str], settings: Mapping[str, str],
               database: str | None) -> Answer:
        limit = float(reader_settings(settings, self.limits)[0]["max_execution_time"])  # refuses bad settings first
        if not self.slots.acquire(timeout=self.limits.max_execution_time):
            raise QueryFailed(202, f"Code: 202. DB::Exception: Too many simultaneous queries on the read endpoint: "
                                   f"{self.limits.max_concurrent} run at once. (TOO_MANY_SIMULTANEOUS_QUERIES)")
        # The engine checks max_execution_time between blocks only: one block of heavy work (an
        # arraySort of 10^8 elements) ran 5 times past it, and chDB's cancel waits for the block too.
        # So the query runs in a thread of its own and the request is answered at the deadline
        # whatever happens; an abandoned query keeps its slot (max_concurrent bounds them) until it ends.
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                with self._conn() as conn:
                    outcome["answer"] = self._run(conn, sql, default_format, params, settings, database)
            except BaseException as exc:  # noqa: BLE001 - handed to the request's thread
                outcome["error"] = exc
            finally:
                self.slots.release()
                done.set()

        threading.Thread(target=run, name="rlpulse-read-query", daemon=True).start()
        if not done.wait(limit * ABANDON_AFTER if limit > 0 else None):
            self.abandoned += 1
            raise QueryFailed(159, f"Code: 159. DB::Exception: Timeout exceeded: the query ran past {limit:g} s "
                                   f"(max_execution_time) and its answer was abandoned at {limit * ABANDON_AFTER:g} s. "
                                   "(TIMEOUT_EXCEEDED)")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["answer"]

    def _run(self, conn: Any, sql: str, default_format: str, params: Mapping[str, str],
             settings: Mapping[str, str], database: str | None) -> Answer:
        try:
            self._prepare(conn, settings, database)
            fmt = self._check(conn, sql, params) or default_format
            result = conn.query(sql, default_format, params=dict(params))
        except QueryFailed:
            raise
        except Exception as exc:  # chDB raises its errors as RuntimeError/ChdbError with ClickHouse's text
            raise QueryFailed.from_engine(exc) from None
        body = result.bytes() or b""
        summary = {"read_rows": str(result.rows_read()), "read_bytes": str(result.bytes_read()), "written_rows": "0",
                   "written_bytes": "0", "total_rows_to_read": "0", "result_rows": "0", "result_bytes": str(len(body)),
                   "elapsed_ns": str(int(result.elapsed() * 1e9))}
        return Answer(body, fmt, summary)

    def _prepare(self, conn: Any, settings: Mapping[str, str], database: str | None) -> None:
        """The request's settings and database, the limits, then readonly=1, on this connection only.

        readonly=1 forbids every later SET, so it cannot come first in the engine: the allowlist
        (:func:`reader_settings`) is checked on every name and value before anything is applied, and
        the caps are set after the request's settings, so they win.
        """
        chosen, asked_readonly = reader_settings(settings, self.limits)
        if database:
            quoted = database.replace("\\", "\\\\").replace("`", "\\`")
            conn.query(f"USE `{quoted}`", "TabSeparated")
        for name, value in chosen.items():
            conn.query(f"SET {name} = {_quote(value)}", "TabSeparated")
        conn.query("SET readonly = 1", "TabSeparated")
        if asked_readonly is not None:  # the engine refuses anything but 1, in its own words
            conn.query(f"SET readonly = {_quote(asked_readonly)}", "TabSeparated")

    def _check(self, conn: Any, sql: str, params: Mapping[str, str]) -> str | None:
        """Refuse what readonly=1 lets through in chDB; return the statement's own FORMAT, if any."""
        formatted = conn.query("SELECT formatQuery({q:String})", "TabSeparatedRaw",
                               params={"q": _escaped(sql)}).bytes().decode().rstrip("\n")
        return check_statement(formatted, lambda text: conn.query("EXPLAIN AST " + text, "TabSeparatedRaw",
                                                                   params=dict(params)).bytes().decode())


def check_statement(formatted: str, explain_ast: Callable[[str], str]) -> str | None:
    """Refuse a statement that does more than read; return its own FORMAT, if any.

    ``formatted``: ClickHouse's ``formatQuery`` of the text (which refuses more than one statement,
    "Multi-statements are not allowed"); ``explain_ast``: runs ``EXPLAIN AST <text>`` and returns its
    lines. The read endpoint and ``rlpulse query`` (every backend) both check with this.
    """
    lines = formatted.split("\n")
    fmt = None
    if lines and re.fullmatch(r"FORMAT \S+", lines[-1]):
        fmt = lines.pop().split(" ", 1)[1]
    if any(re.match(r"\s*INTO OUTFILE\b", line) for line in lines):
        raise refused("INTO OUTFILE writes a file")
    ast = explain_ast("\n".join(lines))
    nodes = [(len(line) - len(line.lstrip(" ")), line.strip()) for line in ast.splitlines() if line.strip()]
    if not nodes:
        raise refused("an empty statement")
    kind = nodes[0][1].split(" ")[0]
    if not (nodes[0][1].startswith(_READ_PREFIXES) or kind in _READ_KINDS):
        raise refused(f"Cannot execute query in readonly mode ({kind.removesuffix('Query')} is not a read)")
    parents: list[str] = []
    for depth, node in nodes:
        del parents[depth:]
        if node.startswith("Literal") and parents and parents[-1].startswith(_OUTPUT_NODES):
            raise refused("INTO OUTFILE writes a file")
        parents.append(node)
    denied = _DENIED_FUNCTION.search(ast)
    if denied:
        raise refused(f"the function {denied.group(1)}() reads outside the store")
    return fmt


def setting_refused(name: str, why: str) -> QueryFailed:
    """A request's setting the read endpoint does not take (HTTP 400, naming it)."""
    shown = name if len(name) <= 80 and name.isprintable() else repr(name[:80])[1:-1]  # no CR/LF into a log or header
    return QueryFailed(452, f"Code: 452. DB::Exception: Setting '{shown}' is not accepted by the read endpoint: {why}; "
                            "a reader may set result limits (max_result_rows, max_execution_time, ...), output_format_*, "
                            "date_time_output_format and session_timezone. (SETTING_CONSTRAINT_VIOLATION)")


def reader_settings(settings: Mapping[str, str], limits: ReadLimits) -> tuple[dict[str, str], str | None]:
    """The SETs to run for a request's ``settings``, in order (the request's, then the limits), and the
    ``readonly`` value it asked for (None: none).

    Only :data:`READER_SETTINGS` and ``output_format_*`` names pass; any other, and any value that
    is not a short printable text, is refused (:func:`setting_refused`) before anything is applied.
    A limit the request asks for is taken only when it is lower than :class:`ReadLimits`' own.
    """
    caps: dict[str, Any] = limits.clamped()
    chosen: dict[str, str] = {"allow_python_table_function": "0"}
    asked_readonly = None
    for name, value in settings.items():
        if not _NAME.match(name):
            raise setting_refused(name, "not a setting name")
        if name in _EXPRESSION_OR_FILE or not (name in READER_SETTINGS or name.startswith(READER_SETTING_PREFIXES)):
            raise setting_refused(name, "only settings that shape a result are taken (no expressions, files or engine "
                                        "switches)")
        if len(value) > MAX_SETTING_VALUE or not value.isprintable():
            raise setting_refused(name, f"its value must be printable and at most {MAX_SETTING_VALUE} characters")
        if name == "readonly":
            asked_readonly = value
        elif name in caps:
            try:
                asked = float(value)
            except ValueError:
                raise QueryFailed(27, f"Code: 27. DB::Exception: Cannot parse '{value}' for setting {name}. "
                                      "(CANNOT_PARSE_INPUT_ASSERTION_FAILED)") from None
            if 0 < asked < caps[name]:
                caps[name] = int(asked) if asked == int(asked) else asked
        else:
            chosen[name] = value
    chosen.update({k: str(v) for k, v in caps.items()})
    return chosen, asked_readonly
