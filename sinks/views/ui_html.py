"""The frame of every page of ``rlpulse ui``: escaping, links, numbers, the layout and its stylesheet.

Every value from the store (a run id, a span name, a message) is text anyone who can write to a
topic chose: it goes through the views' one escaping function (``rlpulse.sinks.views.html_escape.esc``),
which writes its control, bidi and invisible characters as visible escapes (a terminal escape
``\\x1b[2J`` or a right-to-left override ``\\u202e`` shows as those characters) and then HTML-escapes
it: :func:`text` is that function with None as nothing, :func:`block` keeps newlines and tabs, for
message content shown in ``<pre>``. Links are built with :func:`href` from our own
paths and URL-encoded parameters only, so no value can become a ``javascript:`` URL.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Iterable
from contextvars import ContextVar
from typing import Any
from urllib.parse import urlencode

from rlpulse.sinks.views.html_escape import esc
from rlpulse.sinks.views.compare_css import CSS as COMPARE_CSS
from rlpulse.sinks.views.trajectory_html import CSS as TRAJECTORY_CSS

NS = 1_000_000_000


def text(value: Any) -> str:
    """One value as HTML text (or a quoted attribute value), its control characters visible; None as nothing."""
    return esc("" if value is None else value)


def block(value: Any) -> str:
    """Multi-line text (message content) for a ``<pre>``: newlines and tabs kept, other controls visible."""
    return esc("" if value is None else value, keep_layout=True)


# The page being answered reloads itself every N seconds (``refresh=N``): its links and forms keep that, so a
# live view stays live from page to page. Set by the server around one request (a context variable: each of its
# threads answers its own request).
REFRESH: ContextVar[int | None] = ContextVar("refresh", default=None)
_GET_FORM = re.compile(r'(<form [^>]*method="get"[^>]*>)')


def href(path: str, params: Iterable[tuple[str, Any]] = ()) -> str:
    """An escaped link to one of our pages with these parameters (None values left out), and the refresh
    interval of the page it is on (:data:`REFRESH`) unless the parameters say one."""
    pairs = [(k, str(v)) for k, v in params if v is not None and v != ""]
    refresh = REFRESH.get()
    if refresh and not any(k == "refresh" for k, _ in pairs):
        pairs.append(("refresh", str(refresh)))
    query = urlencode(pairs)
    return esc(path + ("?" + query if query else ""))


def keep_refresh(body: str) -> str:
    """``body`` with the refresh interval of its page (:data:`REFRESH`) as a hidden field of each GET form, first,
    so a field of the form's own that names one (the runs page's choice) comes later and wins."""
    refresh = REFRESH.get()
    if not refresh:
        return body
    return _GET_FORM.sub(lambda m: m.group(1) + f'<input type="hidden" name="refresh" value="{int(refresh)}">', body)


def num(value: Any, digits: int = 4) -> str:
    """A figure as the pages show it: rounded to ``digits`` decimals, trailing zeros dropped; '–' for none."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    shown = f"{round(float(value), digits):.{digits}f}".rstrip("0").rstrip(".")
    return "0" if shown in ("-0", "") else shown


# -- numbers by kind: chart ticks, hover text and tables call these (each takes None/NaN -> "–") -----

NONE = "–"


def _finite(value: Any) -> float | None:
    """The value as a float, or None for None and NaN (shown as "–"); infinities pass (shown as ∞)."""
    if value is None or isinstance(value, bool):
        return None if value is None else float(value)
    v = float(value)
    return None if math.isnan(v) else v


def _inf(v: float) -> str:
    return "∞" if v > 0 else "-∞"


def fmt_number(value: Any) -> str:
    """A plain figure: 4 significant digits (12.35, 0.001235), thousands separators from 10,000 on
    (12,346), scientific past 10^15 or below 10^-4 (1.2e+16, 3e-05); "0" never "-0"."""
    v = _finite(value)
    if v is None:
        return NONE
    if math.isinf(v):
        return _inf(v)
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e15 or a < 1e-4:
        return f"{v:.3g}"
    if a >= 9_999.5:  # 9,999.7 rounds to 10,000 at 4 digits: written whole, never "1e+04"
        return f"{v:,.0f}"
    shown = f"{v:.4g}"
    return "0" if shown == "-0" else shown


def fmt_count(value: Any) -> str:
    """A count: rounded to a whole number, thousands separators (1,234,567)."""
    v = _finite(value)
    if v is None:
        return NONE
    if math.isinf(v):
        return _inf(v)
    n = round(v)
    return f"{n:,}" if n else "0"


def fmt_ratio(value: Any) -> str:
    """A fraction 0..1 as a percentage: 0.9 -> "90%", 0.125 -> "12.5%", 0.0004 -> "0.04%", 15 -> "1,500%"."""
    v = _finite(value)
    if v is None:
        return NONE
    if math.isinf(v):
        return _inf(v) + "%"
    p = v * 100
    if p == 0:
        return "0%"
    shown = f"{p:,.0f}" if abs(p) >= 999.5 else f"{p:.3g}" if abs(p) >= 1e-3 else f"{p:.1g}"  # 999.6% is "1,000%"
    return ("0" if shown == "-0" else shown) + "%"


_SI = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def fmt_rate(value: Any, per: str = "/s") -> str:
    """A rate (tokens/s): 3 significant digits and an SI prefix: 512 -> "512/s", 12345 -> "12.3k/s",
    2.5e9 -> "2.5G/s"; past 10^15 scientific."""
    v = _finite(value)
    if v is None:
        return NONE
    if math.isinf(v):
        return _inf(v) + per
    a = abs(v)
    if a >= 999.5e12:  # past the last prefix (999.96T would read "1e+03T")
        return f"{v:.3g}{per}"
    for size, prefix in _SI:
        if a >= size * 0.9995:  # 999.96 rounds to 1k, not "1e+03"
            return f"{v / size:.3g}{prefix}{per}"
    return (f"{v:.3g}" if v else "0") + per


def fmt_duration(seconds: Any) -> str:
    """A duration given in seconds: "850 ms", "1.5 s", "2.5 min", "3.2 h" (3 significant digits);
    below a millisecond still in ms ("0.05 ms")."""
    v = _finite(seconds)
    if v is None:
        return NONE
    if math.isinf(v):
        return _inf(v) + " s"
    a = abs(v)
    if a == 0:
        return "0 s"
    if a < 0.9995:
        return f"{v * 1e3:.3g} ms"
    if a < 60:  # 59.97 s shows as "60 s", never "0.999 min"
        return f"{v:.3g} s"
    if a < 3600:
        return f"{v / 60:.3g} min"
    hours = v / 3600
    return f"{hours:,.0f} h" if abs(hours) >= 999.5 else f"{hours:.3g} h"


def when(ns: int | None) -> str:
    if not ns:
        return "–"
    return dt.datetime.fromtimestamp(ns / NS, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def ago(ns: int | None, now_ns: int) -> str:
    if not ns:
        return "–"
    s = max(0.0, (now_ns - ns) / NS)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def table(head: Iterable[str], body: str, cls: str = "") -> str:
    th = "".join(f"<th>{esc(h)}</th>" for h in head)
    return f'<table class="grid {esc(cls)}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def page(title: str, crumbs: list[tuple[str, str | None]], body: str, source: str, now_ns: int,
         refresh: int | None = None) -> str:
    """The whole document. ``crumbs``: (label, escaped link or None for the current page); ``refresh``: seconds
    after which the browser loads the page again (a live view without a script)."""
    trail = " › ".join(f'<a href="{link}">{text(label)}</a>' if link else f"<span>{text(label)}</span>"
                       for label, link in crumbs)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{text(title)}</title>'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            + (f'<meta http-equiv="refresh" content="{int(refresh)}">' if refresh else "") +
            '<link rel="stylesheet" href="/ui.css"><link rel="icon" href="data:,"></head>'
            f'<body><header><a class="brand" href="/">rlpulse</a><nav class="crumbs">{trail}</nav></header>'
            f"<main><h1>{text(title)}</h1>{body}</main>"
            f'<footer>Read-only, from {text(source)} at {esc(when(now_ns))}. Every figure is read from ClickHouse '
            "as the saved queries read it.</footer></body></html>")


def error_page(status: int, message: str, now_ns: int) -> str:
    return page(f"{status}", [("Runs", href("/")), ("error", None)],
                f'<p class="error" data-status="{status}">{text(message)}</p>', "rlpulse ui", now_ns)


CSS = """
body { font-family: system-ui, sans-serif; margin: 0; color: #1d1d1f; background: #f6f7f9; font-size: 14px; }
header { background: #20232a; color: #fff; padding: 8px 20px; display: flex; gap: 18px; align-items: center; }
header a { color: #9cdcfe; text-decoration: none; } header .brand { font-weight: bold; color: #fff; }
.crumbs span { color: #ddd; }
main { padding: 8px 20px 30px; max-width: 1400px; }
h1 { font-size: 20px; margin: 12px 0; word-break: break-all; } h2 { font-size: 16px; margin: 18px 0 8px; }
footer { color: #777; font-size: 12px; padding: 10px 20px; }
table.grid { border-collapse: collapse; background: #fff; margin: 6px 0; }
table.grid th, table.grid td { border: 1px solid #e1e4e8; padding: 3px 8px; text-align: left; vertical-align: top; }
table.grid th { background: #f0f2f5; font-weight: 600; }
table.grid td.n { text-align: right; font-variant-numeric: tabular-nums; }
.state { font-weight: bold; } .state-RUNNING { color: #1a7f37; } .state-STALLED { color: #b35900; }
.state-SILENT { color: #cf222e; } .state-FAILED { color: #cf222e; } .state-FINISHED { color: #57606a; }
.state-CANCELLED { color: #8250df; }
form.filters { background: #fff; border: 1px solid #e1e4e8; padding: 8px 10px; margin: 8px 0; display: flex; flex-wrap: wrap;
  gap: 12px; align-items: center; }
form.filters label { display: inline-flex; gap: 4px; align-items: center; }
form.filters input[type=number] { width: 80px; }
.figures { display: flex; flex-wrap: wrap; gap: 10px; margin: 8px 0; }
.figure { background: #fff; border: 1px solid #e1e4e8; padding: 6px 10px; min-width: 110px; }
.figure .label { color: #57606a; font-size: 12px; } .figure .value { font-size: 18px; font-variant-numeric: tabular-nums; }
svg.chart { width: 100%; max-width: 1000px; background: #fff; border: 1px solid #e1e4e8; display: block; margin: 6px 0; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(min(560px, 100%), 1fr)); gap: 10px; align-items: start; }
.charts svg.chart { max-width: none; margin: 0; }
.charts svg.chart .hover rect:hover { fill-opacity: 0.07; }
p.not-drawn { font-size: 12px; margin: 6px 0; }
.run-links { display: flex; gap: 16px; margin: 6px 0; }
section.group { background: #fff; border: 1px solid #e1e4e8; margin: 10px 0; padding: 6px 10px; }
section.group h3 { font-size: 14px; margin: 4px 0 8px; word-break: break-all; }
.badge { display: inline-block; font-size: 11px; padding: 1px 6px; border-radius: 8px; background: #eaeef2; margin-left: 6px; }
.badge.zero { background: #fff1c2; } .badge.fail { background: #ffd8d3; }
.cards { display: grid; grid-auto-flow: column; grid-auto-columns: minmax(128px, 1fr); gap: 6px; overflow-x: auto;
  padding-bottom: 4px; }
a.card { display: block; min-width: 0; border: 1px solid #d0d7de; border-radius: 6px; padding: 6px 8px; color: inherit;
  text-decoration: none; background: #fbfcfd; word-break: break-all; }
a.card:hover { border-color: #0969da; } a.card .reward { font-size: 20px; font-variant-numeric: tabular-nums; }
a.card.status-ERROR { border-color: #cf222e; }
a.card .prompt, a.card .completion { font-size: 12px; white-space: pre-wrap; overflow-wrap: anywhere; max-height: 7.5em;
  overflow: hidden; margin-top: 4px; padding-left: 6px; border-left: 3px solid #d0d7de; }
a.card .completion { border-left-color: #1a7f37; }
.failed { color: #cf222e; } .muted { color: #6e7781; } .error { color: #cf222e; font-weight: bold; }
.pager { margin: 10px 0; display: flex; gap: 12px; }
.dialogue { display: flex; flex-direction: column; gap: 6px; max-width: 1000px; }
.msg { border: 1px solid #e1e4e8; border-radius: 6px; background: #fff; padding: 6px 10px; }
.msg .role { font-size: 12px; font-weight: bold; color: #57606a; text-transform: uppercase; }
.msg.role-user { border-left: 4px solid #0969da; } .msg.role-assistant { border-left: 4px solid #1a7f37; }
.msg.role-tool { border-left: 4px solid #8250df; } .msg.role-system { border-left: 4px solid #6e7781; }
pre { white-space: pre-wrap; word-break: break-word; margin: 4px 0; font-size: 13px; }
.tool-call { font-family: monospace; background: #f6f8fa; padding: 2px 6px; margin: 2px 0; }
table.grid td.indent-1 { padding-left: 24px; } table.grid td.indent-2 { padding-left: 40px; }
table.grid td.indent-3 { padding-left: 56px; } table.grid td.indent-4 { padding-left: 72px; }
table.grid td.indent-5 { padding-left: 88px; }
""" + TRAJECTORY_CSS + COMPARE_CSS
