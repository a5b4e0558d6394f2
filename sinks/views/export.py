"""``rlpulse export triplets|messages``: trajectories out of ``spans`` for training (seed 003's adapters).

* **triplets**: one row per LLM call of a trajectory (agent-lightning's ``TracerTraceToTriplet``): the
  call's ``prompt`` (the chat messages it sent), its ``response`` (the assistant message that came back),
  and the trajectory's ``reward`` (its ROLLOUT span's, else its REWARD entry span's), with ``turn`` (the
  call's place in the trajectory, from 0) and ``final`` (its last call).
* **messages**: one row per trajectory with at least one LLM call (``TraceToMessages``): ``messages``, the
  OpenAI chat conversation (its last call's messages, which an agent loop resends whole, plus that
  call's reply: system, user, assistant with ``tool_calls``, tool), and ``tools`` that call offered.

Prompts and replies are the content the tracer recorded (``rlpulse.producers.tracing``, content on); a
call recorded without content exports null prompt and response, and a cut one counts its cut
characters in ``content_cut``. A trajectory is a ROLLOUT span with a ``rollout_id``; filters: project,
run, step range, sample, minimum reward, status of the ROLLOUT span.

ClickHouse writes every byte: JSONL rows are built by the query (nested JSON: ``prompt``, ``response``,
``messages`` and ``tools`` as arrays and objects, every other value through ``toJSONString``) and sent
as ``TabSeparatedRaw``; Parquet pages are ClickHouse's ``FORMAT Parquet`` (those four as JSON text),
appended by pyarrow as row groups of one file. The queries run read-only (``readonly=1``, or the
sink's read endpoint), so the sink may go on writing meanwhile.

Bounded memory, whatever the number of trajectories: trajectories are read in pages. A key page
(``KEY_PAGE`` keys: run, attempt, rollout id and the span sequence range the trajectory covers) is
listed with keyset pagination; its keys are exported ``page_size`` trajectories at a time, each
page one query reading only the page's sequence range of one run (the table's sorting key), so
ClickHouse's state, the answer (streamed over HTTP; a chDB answer is held whole) and pyarrow's table
hold one page at most. A million trajectories are 20 key queries and about 4,000 page queries.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views.trajectories import SAMPLE_SQL

KINDS = ("triplets", "messages")
FORMATS = ("jsonl", "parquet")
STATUSES = {"ok": "OK", "error": "ERROR", "unset": "UNSET"}
KEY_PAGE = 50_000  # keys listed per query: ~100 bytes each in memory
PAGE_SIZE = 256  # trajectories exported per query: what one query holds (a few MB of content at the default cap)
PAGE_ID_BYTES = 24_000  # rollout ids per page query, in characters: they travel as a URL parameter over HTTP
READ = {"readonly": 1, "output_format_parquet_string_as_string": 1}


@dataclass(frozen=True)
class Filters:
    project: str | None = None
    run_id: str | None = None
    min_step: int | None = None
    max_step: int | None = None
    sample_id: str | None = None
    min_reward: float | None = None
    status: str | None = None  # ok, error or unset (the ROLLOUT span's status)

    def check(self) -> None:
        if self.status is not None and self.status.lower() not in STATUSES:
            raise ValueError(f"--status must be one of {', '.join(STATUSES)}; got {self.status!r}")
        for name in ("min_step", "max_step"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be 0 or more, got {value}")
        if self.min_step is not None and self.max_step is not None and self.min_step > self.max_step:
            raise ValueError(f"--min-step {self.min_step} is above --max-step {self.max_step}")


@dataclass
class Key:
    project: str
    run_id: str
    attempt: int
    rollout_id: str
    min_seq: int
    max_seq: int
    calls: int


@dataclass
class Exported:
    trajectories: int = 0  # selected by the filters
    without_calls: int = 0  # of those, trajectories with no LLM call (no triplet, no messages row)
    rows: int = 0
    pages: int = 0


# -- listing the selected trajectories ---------------------------------------------------------------

def _key_sql(filters: Filters) -> tuple[str, dict[str, Any]]:
    inner, outer, params = ["rollout_id != ''", "kind IN ('ROLLOUT', 'REWARD', 'LLM')"], ["entries > 0"], {}
    if filters.project is not None:
        inner.append("project = {project:String}")
        params["project"] = filters.project
    if filters.run_id is not None:
        inner.append("run_id = {run:String}")
        params["run"] = filters.run_id
    for name, test in (("min_step", "t_step >= {min_step:Int64}"), ("max_step", "t_step <= {max_step:Int64}"),
                       ("sample_id", "t_sample = {sample:String}"), ("min_reward", "t_reward >= {min_reward:Float64}")):
        value = getattr(filters, name)
        if value is not None:
            outer.append(test)
            params[name if name != "sample_id" else "sample"] = value
    if filters.status is not None:
        outer.append("t_status = {status:String}")
        params["status"] = STATUSES[filters.status.lower()]
    # The sample may sit in attributes (OpenTelemetry spans): read that column, heavy with content, only to filter on it.
    sample = f"anyIf({SAMPLE_SQL}, kind = 'ROLLOUT')" if filters.sample_id is not None else "NULL"
    sql = f"""
        SELECT project, run_id, attempt, rollout_id, min_seq, max_seq, calls FROM (
            SELECT project, run_id, attempt, rollout_id, min(sequence_id) AS min_seq, max(sequence_id) AS max_seq,
                   countIf(kind = 'ROLLOUT') AS entries, uniqExactIf(span_id, kind = 'LLM') AS calls,
                   anyIf(step, kind = 'ROLLOUT') AS t_step, anyIf(status, kind = 'ROLLOUT') AS t_status,
                   {sample} AS t_sample,
                   ifNull(anyIf(reward, kind = 'ROLLOUT'), anyIf(reward, kind = 'REWARD')) AS t_reward
            FROM {{db}}.spans WHERE {' AND '.join(inner)}
            GROUP BY project, run_id, attempt, rollout_id)
        WHERE {' AND '.join(outer)} AND ({{first:UInt8}} = 1 OR (project, run_id, attempt, min_seq, rollout_id) >
              ({{k_project:String}}, {{k_run:String}}, {{k_attempt:UInt32}}, {{k_seq:UInt64}}, {{k_rollout:String}}))
        ORDER BY project, run_id, attempt, min_seq, rollout_id
        LIMIT {{limit:UInt64}}"""
    return sql, params


def keys(store: Store, filters: Filters, key_page: int = KEY_PAGE) -> Iterator[Key]:
    """The selected trajectories in (project, run, attempt, first sequence id, rollout id) order."""
    sql, params = _key_sql(filters)
    sql = sql.replace("{db}", store.database)
    after: dict[str, Any] = {"first": 1, "k_project": "", "k_run": "", "k_attempt": 0, "k_seq": 0, "k_rollout": ""}
    while True:
        rows = store.client.query(sql, parameters={**params, **after, "limit": key_page}, settings=READ).result_rows
        for row in rows:
            yield Key(row[0], row[1], int(row[2]), row[3], int(row[4]), int(row[5]), int(row[6]))
        if len(rows) < key_page:
            return
        last = rows[-1]
        after = {"first": 0, "k_project": last[0], "k_run": last[1], "k_attempt": int(last[2]), "k_seq": int(last[4]),
                 "k_rollout": last[3]}


def pages(selected: Iterator[Key], page_size: int, counts: Exported) -> Iterator[list[Key]]:
    """Consecutive keys of one (project, run, attempt) with LLM calls, at most ``page_size`` and PAGE_ID_BYTES of ids."""
    page: list[Key] = []
    size = 0
    for key in selected:
        counts.trajectories += 1
        if key.calls == 0:
            counts.without_calls += 1
            continue
        same_run = not page or (page[0].project, page[0].run_id, page[0].attempt) == (key.project, key.run_id, key.attempt)
        if page and (not same_run or len(page) >= page_size or size + len(key.rollout_id) > PAGE_ID_BYTES):
            yield page
            page, size = [], 0
        page.append(key)
        size += len(key.rollout_id) + 4
    if page:
        yield page


# -- one page of rows ----------------------------------------------------------------------------------

def _json_or_text(expr: str) -> str:
    """A recorded JSON value as itself (its whitespace made one line), or, when it is not valid JSON (cut as
    text by the cap, or written by another writer), as a JSON string; null when nothing was recorded."""
    return (f"if({expr} = '', 'null', if(isValidJSON({expr}), replaceRegexpAll({expr}, '[\\\\r\\\\n\\\\t]', ' '), "
            f"toJSONString({expr})))")


def _js(expr: str) -> str:
    return f"ifNull(toJSONString({expr}), 'null')"


_PAGE = """
    WITH page AS (
        SELECT rollout_id, kind, span_id, sequence_id, start_time_ns, status, step, {sample} AS sample, reward,
               attributes['gen_ai.input.messages'] AS prompt_raw, attributes['gen_ai.output.messages'] AS output_raw,
               attributes['gen_ai.tool.definitions'] AS tools_raw,
               if(attributes['gen_ai.response.model'] != '', attributes['gen_ai.response.model'],
                  attributes['gen_ai.request.model']) AS model,
               toInt64OrNull(attributes['gen_ai.usage.input_tokens']) AS input_tokens,
               toInt64OrNull(attributes['gen_ai.usage.output_tokens']) AS output_tokens,
               toUInt64OrZero(attributes['rlpulse.content.cut_chars']) AS content_cut
        FROM {{db}}.spans
        WHERE project = {{project:String}} AND run_id = {{run:String}} AND attempt = {{attempt:UInt32}}
          AND sequence_id BETWEEN {{lo:UInt64}} AND {{hi:UInt64}} AND has({{ids:Array(String)}}, rollout_id)
          AND kind IN ('ROLLOUT', 'REWARD', 'LLM')
        ORDER BY span_id, sequence_id LIMIT 1 BY span_id),
    traj AS (
        SELECT rollout_id, anyIf(step, kind = 'ROLLOUT') AS step, anyIf(sample, kind = 'ROLLOUT') AS sample_id,
               ifNull(anyIf(reward, kind = 'ROLLOUT'), anyIf(reward, kind = 'REWARD')) AS reward,
               anyIf(status, kind = 'ROLLOUT') AS status
        FROM page GROUP BY rollout_id),
    calls AS (
        SELECT *, if(isValidJSON(output_raw) AND JSONType(output_raw) = 'Array', JSONExtractRaw(output_raw, 1),
                     output_raw) AS response_raw,
               toUInt32(row_number() OVER (PARTITION BY rollout_id ORDER BY sequence_id, start_time_ns, span_id) - 1) AS turn,
               count() OVER (PARTITION BY rollout_id) AS turns
        FROM page WHERE kind = 'LLM')
"""

_TRIPLETS = _PAGE + """
    SELECT {{project:String}} AS project, {{run:String}} AS run_id, {{attempt:UInt32}} AS attempt, t.step AS step,
           t.sample_id AS sample_id, c.rollout_id AS rollout_id, c.turn AS turn, toBool(c.turn + 1 = c.turns) AS `final`,
           c.model AS model, nullIf(c.prompt_raw, '') AS prompt, nullIf(c.response_raw, '') AS response,
           t.reward AS reward, t.status AS status,
           c.status AS call_status, c.input_tokens AS input_tokens, c.output_tokens AS output_tokens,
           c.content_cut AS content_cut
    FROM calls AS c INNER JOIN traj AS t ON c.rollout_id = t.rollout_id
    ORDER BY indexOf({{ids:Array(String)}}, rollout_id), turn
"""

_MESSAGES = _PAGE + """
    , last AS (
        SELECT rollout_id, argMax(prompt_raw, turn) AS prompt, argMax(response_raw, turn) AS response,
               argMax(tools_raw, turn) AS tools, count() AS calls, sum(content_cut) AS content_cut,
               sumOrNull(input_tokens) AS input_tokens, sumOrNull(output_tokens) AS output_tokens
        FROM calls GROUP BY rollout_id)
    SELECT {{project:String}} AS project, {{run:String}} AS run_id, {{attempt:UInt32}} AS attempt, t.step AS step,
           t.sample_id AS sample_id, l.rollout_id AS rollout_id, t.reward AS reward, t.status AS status,
           if(isValidJSON(l.prompt) AND JSONType(l.prompt) = 'Array' AND isValidJSON(l.response)
              AND JSONType(l.response) = 'Object',
              concat(substring(trimRight(l.prompt), 1, length(trimRight(l.prompt)) - 1),
                     if(JSONLength(l.prompt) = 0, '', ','), l.response, ']'), NULL) AS messages,
           nullIf(l.tools, '') AS tools, l.calls AS calls, l.input_tokens AS input_tokens, l.output_tokens AS output_tokens,
           l.content_cut AS content_cut
    FROM last AS l INNER JOIN traj AS t ON l.rollout_id = t.rollout_id
    ORDER BY indexOf({{ids:Array(String)}}, rollout_id)
"""

_JSON_COLUMNS = {"triplets": ("prompt", "response"), "messages": ("messages", "tools")}
_COLUMNS = {
    "triplets": ("project", "run_id", "attempt", "step", "sample_id", "rollout_id", "turn", "final", "model", "prompt",
                 "response", "reward", "status", "call_status", "input_tokens", "output_tokens", "content_cut"),
    "messages": ("project", "run_id", "attempt", "step", "sample_id", "rollout_id", "reward", "status", "messages",
                 "tools", "calls", "input_tokens", "output_tokens", "content_cut"),
}


def page_sql(what: str, fmt: str, database: str) -> str:
    """The query of one page of ``what`` in ``fmt``; JSONL rows are one JSON object each, built in SQL."""
    body = (_TRIPLETS if what == "triplets" else _MESSAGES).format(sample=SAMPLE_SQL).replace("{db}", database)
    if fmt == "parquet":
        return body
    def value(c: str) -> str:
        return _json_or_text(f"ifNull(`{c}`, '')") if c in _JSON_COLUMNS[what] else _js(f"`{c}`")

    parts = [f"'{'{' if i == 0 else ','}\"{c}\":', {value(c)}" for i, c in enumerate(_COLUMNS[what])]
    return f"SELECT concat({', '.join(parts)}, '}}') AS line FROM ({body})"


def _page_params(page: list[Key]) -> dict[str, Any]:
    first = page[0]
    return {"project": first.project, "run": first.run_id, "attempt": first.attempt, "ids": [k.rollout_id for k in page],
            "lo": min(k.min_seq for k in page), "hi": max(k.max_seq for k in page)}


# -- writing -------------------------------------------------------------------------------------------

def export(store: Store, what: str, out: BinaryIO, fmt: str, filters: Filters = Filters(),
           page_size: int = PAGE_SIZE, key_page: int = KEY_PAGE) -> Exported:
    """Write the selected trajectories as ``what`` (triplets or messages) in ``fmt`` (jsonl or parquet) to ``out``."""
    if what not in KINDS:
        raise ValueError(f"export what? one of {', '.join(KINDS)}; got {what!r}")
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if type(page_size) is not int or page_size < 1:
        raise ValueError(f"--page-size must be a positive integer, got {page_size!r}")
    filters.check()
    counts = Exported()
    sql = page_sql(what, fmt, store.database)
    writer = None
    try:
        for page in pages(keys(store, filters, key_page), page_size, counts):
            counts.pages += 1
            if fmt == "jsonl":
                stream = store.client.raw_stream(sql, parameters=_page_params(page), settings=READ, fmt="TabSeparatedRaw")
                with contextlib.closing(stream):  # consumed and closed before the next query (chDB allows one at a time)
                    while chunk := stream.read(1 << 20):
                        out.write(chunk)
                        counts.rows += chunk.count(b"\n")
            else:
                table = _parquet_page(store, sql, _page_params(page))
                writer = writer or _parquet_writer(out, table.schema)
                writer.write_table(table)
                counts.rows += table.num_rows
        if fmt == "parquet" and writer is None:  # nothing selected: an empty file with the columns
            empty = {"project": "", "run": "", "attempt": 0, "ids": [], "lo": 1, "hi": 0}
            table = _parquet_page(store, sql, empty)
            writer = _parquet_writer(out, table.schema)
            writer.write_table(table)
    finally:
        if writer is not None:
            writer.close()
    return counts


def _parquet_page(store: Store, sql: str, params: dict[str, Any]) -> Any:
    import pyarrow.parquet as pq

    data = store.client.raw_query(sql, parameters=params, settings=READ, fmt="Parquet")
    return pq.read_table(io.BytesIO(data))


def _parquet_writer(out: BinaryIO, schema: Any) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # chDB's extra brings it; a server-only install may lack it
        raise RuntimeError("Parquet export needs pyarrow (pip install pyarrow); JSONL needs nothing more") from None
    return pq.ParquetWriter(out, schema)


def format_of(path: str, fmt: str | None) -> str:
    """``--format``, else the output's extension (.parquet, else jsonl)."""
    if fmt is not None:
        return fmt
    return "parquet" if path.endswith((".parquet", ".pq")) else "jsonl"


def export_to(store: Store, what: str, path: str, fmt: str | None = None, filters: Filters = Filters(),
              page_size: int = PAGE_SIZE) -> Exported:
    """Export to ``path`` ('-': standard output, JSONL only), written whole or not at all: a temporary
    file beside it (the owner's only) renamed into place once the last page is in."""
    fmt = format_of(path, fmt)
    if path == "-":
        if fmt != "jsonl":
            raise ValueError("Parquet goes to a file: give --output PATH")
        return export(store, what, sys.stdout.buffer, fmt, filters, page_size)
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent if str(target.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as out:
            counts = export(store, what, out, fmt, filters, page_size)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return counts
