"""Ad-hoc and saved SQL queries (``rlpulse query``), run read-only.

Saved queries are the ``.sql`` files in ``sinks/read/queries/``: the leading comment paragraph (up to
its ``Params`` sentence) describes the query, ``{db}`` stands for the database name, and
``{name:Type}`` placeholders are ClickHouse server-side parameters: values travel as
``parameters=`` and ClickHouse parses them for the declared type, so nothing is pasted into the
SQL text.

Queries run with the setting ``readonly=1``. With clickhouse-connect's chDB backend a per-query
setting stays on for that client's later queries, so the client handed to ``run_query`` must be
used for nothing else afterwards (``rlpulse query`` opens a store of its own for that).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Mapping, Sequence
from contextlib import redirect_stdout
from datetime import date, datetime
from decimal import Decimal
from ipaddress import IPv4Address, IPv6Address
from pathlib import Path
from typing import Any
from uuid import UUID

from rlpulse.base.terminal import csv_safe
from rlpulse.sinks.read.read_engine import QueryFailed, check_statement
from rlpulse.base.errors import Error

SAVED = Path(__file__).parent / "queries"
FORMATS = ("table", "csv", "json")
# A saved query's parameter, ClickHouse's {name:Type}: its name and its type.
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*):([^{}]+)\}")


class ReadOnlyError(Error, RuntimeError):
    """The query tried to change data or settings and ClickHouse refused it (readonly=1)."""


class QueryError(Error, RuntimeError):
    """ClickHouse rejected the query (syntax, unknown table, bad parameter value, ...).

    ``code`` is ClickHouse's error name (``SYNTAX_ERROR``, ``UNKNOWN_DATABASE``, ...) or ''."""

    def __init__(self, reason: str, code: str = ""):
        super().__init__(reason)
        self.code = code


class ParamError(QueryError):
    """A ``--param`` value ClickHouse cannot parse as the type its placeholder declares."""


# Examples of a value per placeholder type, for the message that says a --param did not parse.
_EXAMPLES = (("DateTime", "'2026-01-31 12:00:00'"), ("Date", "2026-01-31"), ("Float", "0.5"), ("Decimal", "0.5"),
             ("UInt", "1"), ("Int", "-1"), ("Bool", "true"), ("UUID", "00000000-0000-0000-0000-000000000000"))


def list_saved() -> dict[str, str]:
    """Saved query name -> its description: the leading comment paragraph, joined into one line."""
    return {path.stem: description(path.read_text()) for path in sorted(SAVED.glob("*.sql"))}


# Where a saved query's description ends: its "Params" sentence, at a line's start or after a sentence.
_PARAMS = re.compile(r"(?:^|(?<=[.;:)]))\s*Params\b")


def split_header(sql: str) -> tuple[str, str]:
    """A saved query's header comment as (description, notes), each joined into one line.

    The description is the leading paragraph: the comment lines before the first of a ``Params``
    sentence, a blank comment line or the SQL; the whole paragraph, not its first line, so that a
    description wrapped over lines reads as one sentence in ``rlpulse query --list``, the Grafana
    panels and docs/reference/. The notes are the rest of the header (parameters, dedup, edge cases)."""
    head = []
    for line in sql.splitlines():
        if not line.strip().startswith("--"):
            break
        head.append(line.strip()[2:].strip())
    about: list[str] = []
    rest: list[str] = []
    for i, text in enumerate(head):
        cut = _PARAMS.search(text)
        if cut or not text:
            about.append(text[:cut.start()] if cut else "")
            rest = ([text[cut.start():]] if cut else []) + head[i + 1:]
            break
        about.append(text)
    return " ".join(" ".join(about).split()), " ".join(" ".join(rest).split())


def description(sql: str) -> str:
    """What saved query text ``sql`` returns: its header's leading paragraph (:func:`split_header`)."""
    return split_header(sql)[0]


def load_saved(name: str) -> str:
    """The SQL text of saved query ``name``; ValueError naming the available ones when unknown."""
    path = SAVED / f"{name}.sql"
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name) or not path.is_file():
        raise ValueError(f"no saved query {name!r}; available: {', '.join(list_saved()) or '(none)'}")
    return path.read_text()


def placeholders(sql: str) -> dict[str, str]:
    """``{name:Type}`` parameters of ``sql`` (comment lines ignored): name -> type."""
    body = "\n".join(line for line in sql.splitlines() if not line.strip().startswith("--"))
    return {m.group(1): m.group(2).strip() for m in PLACEHOLDER.finditer(body)}


def parse_params(items: Sequence[str] | None) -> dict[str, str]:
    """``["name=value", ...]`` -> dict; values stay strings (ClickHouse parses them)."""
    params: dict[str, str] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"--param {item!r}: expected name=value")
        params[name] = value
    return params


def saved_sql(name: str, params: Mapping[str, str], database: str) -> str:
    """Saved query ``name`` for ``database``; ValueError when a parameter is missing or unknown."""
    sql = load_saved(name)
    wanted = placeholders(sql)
    missing = [f"{n} ({t})" for n, t in wanted.items() if n not in params]
    if missing:
        raise ValueError(f"saved query {name} needs --param for: {', '.join(missing)}")
    extra = sorted(set(params) - set(wanted))
    if extra:
        raise ValueError(f"saved query {name} takes no parameter {', '.join(extra)}; it takes: {', '.join(wanted) or 'none'}")
    return sql.replace("{db}", database)


def run_query(client: Any, sql: str, params: Mapping[str, str] | None = None) -> tuple[list[str], list[tuple]]:
    """Run ``sql`` read-only on ``client`` (use that client for nothing else afterwards).

    ValueError when a ``{name:Type}`` placeholder has no value; ParamError when ClickHouse cannot
    parse a value as its type; ReadOnlyError for a write; QueryError (one line, ClickHouse's own
    reason without the echoed query or the list of expected tokens) for anything else it refuses.
    """
    missing = [f"{n} ({t})" for n, t in placeholders(sql).items() if n not in (params or {})]
    if missing:
        raise ValueError(f"the query needs --param NAME=VALUE for: {', '.join(missing)}")
    try:
        statement = one_statement(client, sql, params or {})
        result = client.query(statement, parameters=dict(params or {}), settings={"readonly": 1})
    except QueryFailed as exc:  # check_statement: parsed, and not a read
        raise ReadOnlyError(f"refused: queries run read-only (readonly=1): {one_line(exc)}") from None
    except Exception as exc:
        if type(exc).__module__.startswith("clickhouse_connect") or "DB::Exception" in str(exc):
            reason = one_line(exc)
            if "Multi-statements are not allowed" in reason:
                raise ReadOnlyError("refused: rlpulse query runs exactly one read-only statement; the text holds more "
                                    "than one (split at ';'): run them one at a time") from None
            if "READONLY" in reason or "readonly mode" in reason or re.search(r"\bCode: 164\b", reason):
                raise ReadOnlyError(f"refused: queries run read-only (readonly=1): {reason}") from None
            raise _refusal(one_line(exc, limit=None), sql, params or {}) from None
        raise
    columns, rows = list(result.column_names), [tuple(r) for r in result.result_rows]
    if not columns and not rows:
        columns = _columns_of(client, statement, params)
    return columns, rows


def one_statement(client: Any, sql: str, params: Mapping[str, str]) -> str:
    """``sql`` as ClickHouse's parser prints it, once it is proven one statement that only reads.

    readonly=1 alone is not enough on every backend: the chDB one runs each statement of a text
    on its own, the setting appended after the last only (``SELECT 1; DROP TABLE t; SELECT 1``
    dropped t). So the text is parsed first (``formatQuery`` refuses more than one statement), the
    read endpoint's own check (:func:`check_statement`) runs on it, and the printed statement, with
    no comments left to swallow what the driver appends, is what runs.
    """
    formatted = client.query("SELECT formatQuery({q:String})", parameters={"q": sql},
                             settings={"readonly": 1}).result_rows[0][0].rstrip("\n")

    def explain_ast(text: str) -> str:
        # raw text: over HTTP, clickhouse-connect's typed reading of EXPLAIN's answer fails
        return client.raw_query("EXPLAIN AST " + text, parameters=dict(params), settings={"readonly": 1},
                                fmt="TabSeparatedRaw").decode()

    check_statement(formatted, explain_ast)
    return formatted


def _columns_of(client: Any, sql: str, params: Mapping[str, str] | None) -> list[str]:
    """Column names of a query that returned no rows (the chDB backend then reports none): DESCRIBE it."""
    try:
        described = client.query(f"DESCRIBE ({sql.strip().rstrip(';')})", parameters=dict(params or {}),
                                 settings={"readonly": 1})
    except Exception:  # not a SELECT (SHOW, EXPLAIN, ...): no header then
        return []
    return [row[0] for row in described.result_rows]


def one_line(exc: BaseException, limit: int | None = 600) -> str:
    """ClickHouse's error ``exc`` as one line: its reason, without the driver's prefix, the server
    version, stack trace or URL; cut at ``limit`` characters (None: whole)."""
    text = str(exc)
    # Over HTTP the driver puts its own line first ("HTTPDriver for http://… received ClickHouse
    # error code 62"): ClickHouse's message starts at its "Code: NN." line.
    start = text.find("Code: ")
    text = text[start:] if start > 0 else text
    # A server's message may go on with "(version ...)" and a stack trace: keep what comes before.
    text = " ".join(text.split(" (version ")[0].split())
    text = re.sub(r"\s*\(for url [^)]*\)$", "", text)  # the HTTP driver's suffix: where, not why
    return text if limit is None or len(text) <= limit else text[:limit - 3] + "..."


_CODE_NAME = re.compile(r"\(([A-Z][A-Z0-9_]+)\)\s*$")
_BAD_VALUE = re.compile(r"(?:Value )?(.*?) cannot be parsed as (.+?) for query parameter '([A-Za-z0-9_]+)'")
_SYNTAX = re.compile(r"Syntax error(?: \([^)]*\))?: failed at position (\d+)(?: \([^)]*\))?(?: \(line (\d+), col (\d+)\))?")


def _refusal(reason: str, sql: str, params: Mapping[str, str]) -> QueryError:
    """ClickHouse's refusal as one short line: its reason, without the "Code: NN. DB::Exception:"
    prefix, the query it echoes back ("In scope SELECT …") or the tokens it expected."""
    name = _CODE_NAME.search(reason)
    code = name.group(1) if name else ""
    text = re.sub(r"^Code: \d+\. DB::Exception: ", "", reason)
    text = _CODE_NAME.sub("", text).strip()
    bad = _BAD_VALUE.search(text)
    if bad and bad.group(3) in params:
        param, type_ = bad.group(3), bad.group(2)
        example = next((e for prefix, e in _EXAMPLES if type_.removeprefix("Nullable(").startswith(prefix)), None)
        hint = f"; give a {type_}" + (f", e.g. --param {param}={example}" if example else "")
        return ParamError(f"--param {param}={params[param]} is not a valid {type_}{hint}", code)
    syntax = _SYNTAX.search(text)
    if syntax:
        at = int(syntax.group(1)) - 1  # ClickHouse counts from 1
        # formatQuery (one_statement) gives the position alone: line and column as the server would
        line, col = (syntax.group(2), syntax.group(3)) if syntax.group(2) else (
            sql.count("\n", 0, at) + 1, at - sql.rfind("\n", 0, at))
        where = f"line {line}, col {col}"
        # past the end of the user's SQL: the driver's appended SETTINGS/FORMAT is where it failed
        text = ("syntax error: the query ends too early" if at >= len(sql.rstrip().rstrip(";"))
                else f"syntax error at {where}, near {sql[at:].splitlines()[0][:30]!r}")
    else:
        text = re.split(r"\s*In scope |\s*Expected one of:", text)[0].rstrip(". ")
    if len(text) > 300:
        text = text[:297] + "..."
    return QueryError(f"{text} ({code})" if code else text, code)


def _plain(v: Any) -> Any:
    """A JSON-able value."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (datetime, date)):
        return v.isoformat()
    if isinstance(v, Decimal):
        return float(v)
    if isinstance(v, (UUID, IPv4Address, IPv6Address)):
        return str(v)
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return v


def _text(v: Any) -> str:
    """A CSV cell. Its value may come from a topic anyone writes to and the CSV is often read with
    ``cat``: every control character but a newline or tab is written as a visible escape (the
    writer quotes a cell holding those, so a reader gets multi-line text back whole)."""
    if v is None:
        return ""
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(_plain(v), separators=(",", ":"))  # json.dumps escapes every control itself
    if isinstance(v, (datetime, date)):
        return v.isoformat()
    return csv_safe(str(v))


def render(columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str = "table") -> str:
    """Rows as ``table`` (``rlpulse.base.terminal.print_table``'s aligned text), ``csv`` (a header, then rows; NULL
    empty, arrays and maps as JSON, times in ISO 8601) or ``json`` (a list of objects; NaN and inf as null).

    None of them prints a control character of a value raw: the table escapes them all (print_table), the
    CSV all but newline and tab (``_text``), and json.dumps writes every control and non-ASCII character
    as a ``\\u`` escape (ensure_ascii, its default)."""
    if fmt == "table":
        from rlpulse.base.terminal import print_table

        buf = io.StringIO()
        with redirect_stdout(buf):
            print_table(columns, rows)
        return buf.getvalue()
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow([_text(c) for c in columns])
        writer.writerows([_text(v) for v in row] for row in rows)
        return buf.getvalue()
    if fmt == "json":
        return json.dumps([dict(zip(columns, (_plain(v) for v in row))) for row in rows], indent=2) + "\n"
    raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
