"""The Grafana dashboard for ``docker compose``, generated from the saved queries (``sinks/read/queries/*.sql``).

Rows by the question a user opens it with: "Is training healthy?" (reward, clipped ratio), "Are
graders failing?" (failures by cause, failure rate by term), "Are the engines and GPUs busy?" (KV
cache, queue, GPU utilisation and power): time series of the dashboard's run over its time range,
two to a line (sinks/views/grafana_panels.py). Below them a collapsed "Tables" row holds one table
per saved query, in ``list_saved()`` order. Every panel reads the official ClickHouse data source
plugin (``grafana-clickhouse-datasource``, provisioned with uid ``rlpulse-clickhouse``). Regenerate
the checked-in dashboard after changing a saved query or a panel::

    python -m rlpulse.sinks.views.grafana > deploy/grafana/dashboards/rlpulse.json

A panel's description is its saved query's whole description (``list_saved()``: the header's
leading paragraph); the SQL (a table's: the saved query's body) becomes ``rawSql`` with the
ClickHouse server-side parameters replaced by Grafana variables or plugin macros:

    {db}                          -> rlpulse
    {run_id:String}               -> decodeURLComponent('${run_id:percentencode}')            (query variable:
                                     recent run_ids in rlpulse.steps)
    {attempt:UInt32}              -> toUInt32(decodeURLComponent('${attempt:percentencode}'))  (text box, default 1)
    {rollout_id:String}           -> decodeURLComponent('${rollout_id:percentencode}')        (text box)
    {since:DateTime64(3, 'UTC')}  -> $__fromTime_ms   (plugin macro: fromUnixTimestamp64Milli(<from ms>))
    {until:DateTime64(3, 'UTC')}  -> $__toTime_ms     (plugin macro: fromUnixTimestamp64Milli(<to ms>))

i.e. ``since``/``until`` follow the dashboard's time range. The ``_ms`` macros give DateTime64(3), the
parameters' type; the plugin's ``$__fromTime``/``$__toTime`` give whole seconds (``toDateTime(<s>)``).
A parameter not in this table (or of another type) raises ``UnmappedParameterError``.

Why percent-encoding: anyone who can open the dashboard (anonymous viewers) sets the variables from
the URL (``?var-run_id=...``), and Grafana pastes them into the SQL text. The plugin's own format
passes a single value through untouched, so ``'${run_id}'`` lets ``x' OR 1=1 --`` out of the
literal. Grafana's ``sqlstring`` format doubles ``'`` but leaves ``\\`` alone, and ClickHouse reads
``\\'`` inside a literal as an escaped quote, so ``x\\' OR 1=1 --`` still gets out (``singlequote``
escapes ``'`` as ``\\'``: the same hole from the other side). ``percentencode`` (Grafana's
encodeURIComponentStrict) leaves only ``A-Za-z0-9-_.~%`` in the text, none of which ends or escapes
a ClickHouse string literal, and ``decodeURLComponent`` gives back the exact value. So every value,
whatever its characters, is one string literal. ``grafana_interpolate`` does what Grafana does with
these formats (its formatRegistry: grafana/scenes packages/scenes/src/variables/interpolation/
formatRegistry.ts), for the tests to render each panel with hostile values.
"""

from __future__ import annotations

import json
import re
from typing import Any
from collections.abc import Callable, Mapping
from urllib.parse import quote

from rlpulse.base.errors import Error
from rlpulse.sinks.read.queries import PLACEHOLDER, list_saved, load_saved
from rlpulse.sinks.views.grafana_panels import ROWS, TABLES_ROW, TimeSeries

DATABASE = "rlpulse"
DATASOURCE = {"type": "grafana-clickhouse-datasource", "uid": "rlpulse-clickhouse"}
# parameter name -> (the ClickHouse type it must have, up to its first "(", and what replaces it)
MAPPING: dict[str, tuple[str, str]] = {
    "run_id": ("String", "decodeURLComponent('${run_id:percentencode}')"),
    "attempt": ("UInt32", "toUInt32(decodeURLComponent('${attempt:percentencode}'))"),
    "rollout_id": ("String", "decodeURLComponent('${rollout_id:percentencode}')"),
    "since": ("DateTime64", "$__fromTime_ms"),
    "until": ("DateTime64", "$__toTime_ms"),
}
RUN_IDS_SQL = f"SELECT DISTINCT run_id FROM {DATABASE}.steps ORDER BY run_id DESC LIMIT 200"


# Grafana's variable syntax (its VARIABLE_REGEX): $name, [[name:format]], ${name.fieldPath:format}.
VARIABLE = re.compile(r"\$(\w+)|\[\[(\w+?)(?::(\w+))?\]\]|\$\{(\w+)(?:\.([^:^}]+))?(?::([^}]+))?\}")


def _encode_uri_component_strict(value: str) -> str:
    """Grafana's encodeURIComponentStrict: encodeURIComponent, then also ! ' ( ) *. Leaves A-Za-z0-9 - _ . ~"""
    return quote(value, safe="")  # Python's unreserved set is exactly that one; UTF-8, upper-case hex


def _sqlstring(value: str) -> str:
    """Grafana's sqlstring format: ' doubled, " as \\", all in single quotes (backslashes untouched)."""
    return "'" + value.replace("'", "''").replace('"', '\\"') + "'"


def _singlequote(value: str) -> str:
    """Grafana's singlequote format: ' as \\', in single quotes (backslashes untouched)."""
    return "'" + value.replace("'", "\\'") + "'"


# Format -> formatter, for a single (non-multi) value. No format: the ClickHouse plugin's own, which
# passes a single value through as it is (CHDatasource.format in grafana/clickhouse-datasource).
FORMATS: dict[str | None, Callable[[str], str]] = {
    "percentencode": _encode_uri_component_strict,
    "sqlstring": _sqlstring,
    "singlequote": _singlequote,
    "raw": str,
    None: str,
}


def grafana_interpolate(sql: str, variables: Mapping[str, str]) -> str:
    """``sql`` with each dashboard variable replaced as Grafana and the ClickHouse plugin replace it.

    Names not in ``variables`` (the plugin's ``$__`` macros) stay, as Grafana leaves them for the plugin.
    A format outside ``FORMATS`` raises ValueError (Grafana would fall back to glob)."""

    def swap(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(4)
        fmt = m.group(3) or m.group(6)
        if name not in variables:
            return m.group(0)
        if fmt not in FORMATS:
            raise ValueError(
                f"variable {name}: format {fmt!r} is not one grafana_interpolate knows ({sorted(map(str, FORMATS))})"
            )
        return FORMATS[fmt](variables[name])

    return VARIABLE.sub(swap, sql)


class UnmappedParameterError(Error, ValueError):
    """A saved query has a ``{name:Type}`` parameter that no dashboard variable or macro stands for."""


def grafana_sql(name: str, sql: str) -> str:
    """The body of saved query ``name`` (comment lines dropped) with parameters as Grafana variables/macros."""
    body = "\n".join(line for line in sql.splitlines() if not line.strip().startswith("--")).strip()

    def swap(m: re.Match[str]) -> str:
        param, type_ = m.group(1), m.group(2).strip()
        expected, value = MAPPING.get(param, ("", ""))
        if not expected or type_.split("(")[0].strip() != expected:
            known = ", ".join(f"{{{n}:{t}}}" for n, (t, _) in MAPPING.items())
            raise UnmappedParameterError(
                f"saved query {name}: parameter {{{param}:{type_}}} has no Grafana variable or macro; "
                f"mapped are {known} (add one to MAPPING in sinks/views/grafana.py)"
            )
        return value

    return PLACEHOLDER.sub(swap, body).replace("{db}", DATABASE)


WIDTH, HALF = 24, 12  # Grafana's grid is 24 columns wide
SERIES_H, TABLE_H = 8, 8


def _target(sql: str, series: bool) -> dict[str, Any]:
    # format 0 / queryType timeseries: the plugin turns a long frame (time, label columns, values)
    # into one series per label value; format 1 / table: the rows as they come
    return {"datasource": DATASOURCE, "editorType": "sql", "format": 0 if series else 1,
            "queryType": "timeseries" if series else "table", "rawSql": sql, "refId": "A"}


def _about(name: str, drawn: str = "") -> str:
    """A panel's description: saved query ``name``'s whole description, what the panel draws of it,
    and the command that prints the same figures."""
    return list_saved()[name] + (f"\n\nDrawn here: {drawn}." if drawn else "") + f"\n\n`rlpulse query --saved {name}`"


def table_panel(name: str, panel_id: int, y: int) -> dict[str, Any]:
    """Saved query ``name`` as a table, its SQL the saved query's with the parameters as variables/macros."""
    return {
        "datasource": DATASOURCE,
        "description": _about(name),
        "id": panel_id,
        "title": name,
        "gridPos": {"h": TABLE_H, "w": WIDTH, "x": 0, "y": y},
        "targets": [_target(grafana_sql(name, load_saved(name)), series=False)],
        "type": "table",
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {"cellHeight": "sm", "showHeader": True},
    }


def series_panel(ts: TimeSeries, panel_id: int, x: int, y: int) -> dict[str, Any]:
    """``ts`` as a time series panel, half the grid's width."""
    custom: dict[str, Any] = {"drawStyle": "bars" if ts.bars else "line", "lineWidth": 1,
                              "fillOpacity": 80 if ts.bars else 0, "showPoints": "never" if ts.bars else "auto",
                              "spanNulls": False, "stacking": {"group": "A", "mode": "normal" if ts.bars else "none"}}
    defaults: dict[str, Any] = {"unit": ts.unit, "custom": custom}
    if ts.fraction:
        defaults.update(min=0, max=1)
    if ts.labels:
        # one series per label value: the legend names it by the label, and by the value's column
        # where the panel draws several
        label = "${__field.labels." + ts.labels[0] + "}"
        defaults["displayName"] = label if len(ts.values) == 1 else "${__field.name} " + label
    return {
        "datasource": DATASOURCE,
        "description": _about(ts.saved, ts.drawn),
        "id": panel_id,
        "title": ts.title,
        "gridPos": {"h": SERIES_H, "w": HALF, "x": x, "y": y},
        "targets": [_target(grafana_sql(ts.title, ts.sql), series=True)],
        "type": "timeseries",
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}},
    }


def _row(title: str, panel_id: int, y: int, collapsed: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A row header; a collapsed row holds its panels (Grafana lays them out when it is opened)."""
    return {"type": "row", "title": title, "id": panel_id, "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": y},
            "collapsed": collapsed is not None, "panels": collapsed or []}


def panels() -> list[dict[str, Any]]:
    """The dashboard's top-level panels: each question's row and its time series two to a line,
    then the collapsed Tables row with a table per saved query."""
    out: list[dict[str, Any]] = []
    y = 0
    for title, series in ROWS:
        out.append(_row(title, len(out) + 1, y))
        y += 1
        for i, ts in enumerate(series):
            out.append(series_panel(ts, len(out) + 1, HALF * (i % 2), y + SERIES_H * (i // 2)))
        y += SERIES_H * -(-len(series) // 2)
    first = len(out) + 2  # the Tables row takes the next id, its tables the ones after it
    tables = [table_panel(name, first + i, y + 1 + TABLE_H * i) for i, name in enumerate(list_saved())]
    out.append(_row(TABLES_ROW, first - 1, y, tables))
    return out


def flat_panels(dashboard_: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that runs a query, the collapsed rows' included, in order (rows themselves left out)."""
    out: list[dict[str, Any]] = []
    for p in dashboard_["panels"]:
        out += [p] if p["type"] != "row" else p["panels"]
    return out


def _variables() -> list[dict[str, Any]]:
    return [
        {
            "name": "run_id",
            "label": "run_id",
            "type": "query",
            "datasource": DATASOURCE,
            "query": RUN_IDS_SQL,
            "definition": RUN_IDS_SQL,
            "refresh": 2,
            "sort": 0,
            "multi": False,
            "includeAll": False,
            "current": {},
            "options": [],
            "hide": 0,
        },
        {
            "name": "attempt",
            "label": "attempt",
            "type": "textbox",
            "query": "1",
            "hide": 0,
            "current": {"selected": False, "text": "1", "value": "1"},
            "options": [{"selected": True, "text": "1", "value": "1"}],
        },
        {
            "name": "rollout_id",
            "label": "rollout_id (span tree)",
            "type": "textbox",
            "query": "",
            "hide": 0,
            "current": {"selected": False, "text": "", "value": ""},
            "options": [],
        },
    ]


def dashboard() -> dict[str, Any]:
    """The dashboard JSON (as a dict): the variables, the rows of time series, the tables."""
    return {
        "uid": "rlpulse",
        "title": "rlpulse",
        "description": "Generated by `python -m rlpulse.sinks.views.grafana` from sinks/read/queries/*.sql "
                       "and sinks/views/grafana_panels.py",
        "tags": ["rlpulse"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-24h", "to": "now"},
        "timepicker": {},
        "timezone": "utc",
        "refresh": "",
        "annotations": {"list": []},
        "links": [],
        "panels": panels(),
        "templating": {"list": _variables()},
    }


def main() -> None:
    print(json.dumps(dashboard(), indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
