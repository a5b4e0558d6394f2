"""Content kept within bounds by the sink: a cap on full trajectories per step, a cap on any one value.

Spans with content (prompts, completions, tool calls) grow fast, so the sink can store only some of
them in full. Both caps act on the ``spans`` rows the sink writes and on nothing else: the streams
compute every figure (step stats, windows, histograms) from the raw topics, so the figures count
every event whatever is capped here.

* **Trajectories per step** (``RLPULSE_SPAN_CAP`` = N, 0: no cap): per (project, run_id, attempt,
  step), the first N trajectories (``rollout_id``: a ROLLOUT span and every LLM, TOOL, REWARD and
  GRADER span under it carry it) to reach the sink keep their spans in full. The spans of the
  others are still stored, with their ids, times, status, reward, score and outcome, so span trees
  and every per-span figure stay whole; they lose their content attributes (the GenAI message and
  tool-call attributes, and any value over :data:`SHORT_VALUE` characters) and are marked
  ``content_capped = 1``. Spans without a step (checkpoints, custom spans) are never capped.
* **Characters per value** (``RLPULSE_SINK_CONTENT_MAX_CHARS``, 65,536 by default as the SDK's own
  limit; 0: no cap): the SDK cuts what it records (``rlpulse.producers.tracing.content``), other
  writers (an OpenTelemetry exporter of their own, a raw producer) may not; the sink cuts each
  attribute value, and the status message, to that many characters, with a marker saying how many went.

Each row says what it lost: ``content_cut_chars`` counts the characters the sink removed (the SDK's
own cut stays in the attribute ``rlpulse.content.cut_chars``); the saved query ``content-dropped``
sums both per run and step.

**How, without decoding in Python.** The sink still hands ClickHouse the containers as they came;
only the INSERT's SELECT changes (:func:`bounded_plan`), and only when a cap is on: with both off
the INSERT is the plain one. The first N is decided in that one statement, by arrival order (the
row number in the checkpoint's container, which keeps the partition's order, and a run lives on
one partition): a trajectory already stored in full stays in full, a new one is kept while the
step has fewer than N. The trajectories a step already holds in full are read from ``spans`` for
the runs the messages' keys name, so a later checkpoint, a restarted sink or a replayed offset
range decides each trajectory as before, and a trajectory's spans are kept or capped together
whichever checkpoint brings them. A message whose key does not name its records' run (a hostile
writer) can only lift its run's cap by N per checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rlpulse.sinks.store.avro_sql import InsertPlan, sql_ident, sql_quote
from rlpulse.sinks.store.retention import quote

# The attributes that hold content (OpenTelemetry GenAI semantic conventions, as the SDK records them).
CONTENT_KEYS = ("gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.system_instructions",
                "gen_ai.tool.definitions", "gen_ai.tool.call.arguments", "gen_ai.tool.call.result")
# A capped span keeps its other attributes up to this many bytes (model, token counts, finish
# reasons); longer values are content written under other names.
SHORT_VALUE = 256
_SOURCE, _DB = "\0SOURCE\0", "\0DB\0"  # markers: quote() escapes NUL, so no literal can contain one


@dataclass(frozen=True)
class Bounds:
    """The sink's caps (``Settings.span_cap``, ``Settings.sink_content_max_chars``); 0 turns one off."""

    span_cap: int = 0
    max_chars: int = 0

    @property
    def active(self) -> bool:
        return self.span_cap > 0 or self.max_chars > 0


@dataclass(frozen=True)
class BoundedPlan(InsertPlan):
    """An InsertPlan whose SELECT reads the container in a subquery (``query`` holds the markers)."""

    query: str = ""

    def _sql(self, database: str, source: str) -> str:
        cols = ", ".join(sql_ident(c) for c in self.columns)
        return f"INSERT INTO {database}.{self.table} ({cols}) " + self.query.replace(_DB, database).replace(_SOURCE, source)

    def sql_from_file(self, database: str, path: str, token: str) -> str:
        source = f"file({sql_quote(path)}, 'Avro', {sql_quote(self.structure)})"
        return self._sql(database, source) + f" SETTINGS insert_deduplication_token = {sql_quote(token)}"

    def sql_from_input(self, database: str) -> str:
        return self._sql(database, f"input({sql_quote(self.structure)})") + " FORMAT Avro"


def _value_cap(m: int, v: str = "v") -> tuple[str, str]:
    """Expressions of the string ``v`` (a lambda's argument, or a column): it cut to ``m`` characters, and
    the characters that cuts."""
    if m <= 0:
        return v, "0"
    over = f"(length({v}) > {m} AND lengthUTF8({v}) > {m})"  # bytes first: lengthUTF8 only for long values
    cut = f"concat(leftUTF8({v}, {m}), '…[rlpulse sink: ', toString(lengthUTF8({v}) - {m}), ' characters cut]')"
    return f"if({over}, {cut}, {v})", f"if({over}, toUInt64(lengthUTF8({v}) - {m}), 0)"


def _content() -> str:
    keys = ", ".join(quote(k) for k in CONTENT_KEYS)
    return f"(k IN ({keys}) OR length(v) > {SHORT_VALUE})"


def _runs_filter(keys: Iterable[bytes | None]) -> str:
    """Rows of the runs the messages' keys (``project/run_id``) name; a project may hold ``/``."""
    names: set[str] = set()
    projects: set[str] = set()
    for key in keys:
        if key is None:
            continue
        text = key.decode("utf-8", errors="replace")
        names.add(text)
        parts = text.split("/")
        projects.update("/".join(parts[:i]) for i in range(1, len(parts)))
    if not names:
        return "0"
    return (f"project IN ({', '.join(quote(p) for p in sorted(projects))}) "  # the sorting key's first column
            f"AND concat(project, '/', run_id) IN ({', '.join(quote(n) for n in sorted(names))})")


def bounded_plan(plan: InsertPlan, bounds: Bounds, keys: Iterable[bytes | None]) -> InsertPlan:
    """``plan`` (the spans table's) with ``bounds`` applied; ``plan`` itself when both caps are off.

    ``keys``: the Kafka keys of the messages inserted, whose runs' full trajectories are looked up.
    """
    if not bounds.active or plan.table != "spans" or "attributes" not in plan.columns:
        return plan
    cols = list(plan.columns)
    inner = ", ".join(f"{e} AS _c{i}" for i, e in enumerate(plan.expressions))
    c = {name: f"_c{cols.index(name)}" for name in ("project", "run_id", "attempt", "step", "rollout_id", "attributes",
                                                    "status_message") if name in cols}
    attrs = c["attributes"]
    cap, cap_cut = _value_cap(bounds.max_chars)
    # byteSize (native, no lambda) lets the rows whose attributes are all short, nearly every row, skip
    # the per-value work: if() evaluates a branch only for the rows that take it.
    short = f"byteSize({attrs}) <= {int(bounds.max_chars)}"
    full = f"if({short}, {attrs}, mapApply((k, v) -> (k, {cap}), {attrs}))" if bounds.max_chars > 0 else attrs
    full_cut = (f"if({short}, toUInt64(0), arraySum(v -> {cap_cut}, mapValues({attrs})))" if bounds.max_chars > 0
                else "toUInt64(0)")
    # The status message (an error's text, up to 64 KiB from the SDK) is held to the same cap, and kept on capped spans.
    message, message_cut = c.get("status_message"), "toUInt64(0)"
    if message is not None and bounds.max_chars > 0:
        message_cap, message_cut = _value_cap(bounds.max_chars, message)
    if bounds.span_cap <= 0 or not {"project", "run_id", "attempt", "step", "rollout_id"} <= c.keys():
        # Only the value cap (or a writer without run or step ids: nothing to count trajectories by).
        keep, rows = "1", f"(SELECT {inner} FROM {_SOURCE})"
    else:
        source = f"SELECT {inner}, rowNumberInAllBlocks() AS _row FROM {_SOURCE}"
        p, r, a, s, ro = c["project"], c["run_id"], c["attempt"], c["step"], c["rollout_id"]
        kept = (f"SELECT project AS _kp, run_id AS _kr, attempt AS _ka, step AS _ks, groupUniqArray(rollout_id) AS _kept "
                f"FROM {_DB}.spans WHERE {_runs_filter(keys)} AND step IS NOT NULL AND content_capped = 0 "
                f"GROUP BY _kp, _kr, _ka, _ks")
        # Per trajectory its first row (arrival order); whether the step already holds it in full, and how many it holds.
        seen = (f"SELECT *, min(_row) OVER (PARTITION BY {p}, {r}, {a}, {s}, {ro}) AS _first, has(_kept, {ro}) AS _old, "
                f"length(_kept) AS _n FROM ({source}) AS _b LEFT JOIN ({kept}) AS _k "
                f"ON {p} = _kp AND {r} = _kr AND {a} = _ka AND ifNull({s}, -1) = _ks")
        # The new trajectories of each step, numbered in arrival order.
        rows = (f"(SELECT *, dense_rank() OVER (PARTITION BY {p}, {r}, {a}, {s}, _old ORDER BY _first, {ro}) AS _rank "
                f"FROM ({seen}))")
        keep = f"({s} IS NULL OR _old OR _n + _rank <= {int(bounds.span_cap)})"
    strip = f"mapFilter((k, v) -> NOT {_content()}, {attrs})"
    strip_cut = f"arraySum(v -> toUInt64(lengthUTF8(v)), mapValues(mapFilter((k, v) -> {_content()}, {attrs})))"
    outer = [f"_c{i}" if name != "attributes" else (full if keep == "1" else f"if({keep}, {full}, {strip})")
             for i, name in enumerate(cols)]
    if message_cut != "toUInt64(0)":
        outer[cols.index("status_message")] = message_cap
    outer.append("toUInt8(0)" if keep == "1" else f"toUInt8(NOT {keep})")
    outer.append((full_cut if keep == "1" else f"if({keep}, {full_cut}, {strip_cut})") + f" + {message_cut}")
    query = f"SELECT {', '.join(outer)} FROM {rows}"
    return BoundedPlan(table=plan.table, columns=(*plan.columns, "content_capped", "content_cut_chars"),
                       structure=plan.structure, select=plan.select, expressions=plan.expressions, query=query)
