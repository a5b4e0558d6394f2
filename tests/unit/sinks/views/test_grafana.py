"""The provisioned Grafana dashboard: rows of time series by question, then a table per saved query,
and the compose file provisions it.

Nothing here starts Grafana or Docker: the dashboard JSON is compared with its generator, its layout
is checked exactly, each panel's SQL is checked (and, where chDB is installed, run on a migrated
store with the variables and the plugin's macros expanded as Grafana would: every panel on an empty
one, each time series on one with rows, for exactly the rows it should draw), and the YAML files
are parsed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlpulse.sinks.read.queries import list_saved
from rlpulse.sinks.views.grafana import (DATASOURCE, RUN_IDS_SQL, UnmappedParameterError, dashboard, flat_panels,
                                         grafana_interpolate, grafana_sql)
from rlpulse.sinks.views.grafana_panels import ROWS, TimeSeries

REPO = Path(__file__).resolve().parents[4]
CHECKED_IN = REPO / "deploy" / "grafana" / "dashboards" / "rlpulse.json"
PROVISIONING = REPO / "deploy" / "grafana" / "provisioning"
REGENERATE = "python -m rlpulse.sinks.views.grafana > deploy/grafana/dashboards/rlpulse.json"
# The dashboard variables' values for a test (Grafana formats them), and what the ClickHouse plugin
# puts in place of its macros.
TEST_VALUES = {"run_id": "run-1", "attempt": "1", "rollout_id": "rollout-1"}
MACROS = {
    "$__fromTime_ms": "fromUnixTimestamp64Milli(1735689600000)",
    "$__toTime_ms": "fromUnixTimestamp64Milli(1735776000000)",
}
LEFTOVER = re.compile(r"\{\w+(:[^{}]*)?\}|\$")


def expanded(sql: str, values: dict[str, str] = TEST_VALUES) -> str:
    sql = grafana_interpolate(sql, values)
    for macro, value in MACROS.items():
        sql = sql.replace(macro, value)
    return sql


def panels_by_query() -> dict[str, list[dict]]:
    """The tables (in the collapsed Tables row) by title: a saved query's name."""
    out: dict[str, list[dict]] = {}
    for panel in flat_panels(dashboard()):
        if panel["type"] == "table":
            out.setdefault(panel["title"], []).append(panel)
    return out


def series_panels() -> dict[str, dict]:
    return {p["title"]: p for p in flat_panels(dashboard()) if p["type"] == "timeseries"}


SERIES: dict[str, TimeSeries] = {ts.title: ts for _, row in ROWS for ts in row}


def test_checked_in_dashboard_is_the_generated_one() -> None:
    assert CHECKED_IN.is_file(), f"{CHECKED_IN} is missing; generate it with `{REGENERATE}`"
    assert json.loads(CHECKED_IN.read_text()) == dashboard(), (
        f"deploy/grafana/dashboards/rlpulse.json is stale (a saved query or sinks/views/grafana.py changed); "
        f"regenerate it with `{REGENERATE}`")


def test_main_prints_sorted_indented_json(capsys: pytest.CaptureFixture[str]) -> None:
    from rlpulse.sinks.views.grafana import main

    main()
    assert capsys.readouterr().out == json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


def test_every_saved_query_has_exactly_one_table_with_no_placeholder_left() -> None:
    panels = panels_by_query()
    assert list(panels) == list(list_saved()), "tables and saved queries differ"
    for name, found in panels.items():
        assert len(found) == 1, f"{name}: {len(found)} panels"
        (target,) = found[0]["targets"]
        assert target["datasource"] == DATASOURCE and found[0]["datasource"] == DATASOURCE
        assert target["editorType"] == "sql" and target["format"] == 1 and target["queryType"] == "table"
        sql = expanded(target["rawSql"])
        assert not LEFTOVER.search(sql), f"{name}: leftover {LEFTOVER.search(sql).group(0)!r} in\n{sql}"
        assert "rlpulse." in sql


def test_parameters_map_to_variables_and_macros() -> None:
    sql = "SELECT * FROM {db}.t WHERE a = {run_id:String} AND b = {attempt:UInt32} AND c = {rollout_id:String}" \
          " AND t >= {since:DateTime64(3, 'UTC')} AND t < {until:DateTime64(3, 'UTC')}"
    assert grafana_sql("q", "-- {comment:Ignored}\n" + sql) == (
        "SELECT * FROM rlpulse.t WHERE a = decodeURLComponent('${run_id:percentencode}')"
        " AND b = toUInt32(decodeURLComponent('${attempt:percentencode}'))"
        " AND c = decodeURLComponent('${rollout_id:percentencode}')"
        " AND t >= $__fromTime_ms AND t < $__toTime_ms")


@pytest.mark.parametrize("param", ["{step:UInt64}", "{run_id:UInt64}", "{since:String}"])
def test_a_parameter_with_no_mapping_is_a_clear_error(param: str) -> None:
    with pytest.raises(UnmappedParameterError, match=r"saved query q: parameter .* has no Grafana variable or macro"):
        grafana_sql("q", f"SELECT 1 WHERE x = {param}")


def test_variables() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert set(variables) == {"run_id", "attempt", "rollout_id"}
    assert variables["run_id"]["type"] == "query" and variables["run_id"]["query"] == RUN_IDS_SQL
    assert variables["run_id"]["datasource"] == DATASOURCE
    assert variables["attempt"]["current"]["value"] == "1"
    assert variables["rollout_id"]["type"] == "textbox"


def test_layout_rows_by_question_then_the_collapsed_tables() -> None:
    top = dashboard()["panels"]
    assert [(p["type"], p["title"], tuple(p["gridPos"].values())) for p in top] == [
        ("row", "Is training healthy?", (1, 24, 0, 0)),
        ("timeseries", "Reward per step", (8, 12, 0, 1)),
        ("timeseries", "Clipped ratio", (8, 12, 12, 1)),
        ("row", "Are graders failing?", (1, 24, 0, 9)),
        ("timeseries", "Grader failures by cause", (8, 12, 0, 10)),
        ("timeseries", "Grader failure rate by term", (8, 12, 12, 10)),
        ("row", "Are the engines and GPUs busy?", (1, 24, 0, 18)),
        ("timeseries", "Engine KV-cache usage", (8, 12, 0, 19)),
        ("timeseries", "Engine queue: requests running and waiting", (8, 12, 12, 19)),
        ("timeseries", "GPU utilisation", (8, 12, 0, 27)),
        ("timeseries", "GPU power", (8, 12, 12, 27)),
        ("row", "Tables", (1, 24, 0, 35)),
    ]
    assert all(tuple(p["gridPos"]) == ("h", "w", "x", "y") for p in top)
    rows = [p for p in top if p["type"] == "row"]
    assert [(r["collapsed"], len(r["panels"])) for r in rows] == [(False, 0)] * 3 + [(True, len(list_saved()))]
    # the collapsed row holds every saved query's table, full width, one under the other, in list order
    tables = rows[-1]["panels"]
    assert [(t["type"], t["title"]) for t in tables] == [("table", name) for name in list_saved()]
    assert [t["gridPos"] for t in tables] == [{"h": 8, "w": 24, "x": 0, "y": 36 + 8 * i} for i in range(len(tables))]
    ids = [p["id"] for p in top] + [t["id"] for t in tables]
    assert sorted(ids) == list(range(1, len(ids) + 1))


def _overlap(a: dict, b: dict) -> bool:
    return a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"] and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"]


def test_no_two_panels_overlap_with_the_tables_row_open() -> None:
    boxes = [(p["title"], p["gridPos"]) for p in dashboard()["panels"]]
    boxes += [(t["title"], t["gridPos"]) for t in dashboard()["panels"][-1]["panels"]]
    for i, (name, box) in enumerate(boxes):
        assert box["x"] >= 0 and box["x"] + box["w"] <= 24 and box["h"] > 0, name
        for other, box2 in boxes[i + 1:]:
            assert not _overlap(box, box2), (name, other)


def test_time_series_panels() -> None:
    panels = series_panels()
    assert list(panels) == list(SERIES)
    units = {title: (p["fieldConfig"]["defaults"]["unit"], p["fieldConfig"]["defaults"].get("min"),
                     p["fieldConfig"]["defaults"].get("max"), p["fieldConfig"]["defaults"].get("displayName"),
                     p["fieldConfig"]["defaults"]["custom"]["drawStyle"]) for title, p in panels.items()}
    assert units == {
        "Reward per step": ("short", None, None, None, "line"),
        "Clipped ratio": ("percentunit", 0, 1, None, "line"),
        "Grader failures by cause": ("short", None, None, "${__field.labels.cause}", "bars"),
        "Grader failure rate by term": ("percentunit", 0, 1, "${__field.labels.term}", "line"),
        "Engine KV-cache usage": ("percentunit", 0, 1, "${__field.labels.instance}", "line"),
        "Engine queue: requests running and waiting": ("short", None, None, "${__field.name} ${__field.labels.instance}",
                                                       "line"),
        "GPU utilisation": ("percentunit", 0, 1, "${__field.labels.gpu}", "line"),
        "GPU power": ("watt", None, None, "${__field.labels.gpu}", "line"),
    }
    saved = list_saved()
    for title, panel in panels.items():
        ts = SERIES[title]
        (target,) = panel["targets"]
        # the plugin's time series format: a long frame (time, labels, values) becomes a series per label
        assert (target["format"], target["queryType"], target["editorType"]) == (0, "timeseries", "sql"), title
        assert target["datasource"] == DATASOURCE == panel["datasource"]
        assert target["rawSql"] == grafana_sql(title, ts.sql)
        sql = expanded(target["rawSql"])
        assert not LEFTOVER.search(sql), f"{title}: leftover {LEFTOVER.search(sql).group(0)!r} in\n{sql}"
        # the whole description of the saved query it draws, then what it draws of it
        assert panel["description"] == (f"{saved[ts.saved]}\n\nDrawn here: {ts.drawn}.\n\n"
                                        f"`rlpulse query --saved {ts.saved}`"), title
        # every field the legend names is a column of the query
        label = re.search(r"labels\.(\w+)", panel["fieldConfig"]["defaults"].get("displayName", ""))
        assert label is None or (label[1],) == ts.labels, title
    for table in panels_by_query().values():
        assert table[0]["description"] == f"{saved[table[0]['title']]}\n\n`rlpulse query --saved {table[0]['title']}`"


def test_compose_mounts_provisioning_folders_that_exist() -> None:
    """Without PyYAML: every ./deploy/grafana path the compose file mounts is in the repo."""
    compose = (REPO / "docker-compose.yml").read_text()
    mounted = re.findall(r"-\s+\./(deploy/grafana/[^:\s]+):", compose)
    assert {"deploy/grafana/provisioning/datasources", "deploy/grafana/provisioning/dashboards",
            "deploy/grafana/dashboards"} <= set(mounted)
    for path in mounted:
        assert (REPO / path).is_dir(), path


def test_yaml_files_parse_and_agree() -> None:
    yaml = pytest.importorskip("yaml")
    (source,) = yaml.safe_load((PROVISIONING / "datasources" / "clickhouse.yaml").read_text())["datasources"]
    assert {"type": source["type"], "uid": source["uid"]} == DATASOURCE
    # The read-only user; its password from Grafana's environment, never in the file.
    wanted = {"host": "clickhouse", "port": 8123, "protocol": "http", "username": "rlpulse_reader",
              "defaultDatabase": "rlpulse"}
    assert {key: source["jsonData"].get(key) for key in wanted} == wanted
    assert source["secureJsonData"] == {"password": "$RLPULSE_READER_PASSWORD"}
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "rlpulse.yaml").read_text())["providers"]
    assert provider["type"] == "file"

    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert {"kafka", "clickhouse", "streams", "sink", "grafana"} <= set(compose["services"])
    grafana = compose["services"]["grafana"]
    assert grafana["depends_on"]["clickhouse"]["condition"] == "service_healthy"
    assert "127.0.0.1:3000:3000" in grafana["ports"]
    reader_password = compose["services"]["clickhouse"]["environment"]["RLPULSE_READER_PASSWORD"]
    assert reader_password.startswith("${RLPULSE_READER_PASSWORD:-")
    assert grafana["environment"]["RLPULSE_READER_PASSWORD"] == reader_password
    mounts = {}
    for volume in grafana["volumes"]:
        host, target, *mode = volume.split(":")
        mounts[target] = (host, mode)
    assert mounts["/etc/grafana/provisioning/datasources"] == ("./deploy/grafana/provisioning/datasources", ["ro"])
    assert mounts["/etc/grafana/provisioning/dashboards"] == ("./deploy/grafana/provisioning/dashboards", ["ro"])
    assert mounts[provider["options"]["path"]] == ("./deploy/grafana/dashboards", ["ro"])
    for host, _ in mounts.values():
        if host.startswith("./"):
            assert (REPO / host).is_dir(), host


def test_panel_sql_runs_on_a_migrated_store(tmp_path: Path) -> None:
    """Each panel's SQL, as Grafana and the plugin expand it, and the run_id variable's query run on chDB."""
    pytest.importorskip("chdb")
    queries = {p["title"]: expanded(p["targets"][0]["rawSql"]) for p in flat_panels(dashboard())}
    assert len(queries) == len(list_saved()) + len(SERIES)
    queries["variable run_id"] = RUN_IDS_SQL
    script = textwrap.dedent("""
        import json, sys
        from rlpulse.sinks.store.clickhouse import migrate, open_store
        with open_store(sys.argv[1], owner="test") as store:
            migrate(store)
            for name, sql in json.loads(sys.argv[2]).items():
                try:
                    store.client.query(sql, settings={"readonly": 1})
                except Exception as exc:
                    sys.exit(f"{name}: {exc}")
    """)
    run = subprocess.run([sys.executable, "-c", script, f"chdb://{tmp_path / 'ch'}", json.dumps(queries)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
