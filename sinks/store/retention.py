"""How long ClickHouse keeps each table's rows, per table and per project (``rlpulse retention``).

Retention is the tables' own TTL, so ClickHouse deletes expired rows in its merges and nothing of
ours has to run for it. A table's TTL is a list of rules, each ``<time> + INTERVAL n DAY DELETE
WHERE …``: one per project with its own retention (``WHERE project = 'p'``) and the table's
default for every other project (``WHERE project NOT IN ('p', …)``; with no project set, no WHERE).
Each row matches exactly one rule, so a project kept longer than the default is really kept longer.

What was set is read back from the TTL ClickHouse holds (``system.tables.engine_full``), the one
place that decides what is deleted: no second copy of the settings can disagree with it. A TTL
this module did not write (changed by hand) is shown as it is and never overwritten.

Every input is checked against an allowlist before any SQL is built: the table against the
pipeline's tables (their time columns are named here, not read from input), the project with the
SDK's limits for names, the days a whole number from 1 to :data:`MAX_DAYS`; a project enters the
SQL only as a quoted literal (:func:`quote`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rlpulse.schemas.catalogue import TABLES
from rlpulse.sinks.store.clickhouse import Store
from rlpulse.base.errors import Error

# Each table's event time, the column its TTL counts from (the migrations' TTL clauses; the
# integration test checks these against a migrated store).
TIME_COLUMNS: dict[str, str] = {
    "spans": "end_time", "steps": "time", "gpu_samples": "time", "placements": "time", "engine_samples": "time",
    "capacity": "time", "grader_failures": "window_start", "grader_windows": "window_start",
    "step_stats": "emitted_at", "reward_histograms": "emitted_at", "completion_length_histograms": "emitted_at",
    "step_term_stats": "emitted_at", "alerts": "time",
}
if set(TIME_COLUMNS) != set(TABLES.values()):  # a table added to the catalogue needs its time column here
    raise ImportError(f"retention: time columns differ from the catalogue's tables: "
                      f"{sorted(set(TIME_COLUMNS) ^ set(TABLES.values()))}")
RAW_TABLES = ("spans", "steps", "gpu_samples", "placements", "engine_samples", "capacity")  # RLPULSE_TTL_RAW_DAYS
MAX_DAYS = 36_500  # a hundred years: "keep for ever" within an int ClickHouse's interval arithmetic takes
MAX_PROJECT = 256  # characters: the SDK's limit for a project name (rlpulse.producers.sdk.events.MAX_NAME)


class RetentionError(Error, RuntimeError):
    """A table's TTL cannot be read or changed as asked (one written by hand, a store that refuses)."""


def check_table(table: Any) -> str:
    if table not in TIME_COLUMNS:
        raise ValueError(f"unknown table {table!r}; retention applies to: {', '.join(sorted(TIME_COLUMNS))}")
    return table


def check_project(project: Any) -> str:
    """A project name as the SDK accepts one: non-empty text of at most 256 characters."""
    if not isinstance(project, str) or not project:
        raise ValueError(f"project must be a non-empty name, got {project!r}")
    if len(project) > MAX_PROJECT:
        raise ValueError(f"project is {len(project)} characters; at most {MAX_PROJECT} are allowed")
    try:
        project.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"project {project!r} is not valid text") from None
    return project


def check_days(days: Any) -> int:
    if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= MAX_DAYS:
        raise ValueError(f"days must be a whole number from 1 to {MAX_DAYS}, got {days!r}")
    return days


_ESCAPES = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\0": "\\0", "\b": "\\b", "\f": "\\f"}


def quote(text: str) -> str:
    """``text`` as a ClickHouse string literal: quote, backslash and control characters escaped
    (a raw NUL or newline in a statement is never sent)."""
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return "'" + "".join(out) + "'"


_UNESCAPES = {"n": "\n", "r": "\r", "t": "\t", "0": "\0", "b": "\b", "f": "\f", "a": "\a", "v": "\v", "e": "\x1b"}


def unquote(literal: str) -> str:
    """The text of a ClickHouse string literal as ClickHouse prints one (the inverse of :func:`quote`)."""
    if len(literal) < 2 or literal[0] != "'" or literal[-1] != "'":
        raise RetentionError(f"not a string literal: {literal[:80]!r}")
    body, out, i = literal[1:-1], bytearray(), 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            out += ch.encode()
            i += 1
        elif body[i + 1:i + 2] == "x":  # \xHH is a byte: several make one UTF-8 character
            out.append(int(body[i + 2:i + 4], 16))
            i += 4
        else:
            nxt = body[i + 1:i + 2]
            out += _UNESCAPES.get(nxt, nxt).encode()
            i += 2
    return out.decode("utf-8", errors="replace")


@dataclass
class Retention:
    """One table's retention: the default (None: rows are kept for ever) and each project's own."""

    table: str
    default_days: int | None
    projects: dict[str, int] = field(default_factory=dict)
    ttl: str = ""  # the TTL clause as ClickHouse prints it ('' when the table has none)

    def rules(self) -> str:
        """The TTL expression that gives this retention ('' for none at all)."""
        time = f"toDateTime({TIME_COLUMNS[self.table]})"
        rules = [f"{time} + INTERVAL {check_days(days)} DAY DELETE WHERE project = {quote(check_project(project))}"
                 for project, days in sorted(self.projects.items())]
        if self.default_days is not None:
            listed = ", ".join(quote(p) for p in sorted(self.projects))
            others = f" DELETE WHERE project NOT IN ({listed})" if self.projects else ""
            rules.append(f"{time} + INTERVAL {check_days(self.default_days)} DAY{others}")
        return ", ".join(rules)


_DATABASE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A TTL rule as ClickHouse prints the ones rules() writes: its interval, then an optional WHERE.
_RULE = re.compile(r"^toDateTime\((\w+)\) \+ toIntervalDay\((\d+)\)(?: WHERE (.*))?$", re.DOTALL)
_LITERAL = r"'(?:[^'\\]|\\.)*'"
_ONE_PROJECT = re.compile(rf"^project = ({_LITERAL})$", re.DOTALL)
_OTHER_PROJECTS = re.compile(rf"^project NOT IN \(({_LITERAL}(?:, {_LITERAL})*)\)$", re.DOTALL)


def split_rules(ttl: str) -> list[str]:
    """The comma-separated rules of a TTL clause (commas inside quotes and parentheses belong to a rule)."""
    rules, depth, start, i, quoted = [], 0, 0, 0, False
    while i < len(ttl):
        ch = ttl[i]
        if quoted:
            if ch == "\\":
                i += 1
            elif ch == "'":
                quoted = False
        elif ch == "'":
            quoted = True
        elif ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            rules.append(ttl[start:i].strip())
            start = i + 1
        i += 1
    rules.append(ttl[start:].strip())
    return [r for r in rules if r]


def ttl_clause(engine_full: str) -> str:
    """The TTL clause of a table's ``engine_full`` ('' when it has none): from `` TTL `` to the SETTINGS."""
    at = _outside_quotes(engine_full, " TTL ")
    if at < 0:
        return ""
    rest = engine_full[at + len(" TTL "):]
    end = _outside_quotes(rest, " SETTINGS ")
    return (rest if end < 0 else rest[:end]).strip()


def _outside_quotes(text: str, needle: str) -> int:
    """Where ``needle`` first occurs outside a string literal; -1 if nowhere."""
    quoted, i = False, 0
    while i < len(text):
        ch = text[i]
        if quoted:
            if ch == "\\":
                i += 1
            elif ch == "'":
                quoted = False
        elif ch == "'":
            quoted = True
        elif text.startswith(needle, i):
            return i
        i += 1
    return -1


def parse(table: str, ttl: str) -> Retention:
    """The retention a TTL clause gives; RetentionError for one rlpulse did not write."""
    found = Retention(table, None, {}, ttl)
    for rule in split_rules(ttl):
        m = _RULE.match(rule)
        if not m or m.group(1) != TIME_COLUMNS[table]:
            raise _by_hand(table, ttl)
        days, where = int(m.group(2)), m.group(3)
        one = _ONE_PROJECT.match(where or "")
        if one:
            found.projects[unquote(one.group(1))] = days
        elif where is None or _OTHER_PROJECTS.match(where):
            found.default_days = days
        else:
            raise _by_hand(table, ttl)
    return found


def _by_hand(table: str, ttl: str) -> RetentionError:
    return RetentionError(f"the TTL of {table} was not written by rlpulse retention, so it is left as it is: {ttl[:300]}. "
                          f"To manage it here, remove it first (ALTER TABLE {table} REMOVE TTL), then set it again")


def _engines(store: Store, cluster: str) -> dict[str, str]:
    """engine_full of each table (on a cluster: of its ``<table>_local`` part on the node asked)."""
    suffix = "_local" if cluster else ""
    rows = store.client.query("SELECT name, engine_full FROM system.tables WHERE database = {db:String}",
                              parameters={"db": store.database}).result_rows
    return {name[:len(name) - len(suffix)]: engine for name, engine in rows
            if name.endswith(suffix) and name[:len(name) - len(suffix)] in TIME_COLUMNS}


def read(store: Store, cluster: str = "") -> list[Retention]:
    """Each table's retention as its TTL says, in table order; a table whose TTL rlpulse did not
    write has ``default_days`` None and its clause in ``ttl`` (shown, never overwritten)."""
    engines = _engines(store, cluster)
    out = []
    for table in sorted(engines):
        ttl = ttl_clause(engines[table])
        try:
            out.append(parse(table, ttl))
        except RetentionError:
            out.append(Retention(table, None, {}, ttl))
    return out


def alter_statements(database: str, wanted: Retention, cluster: str = "") -> list[str]:
    """The ALTERs that give ``wanted.table`` the retention ``wanted``: on a cluster, ``ON CLUSTER`` on
    its ``<table>_local`` parts (the Distributed table holds no rows and no TTL)."""
    if not _DATABASE.match(database):  # from the store's URL: a name, never SQL
        raise ValueError(f"invalid database name {database!r}")
    rules = wanted.rules()
    statement = (f"ALTER TABLE {database}.{check_table(wanted.table)} MODIFY TTL {rules}" if rules
                 else f"ALTER TABLE {database}.{wanted.table} REMOVE TTL")
    if not cluster:
        return [statement]
    from rlpulse.sinks.store.cluster_ddl import cluster_statements

    return cluster_statements(statement, cluster)


def change(store: Store, table: str, days: int | None, project: str | None = None, cluster: str = "",
           default_days: int | None = None) -> Retention:
    """Set (``days``) or clear (``days`` None) ``table``'s retention, of ``project`` or the default.

    Clearing a project's retention puts it back under the table's default; clearing the default puts
    it back to ``default_days`` (the configured RLPULSE_TTL_*_DAYS). ClickHouse applies the new TTL to
    the rows already stored too (``materialize_ttl_after_modify``): rows now past it are deleted.
    """
    check_table(table)
    if project is not None:
        check_project(project)
    if days is not None:
        check_days(days)
    engines = _engines(store, cluster)
    if table not in engines:
        raise RetentionError(f"no table {store.database}.{table} in {store.url}: run `rlpulse migrate` first")
    current = parse(table, ttl_clause(engines[table]))  # RetentionError for a TTL written by hand: left alone
    if project is not None:
        if days is None:
            current.projects.pop(project, None)
        else:
            current.projects[project] = days
    else:
        current.default_days = days if days is not None else default_days
    for sql in alter_statements(store.database, current, cluster):
        # mutations_sync: the command returns once the stored rows follow the new TTL, so what it
        # printed is true when it ends (expired rows already deleted).
        store.client.command(sql, settings={"mutations_sync": 2})
    return parse(table, ttl_clause(_engines(store, cluster)[table]))  # as ClickHouse now holds it
