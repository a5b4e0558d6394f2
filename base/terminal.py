"""Text from the store made safe to print on a terminal.

Anyone who can write to a raw topic chooses run ids, projects, terms, alert keys and summaries,
and those strings come back out of ClickHouse into ``rlpulse query``, ``report``, ``alerts`` and
``watch``. Printed raw, ``"\\x1b]0;pwned\\x07"`` retitles the window, ``"\\x1b[2J"`` clears the screen,
``"\\x9b"`` is the same CSI on terminals that honour C1 controls, a carriage return or a newline
overwrites or forges a line, and U+202E (right-to-left override) or a zero-width space makes
one run id look like another. :func:`terminal_safe` renders every such character as a visible
escape in Python's own spelling (``\\x1b``, ``\\n``, ``\\u202e``), so the reader sees that the value
holds it, and lets everything else through unchanged.

Which characters: every code point Unicode does not mean for display: categories Cc (C0, DEL, C1
controls), Cf (format: bidi embeddings, overrides, isolates and marks, zero-width spaces and
joiners, the byte order mark, soft hyphen, tag characters), Zl and Zp (line and paragraph
separators) and Cs (lone surrogates: printing one raises UnicodeEncodeError, a crash for a
string anyone can send). Letters, digits, punctuation, symbols, marks and spaces of every script
pass ("é", "日本"). A backslash passes too: ``\\x1b`` typed as four characters prints as itself,
so a value can look like one holding an escaped control, but it can do nothing to the terminal,
and doubling every backslash would garble ordinary values (Windows paths).
"""

from __future__ import annotations

import logging
import unicodedata
from collections.abc import Sequence
from typing import Any

# Unicode categories not meant for display (see the module docstring).
UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
# Every such code point lies in the Basic Multilingual Plane, the Supplementary Multilingual Plane
# or plane 14 (tags, variation selectors): scanning these at import takes a few milliseconds,
# where all 17 planes take a tenth of a second on every CLI start. tests/unit/base/test_terminal_safe.py
# checks that no unsafe code point lies outside them in the running Python's Unicode data.
SCANNED_PLANES = (range(0x0000, 0x20000), range(0xE0000, 0xE1000))
# Python's short spellings, which a reader knows at a glance.
_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(code: int) -> str:
    char = chr(code)
    if char in _SHORT:
        return _SHORT[char]
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _unsafe_code_points() -> list[int]:
    return [c for plane in SCANNED_PLANES for c in plane if unicodedata.category(chr(c)) in UNSAFE_CATEGORIES]


UNSAFE = frozenset(_unsafe_code_points())
# One str.translate table per set of kept characters, built once: translate runs in C and leaves
# every character without an entry as it is, so ordinary text costs one lookup per character.
_TABLE: dict[int, str] = {c: _escape(c) for c in UNSAFE}
_TABLE_KEEP_NEWLINE = {c: e for c, e in _TABLE.items() if c != ord("\n")}
_TABLE_KEEP_LAYOUT = {c: e for c, e in _TABLE_KEEP_NEWLINE.items() if c != ord("\t")}


def terminal_safe(text: str) -> str:
    """``text`` with every control, format, separator and surrogate character written as a visible
    escape (``"\\x1b[2J"`` -> ``\\x1b[2J``, a newline -> ``\\n``); other text unchanged.

    For one value in one place: a table cell, a name in a heading, a field of a line. Tabs and
    newlines are escaped too, because in a cell a newline forges a row and a tab shifts the
    columns after it; a value never spans lines on purpose.
    """
    return text.translate(_TABLE)


def terminal_safe_lines(text: str) -> str:
    """``text`` as :func:`terminal_safe` writes it, keeping its newlines: for a message that is meant
    to span lines (an error with the tail of a log, a traceback), whose parts may quote hostile
    values. A newline inside such a quoted value still starts a line: escape the value with
    :func:`terminal_safe` where the message is made when that matters."""
    return text.translate(_TABLE_KEEP_NEWLINE)


def csv_safe(text: str) -> str:
    """``text`` as :func:`terminal_safe` writes it, keeping newlines and tabs: for a CSV cell. The CSV
    writer quotes a cell holding either, so a CSV reader gets the value back whole (a completion's
    lines stay lines), while ``cat`` of the file runs no escape sequence."""
    return text.translate(_TABLE_KEEP_LAYOUT)


class TerminalSafeFormatter(logging.Formatter):
    """A logging formatter whose lines carry no control characters from their arguments: log
    messages quote alert keys, run ids and decoder errors about hostile messages. The message is
    kept on one line (an escaped newline cannot forge a log line); a traceback keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return terminal_safe(super().formatMessage(record))

    def formatException(self, ei) -> str:
        return terminal_safe_lines(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return terminal_safe_lines(super().formatStack(stack_info))


def print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Aligned columns under a header: the text of ``rlpulse query``, ``report`` and ``dlq``.

    Each cell passes through terminal_safe: values come from topics anyone can write to, and a
    newline in a run id would forge a row, an escape sequence would drive the reader's terminal."""
    cells = [[terminal_safe(str(c)) for c in columns]] + [["" if v is None else terminal_safe(str(v)) for v in row]
                                                          for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for n, row in enumerate(cells):
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
