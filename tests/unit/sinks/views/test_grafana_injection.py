"""Dashboard variables cannot inject SQL: every panel, rendered as Grafana renders it with a hostile
value in a variable, is still one SELECT whose only change is one string literal, and that literal
is the value.

Anonymous viewers set the variables from the URL (``?var-run_id=...``). ``grafana_interpolate`` does
what Grafana does with the formats (sinks/views/grafana.py names the source); ClickHouse's own parser
(chDB's ``EXPLAIN AST``, in a subprocess: chDB opens one engine per process) reads the result.
The same check shows how the plugin's default format and Grafana's ``sqlstring`` let a value out.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlpulse.sinks.views.grafana import VARIABLE, dashboard, flat_panels, grafana_interpolate
from tests.unit.sinks.views.test_grafana import MACROS, SERIES

REPO = Path(__file__).resolve().parents[4]
HOSTILE = [
    "x') OR 1=1 --",
    "x\\",
    "x\\' OR 1=1 --",
    "'; DROP TABLE rlpulse.spans; --",
    "a\nb",
    "é€😀 \"q\" %27 ${run_id} $__toTime_ms",
    "",
]
# Values that appear nowhere else in the SQL, so each one's literal marks that variable's places.
BENIGN = {"run_id": "benign-run", "attempt": "7", "rollout_id": "benign-rollout"}
ENCODED = re.compile(r"[A-Za-z0-9_.~%-]*")


def percentencode(value: str) -> str:
    return grafana_interpolate("${v:percentencode}", {"v": value})


def render(sql: str, values: dict[str, str]) -> str:
    sql = grafana_interpolate(sql, values)
    for macro, value in MACROS.items():
        sql = sql.replace(macro, value)
    return sql


def panel_sql() -> dict[str, str]:
    """Every panel's SQL by title: the time series' and the tables' in the collapsed Tables row."""
    return {p["title"]: p["targets"][0]["rawSql"] for p in flat_panels(dashboard())}


def variables_in(sql: str) -> set[str]:
    return {m.group(1) or m.group(2) or m.group(4) for m in VARIABLE.finditer(sql)} & set(BENIGN)


SCRIPT = textwrap.dedent("""
    import json, sys
    import chdb
    out = {}
    for key, sql in json.loads(sys.stdin.read()).items():
        try:
            out[key] = ["ok", chdb.query(sql, "TSVRaw").bytes().decode()]
        except Exception as exc:
            out[key] = ["error", str(exc).splitlines()[0][:300]]
    print(json.dumps(out))
""")


def clickhouse(queries: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Each query's [status, TSVRaw output] from chDB (in-memory, one process for all)."""
    run = subprocess.run([sys.executable, "-c", SCRIPT], input=json.dumps(queries), cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return {key: tuple(value) for key, value in json.loads(run.stdout).items()}


def test_grafana_formats_as_grafana_does() -> None:
    # encodeURIComponentStrict leaves only A-Za-z0-9 - _ . ~ and %XX (UTF-8, upper-case hex).
    assert percentencode("x') OR 1=1 --") == "x%27%29%20OR%201%3D1%20--"
    assert percentencode("a-b_c.d~e!*'()\\\n€") == "a-b_c.d~e%21%2A%27%28%29%5C%0A%E2%82%AC"
    assert grafana_interpolate("${v:sqlstring}", {"v": "it's \"q\" \\"}) == "'it''s \\\"q\\\" \\'"
    assert grafana_interpolate("${v:singlequote}", {"v": "it's"}) == "'it\\'s'"
    # The plugin's own format: a single value as it is; $v and [[v]] too; macros and unknown names stay.
    assert grafana_interpolate("$v [[v]] ${v} ${v:raw} $__fromTime_ms ${w}", {"v": "a'b"}) == \
        "a'b a'b a'b a'b $__fromTime_ms ${w}"
    # One pass: a value that looks like a variable is not interpolated again.
    assert grafana_interpolate("${a:raw}", {"a": "${b}", "b": "no"}) == "${b}"
    with pytest.raises(ValueError, match="format 'glob'"):
        grafana_interpolate("${v:glob}", {"v": "x"})


def test_every_panel_variable_is_one_percent_encoded_literal() -> None:
    for name, sql in panel_sql().items():
        for m in VARIABLE.finditer(sql):
            variable = m.group(1) or m.group(2) or m.group(4)
            if variable.startswith("__"):
                continue  # the plugin's macros: numbers from the time range, not user text
            assert m.group(0) == f"${{{variable}:percentencode}}", f"{name}: {m.group(0)} is not percent-encoded"
            start = m.start()
            assert sql[start - len("decodeURLComponent('"):start] == "decodeURLComponent('" and sql[m.end()] == "'", name
    for value in HOSTILE:
        assert ENCODED.fullmatch(percentencode(value)), value


@pytest.mark.full  # about 10 s of EXPLAIN AST, growing with each panel: make test-all (make test keeps its 6 minutes)
def test_hostile_values_stay_one_literal_in_every_panel() -> None:
    pytest.importorskip("chdb")
    queries, expected = {}, []
    for name, sql in panel_sql().items():
        queries[f"{name}|benign"] = "EXPLAIN AST " + render(sql, BENIGN)
        for variable in sorted(variables_in(sql)):
            for i, value in enumerate(HOSTILE):
                key = f"{name}|{variable}|{i}"
                queries[key] = "EXPLAIN AST " + render(sql, {**BENIGN, variable: value})
                expected.append((key, name, variable, value))
    for i, value in enumerate(HOSTILE):
        queries[f"decode|{i}"] = f"SELECT hex(decodeURLComponent('{percentencode(value)}'))"
    assert {(name, variable) for _, name, variable, _ in expected} == {
        ("clipped-ratio-trend", "run_id"), ("clipped-ratio-trend", "attempt"), ("gpu-utilization-by-run", "run_id"),
        ("reward-percentiles", "run_id"), ("reward-percentiles", "attempt"), ("span-tree", "run_id"),
        ("span-tree", "attempt"), ("span-tree", "rollout_id"), ("step-metrics", "run_id"), ("checkpoints", "run_id"),
        ("failures-by-step", "run_id"), ("engine-by-step", "run_id"), ("engine-by-step", "attempt"),
        ("trace-calls", "run_id"), ("content-dropped", "run_id"), ("final-rewards", "run_id"),
        ("final-rewards", "attempt"), ("reward-spans", "run_id"), ("reward-spans", "attempt"), ("reward-spans", "rollout_id"),
        ("step-throughput", "run_id"), ("step-throughput", "attempt"),
        ("term-figures", "run_id"), ("rollout-metrics", "run_id"), ("run-config", "run_id"),
        # the time series: each of the dashboard's run and attempt
        *((title, variable) for title in SERIES for variable in ("run_id", "attempt"))}
    out = clickhouse(queries)

    for key, name, variable, value in expected:
        status, ast = out[key]
        assert status == "ok", (key, ast)
        benign_status, benign_ast = out[f"{name}|benign"]
        assert benign_status == "ok", benign_ast
        lines, benign_lines = ast.splitlines(), benign_ast.splitlines()
        assert lines[0].startswith("SelectWithUnionQuery"), (key, lines[0])  # one SELECT, nothing after it
        assert len(lines) == len(benign_lines), f"{key}: the value changed the statement's shape"
        literal, benign_literal = f"Literal '{percentencode(value)}'", f"Literal '{percentencode(BENIGN[variable])}'"
        changed = [(a.strip(), b.strip()) for a, b in zip(lines, benign_lines) if a != b]
        places = sum(1 for b in benign_lines if b.strip() == benign_literal)
        assert places >= 1
        if value != BENIGN[variable]:
            assert changed == [(literal, benign_literal)] * places, (key, changed)
    for i, value in enumerate(HOSTILE):
        assert out[f"decode|{i}"] == ("ok", value.encode().hex().upper() + "\n"), value


@pytest.mark.parametrize("template", ["'${run_id}'", "${run_id:sqlstring}", "${run_id:singlequote}"])
def test_the_formats_not_used_let_a_value_out(template: str) -> None:
    """Why percentencode: with these, a value ends the literal and adds an OR 1 = 1 to the WHERE."""
    pytest.importorskip("chdb")
    sql = "SELECT count() FROM rlpulse.steps WHERE run_id = " + template + " AND attempt = 1"
    value = "x\\' OR 1=1 --" if "quote" in template or "sqlstring" in template else "x' OR 1=1 --"
    out = clickhouse({"evil": "EXPLAIN AST " + grafana_interpolate(sql, {"run_id": value}),
                      "benign": "EXPLAIN AST " + grafana_interpolate(sql, {"run_id": "x"})})
    assert out["benign"][0] == "ok" and "Function or" not in out["benign"][1]
    assert out["evil"][0] == "ok" and "Function or" in out["evil"][1], out["evil"]


END_TO_END = textwrap.dedent("""
    import json, sys, time
    from rlpulse.sinks.store.clickhouse import migrate, open_store
    values, queries = json.loads(sys.argv[2]), json.loads(sys.argv[3])
    now = time.time_ns()
    with open_store(sys.argv[1], owner="test") as store:
        migrate(store)
        stats = ["project", "run_id", "attempt", "step", "rollouts", "clipped", "clipped_ratio", "emitted_at_ns"]
        store.client.insert("rlpulse.step_stats", [["p", v, 1, 3, 10, i, i / 10, now] for i, v in enumerate(values)],
                            column_names=stats)
        spans = ["project", "run_id", "attempt", "rollout_id", "span_id", "sequence_id", "name", "start_time_ns", "end_time_ns"]
        store.client.insert("rlpulse.spans", [["p", v, 1, v, f"s{i}", i, f"span {i}", now, now + 1000]
                                              for i, v in enumerate(values)], column_names=spans)
        print(json.dumps({key: store.client.query(sql, settings={"readonly": 1}).result_rows
                          for key, sql in queries.items()}, default=str))
""")


def test_panels_with_hostile_values_select_exactly_that_run(tmp_path: Path) -> None:
    """On a store whose run_ids and rollout_ids are the hostile values: each value's panel shows its own row only."""
    pytest.importorskip("chdb")
    values = [v for v in HOSTILE if v] + ["benign-run"]
    sql = panel_sql()
    queries = {}
    for i, value in enumerate(values):
        queries[f"trend|{i}"] = render(sql["clipped-ratio-trend"], {"run_id": value, "attempt": "1"})
        queries[f"tree|{i}"] = render(sql["span-tree"], {"run_id": value, "attempt": "1", "rollout_id": value})
    run = subprocess.run([sys.executable, "-c", END_TO_END, f"chdb://{tmp_path / 'ch'}", json.dumps(values),
                          json.dumps(queries)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    for i, value in enumerate(values):
        assert out[f"trend|{i}"] == [[3, 10, i, round(i / 10, 4), None]], (value, out[f"trend|{i}"])
        assert [(row[0], row[2], row[3]) for row in out[f"tree|{i}"]] == [(i, f"span {i}", f"s{i}")], value
