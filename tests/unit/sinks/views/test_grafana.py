"""The provisioned Grafana dashboard is the saved queries, and the compose file provisions it.

Nothing here starts Grafana or Docker: the dashboard JSON is compared with its generator, each
panel's SQL is checked (and, where chDB is installed, run on an empty migrated store with the
variables and the plugin's macros expanded as Grafana would), and the YAML files are parsed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlpulse.sinks.views.grafana import (DATASOURCE, RUN_IDS_SQL, UnmappedParameterError, dashboard, grafana_interpolate,
                                         grafana_sql)
from rlpulse.sinks.read.queries import list_saved

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
    out: dict[str, list[dict]] = {}
    for panel in dashboard()["panels"]:
        out.setdefault(panel["title"], []).append(panel)
    return out


def test_checked_in_dashboard_is_the_generated_one() -> None:
    assert CHECKED_IN.is_file(), f"{CHECKED_IN} is missing; generate it with `{REGENERATE}`"
    assert json.loads(CHECKED_IN.read_text()) == dashboard(), (
        f"deploy/grafana/dashboards/rlpulse.json is stale (a saved query or sinks/views/grafana.py changed); "
        f"regenerate it with `{REGENERATE}`")


def test_main_prints_sorted_indented_json(capsys: pytest.CaptureFixture[str]) -> None:
    from rlpulse.sinks.views.grafana import main

    main()
    assert capsys.readouterr().out == json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


def test_every_saved_query_has_exactly_one_panel_with_no_placeholder_left() -> None:
    panels = panels_by_query()
    assert set(panels) == set(list_saved()), "panels and saved queries differ"
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


def test_trend_panels_plot_columns_their_query_returns() -> None:
    for panel in dashboard()["panels"]:
        if panel["type"] == "trend":
            names = panel["transformations"][0]["options"]["include"]["names"]
            for column in names:
                assert re.search(rf"\b{column}\b", panel["targets"][0]["rawSql"]), (panel["title"], column)


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
    queries = {p["title"]: expanded(p["targets"][0]["rawSql"]) for p in dashboard()["panels"]}
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
