"""The one escaping function of the HTML views: ``rlpulse ui``'s pages and ``rlpulse report --html``.

Every text from the store (a run id, a span's name, kind, status, ids, attributes, message content) is
text anyone who can write to a topic chose, and every one goes through :func:`esc` before it is put in a
page, as element text or a quoted attribute value: first its control, format and separator characters
are written as visible escapes (``rlpulse.base.terminal``'s set: C0/C1 controls, the bidi embeddings,
overrides, isolates and marks U+202A-U+202E, U+2066-U+2069, U+200E/U+200F, U+061C, zero-width spaces
and joiners, U+2060-U+2064, the byte order mark, soft hyphen, tag characters, line and paragraph
separators, lone surrogates), so ``\\u202e`` shows as those six characters and cannot reorder what
follows it or make one run id look like another; then it is HTML-escaped (``& < > " '``).
``keep_layout=True`` keeps newlines and tabs, for content shown in a ``<pre>``.

It lives here, below ``rlpulse.sinks.views.ui_html`` (whose ``text`` and ``block`` call it),
``trajectory_html`` and ``html_report``, so every view imports it and nothing imports back up; no other
module of the views calls ``html.escape`` (tests/unit/sinks/views/test_one_escape.py checks that).
"""

from __future__ import annotations

import html
from typing import Any

from rlpulse.base.terminal import csv_safe, terminal_safe


def esc(text: Any, keep_layout: bool = False) -> str:
    """``text`` as HTML text or a quoted attribute value, its invisible and control characters visible
    (``keep_layout``: newlines and tabs kept, for a ``<pre>``)."""
    value = str(text)
    return html.escape(csv_safe(value) if keep_layout else terminal_safe(value), quote=True)
