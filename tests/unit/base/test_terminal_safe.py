"""rlpulse.base.terminal: hostile text printed as visible escapes, ordinary text unchanged."""

from __future__ import annotations

import logging
import sys
import unicodedata

import pytest

from rlpulse.base.terminal import (
    SCANNED_PLANES,
    UNSAFE,
    UNSAFE_CATEGORIES,
    TerminalSafeFormatter,
    csv_safe,
    terminal_safe,
    terminal_safe_lines,
)


@pytest.mark.parametrize(("raw", "shown"), [
    ("\x1b]0;pwned\x07", "\\x1b]0;pwned\\x07"),  # OSC: sets the window title
    ("\x1b[2J", "\\x1b[2J"),  # CSI: clears the screen
    ("\x9b31mred", "\\x9b31mred"),  # the same CSI as one C1 character
    ("\x1bP1$r\x1b\\", "\\x1bP1$r\\x1b\\"),  # DCS ... ST
    ("run1\nrun2", "run1\\nrun2"),  # a forged row
    ("a\tb", "a\\tb"),
    ("ok\rFAKE", "ok\\rFAKE"),  # overwrites the line's start
    ("\x00\x7f\x85", "\\x00\\x7f\\x85"),  # NUL, DEL, NEL (C1)
    ("run-\u202e1nur", "run-\\u202e1nur"),  # right-to-left override
    ("\u2066x\u2069", "\\u2066x\\u2069"),  # left-to-right isolate, pop directional isolate
    ("\u202a\u202b\u202c\u202d", "\\u202a\\u202b\\u202c\\u202d"),
    ("ru\u200bn", "ru\\u200bn"),  # zero-width space: two ids that look alike
    ("\ufeffrun", "\\ufeffrun"),
    ("a\u2028b", "a\\u2028b"),  # line separator
    ("\U000e0041", "\\U000e0041"),  # a tag character
    ("\ud800", "\\ud800"),  # a lone surrogate would raise UnicodeEncodeError on print
])
def test_controls_are_shown_as_escapes(raw: str, shown: str) -> None:
    assert terminal_safe(raw) == shown


@pytest.mark.parametrize("text", [
    "demo-20261203-150728-run1", "grader/format_reward", "é", "日本", "Ünïcødé ✓ π≈3.14 🙂", "C:\\runs\\a",
    "\\x1b typed as text", "with spaces  and 'quotes' \"too\"", "",
])
def test_ordinary_text_is_unchanged(text: str) -> None:
    assert terminal_safe(text) == text
    assert terminal_safe_lines(text) == text
    assert csv_safe(text) == text


def test_every_c0_del_and_c1_control_is_escaped() -> None:
    for code in [*range(0x20), 0x7f, *range(0x80, 0xa0)]:
        shown = terminal_safe(chr(code))
        assert shown.startswith("\\") and shown.isascii() and shown.isprintable(), hex(code)


def test_escaped_text_is_printable_ascii_where_the_input_was_not() -> None:
    everything = "".join(map(chr, sorted(UNSAFE)))
    shown = terminal_safe(everything)
    assert shown.isascii() and shown.isprintable()


def test_the_scanned_planes_hold_every_unsafe_code_point() -> None:
    """The table is built from part of Unicode (fast at import): nothing of the unsafe categories
    lies outside it in this Python's Unicode data."""
    scanned = {c for plane in SCANNED_PLANES for c in plane}
    outside = [hex(c) for c in range(sys.maxunicode + 1)
               if c not in scanned and unicodedata.category(chr(c)) in UNSAFE_CATEGORIES]
    assert outside == []


def test_lines_keep_newlines_and_csv_keeps_newlines_and_tabs() -> None:
    raw = "line 1\n\x1b[2Jline\t2\r"
    assert terminal_safe(raw) == "line 1\\n\\x1b[2Jline\\t2\\r"
    assert terminal_safe_lines(raw) == "line 1\n\\x1b[2Jline\\t2\\r"
    assert csv_safe(raw) == "line 1\n\\x1b[2Jline\t2\\r"


def _log_line(formatter: logging.Formatter, msg: str, *args: object, exc: bool = False) -> str:
    exc_info = None
    if exc:
        try:
            raise ValueError("bad \x1b[2J value")
        except ValueError:
            exc_info = sys.exc_info()
    record = logging.LogRecord("rlpulse.sinks.alerts.webhook", logging.WARNING, __file__, 1, msg, args, exc_info)
    return formatter.format(record)


def test_the_log_formatter_escapes_its_arguments_and_keeps_one_line() -> None:
    formatter = TerminalSafeFormatter("%(levelname)s %(name)s: %(message)s")
    line = _log_line(formatter, "webhook %s: refused for %s", "http://h:1", "xid FIRING GPU-\x1b]0;pwned\x07\nINFO fake")
    assert line == ("WARNING rlpulse.sinks.alerts.webhook: webhook http://h:1: refused for xid FIRING "
                    "GPU-\\x1b]0;pwned\\x07\\nINFO fake")
    with_traceback = _log_line(formatter, "failed", exc=True)
    assert "\x1b" not in with_traceback and "bad \\x1b[2J value" in with_traceback
    assert with_traceback.count("\n") >= 3  # the traceback keeps its lines
