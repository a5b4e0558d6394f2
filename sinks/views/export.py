"""``rlpulse export triplets|messages``: trajectories out of ``spans`` for training (seed 003's adapters).

* **triplets**: one row per *policy* call of a trajectory (agent-lightning's ``TracerTraceToTriplet``): the
  call's ``prompt`` (the chat messages it sent), its ``response`` (the assistant message that came back),
  ``prompt_ids`` / ``response_ids`` / ``response_logprobs`` when the tracer recorded them, and a
  ``reward`` placed by ``--reward-to`` (``trajectory_reward``: the final one), with ``turn`` (the call's
  place among the exported calls, from 0) and ``final`` (the last of them).
* **messages**: one row per trajectory with a policy call: ``messages``, the policy's OpenAI chat
  conversation (its last policy call's messages, which an agent loop resends whole, plus that call's reply:
  system, user, assistant with ``tool_calls``, tool), the ``tools`` that call offered, the final reward.
  ``--per-call``: one row per call, its own messages plus its reply (``TraceToMessages``).

The policy's calls are the LLM spans with no REWARD entry or GRADER span above them: a reward function's
judge is not a turn of the trajectory, nor is its prompt the conversation. ``--include-grader-calls``
adds them to triplets and per-call rows, marked ``grader_call`` and given no reward. What is a policy
call, where each reward goes and how token ids are checked: ``rlpulse.sinks.views.export_sql``.

Prompts and replies are the content the tracer recorded (``rlpulse.producers.tracing``, content on); a
call recorded without content exports null prompt and response, and a cut one counts its cut
characters in ``content_cut``. A trajectory is a ROLLOUT span with a ``rollout_id``; filters: project,
run, step range, sample, minimum reward, status of the ROLLOUT span.

ClickHouse writes every byte: JSONL rows are built by the query (nested JSON: ``prompt``, ``response``,
``messages`` and ``tools`` as arrays and objects, every other value through ``toJSONString``) and sent
as ``TabSeparatedRaw``; Parquet pages are ClickHouse's ``FORMAT Parquet`` (those four as JSON text, the
token ids as lists), appended by pyarrow as row groups of one file (``datasets.load_dataset("parquet")``
reads it). The queries run read-only (``readonly=1``, or the sink's read endpoint), so the sink may go
on writing meanwhile.

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
from rlpulse.sinks.views.export_sql import PLACEMENTS, page_sql
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
    # every kind: a page's sequence range must hold the spans between a call and its ROLLOUT (a REWARD entry,
    # a tool) to tell the policy's calls from a grader's, and the reward annotations to place them
    inner, outer, params = ["rollout_id != ''"], ["entries > 0"], {}
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


# -- one page of rows (the SQL: rlpulse.sinks.views.export_sql) ------------------------------------------

@dataclass(frozen=True)
class Shape:
    """What a row is: ``per_call`` (messages: one row per call), where rewards go, whether grader calls come too."""
    per_call: bool = False
    reward_to: str = "last-call"
    include_grader_calls: bool = False

    def check(self) -> None:
        if self.reward_to not in PLACEMENTS:
            raise ValueError(f"--reward-to must be one of {', '.join(PLACEMENTS)}; got {self.reward_to!r}")

    def query(self, what: str) -> str:
        return "per-call" if what == "messages" and self.per_call else what


def _page_params(page: list[Key], shape: Shape) -> dict[str, Any]:
    first = page[0]
    return {"project": first.project, "run": first.run_id, "attempt": first.attempt, "ids": [k.rollout_id for k in page],
            "lo": min(k.min_seq for k in page), "hi": max(k.max_seq for k in page), "reward_to": shape.reward_to,
            "graders": int(shape.include_grader_calls)}


# -- writing -------------------------------------------------------------------------------------------

def export(store: Store, what: str, out: BinaryIO, fmt: str, filters: Filters = Filters(),
           page_size: int = PAGE_SIZE, key_page: int = KEY_PAGE, shape: Shape = Shape()) -> Exported:
    """Write the selected trajectories as ``what`` (triplets or messages) in ``fmt`` (jsonl or parquet) to ``out``."""
    if what not in KINDS:
        raise ValueError(f"export what? one of {', '.join(KINDS)}; got {what!r}")
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if type(page_size) is not int or page_size < 1:
        raise ValueError(f"--page-size must be a positive integer, got {page_size!r}")
    filters.check()
    shape.check()
    counts = Exported()
    sql = page_sql(shape.query(what), fmt, store.database)
    writer = None
    try:
        for page in pages(keys(store, filters, key_page), page_size, counts):
            counts.pages += 1
            if fmt == "jsonl":
                stream = store.client.raw_stream(sql, parameters=_page_params(page, shape), settings=READ, fmt="TabSeparatedRaw")
                with contextlib.closing(stream):  # consumed and closed before the next query (chDB allows one at a time)
                    while chunk := stream.read(1 << 20):
                        out.write(chunk)
                        counts.rows += chunk.count(b"\n")
            else:
                table = _parquet_page(store, sql, _page_params(page, shape))
                writer = writer or _parquet_writer(out, table.schema)
                writer.write_table(table)
                counts.rows += table.num_rows
        if fmt == "parquet" and writer is None:  # nothing selected: an empty file with the columns
            empty = {"project": "", "run": "", "attempt": 0, "ids": [], "lo": 1, "hi": 0, "reward_to": shape.reward_to,
                     "graders": 0}
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
              page_size: int = PAGE_SIZE, shape: Shape = Shape()) -> Exported:
    """Export to ``path`` ('-': standard output, JSONL only), written whole or not at all: a temporary
    file beside it (the owner's only) renamed into place once the last page is in."""
    fmt = format_of(path, fmt)
    if path == "-":
        if fmt != "jsonl":
            raise ValueError("Parquet goes to a file: give --output PATH")
        return export(store, what, sys.stdout.buffer, fmt, filters, page_size, shape=shape)
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent if str(target.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as out:
            counts = export(store, what, out, fmt, filters, page_size, shape=shape)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return counts
