"""The Grafana dashboard for ``docker compose``, generated from the saved queries (``sinks/read/queries/*.sql``).

One panel per saved query, in ``list_saved()`` order, on the official ClickHouse data source plugin
(``grafana-clickhouse-datasource``, provisioned with uid ``rlpulse-clickhouse``). Per-step queries are
drawn as trend panels (x axis ``step``: Grafana's time series panel needs a time column); the others
are tables. Regenerate the checked-in dashboard after changing a saved query::

    python -m rlpulse.sinks.views.grafana > deploy/grafana/dashboards/rlpulse.json

The saved queries' header comments become the panel descriptions; the SQL body becomes ``rawSql`` with
the ClickHouse server-side parameters replaced by Grafana variables or plugin macros:

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

from rlpulse.sinks.read.queries import PLACEHOLDER, list_saved, load_saved
from rlpulse.base.errors import Error

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
# Saved queries drawn as a trend (x = step) and the columns plotted; the rest are tables.
TRENDS: dict[str, list[str]] = {
    "clipped-ratio-trend": ["clipped_ratio", "change"],
    "reward-percentiles": ["p10", "p50", "p90"],
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


def _description(sql: str) -> str:
    return "\n".join(line.strip()[2:].strip() for line in sql.splitlines() if line.strip().startswith("--"))


def panel(name: str, panel_id: int, y: int) -> dict[str, Any]:
    """Saved query ``name`` as a panel: a trend of ``TRENDS[name]`` over ``step``, else a table."""
    sql = load_saved(name)
    target = {
        "datasource": DATASOURCE,
        "editorType": "sql",
        "format": 1,
        "queryType": "table",
        "rawSql": grafana_sql(name, sql),
        "refId": "A",
    }
    out: dict[str, Any] = {
        "datasource": DATASOURCE,
        "description": _description(sql),
        "id": panel_id,
        "title": name,
        "gridPos": {"h": 10, "w": 24, "x": 0, "y": y},
        "targets": [target],
        "type": "table",
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {"cellHeight": "sm", "showHeader": True},
    }
    if name in TRENDS:
        out["type"] = "trend"
        out["options"] = {
            "xField": "step",
            "tooltip": {"mode": "multi", "sort": "none"},
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        }
        out["fieldConfig"]["defaults"] = {"custom": {"drawStyle": "line", "showPoints": "auto", "spanNulls": False}}
        out["transformations"] = [{"id": "filterFieldsByName", "options": {"include": {"names": ["step", *TRENDS[name]]}}}]
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
    """The dashboard JSON (as a dict): the variables and one panel per saved query."""
    panels = [panel(name, i + 1, 10 * i) for i, name in enumerate(list_saved())]
    return {
        "uid": "rlpulse",
        "title": "rlpulse",
        "description": "Generated by `python -m rlpulse.sinks.views.grafana` from sinks/read/queries/*.sql",
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
        "panels": panels,
        "templating": {"list": _variables()},
    }


def main() -> None:
    print(json.dumps(dashboard(), indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
