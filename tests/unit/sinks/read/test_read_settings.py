"""The read endpoint's settings allowlist (no setting that carries an expression or names a file):
what a request's URL settings become before any of them reaches the engine. The same requests
through a real sink are in tests/integration/sinks/read/test_endpoint_abuse.py."""

from __future__ import annotations

import pytest

from rlpulse.sinks.read.read_engine import QueryFailed, ReadLimits, reader_settings

LIMITS = ReadLimits()


@pytest.mark.parametrize("name, value", [
    ("additional_result_filter", "toUInt8(file('/proc/self/environ'))=1"),
    ("additional_table_filters", "{'rlpulse.spans': 'toUInt8(file(\\'/proc/self/environ\\'))=1'}"),
    ("format_template_resultset", "/proc/self/environ"),
    ("format_template_row", "/proc/self/environ"),
    ("format_schema", "/etc/passwd:x"),
    ("output_format_schema", "/tmp/written"),
    ("allow_python_table_function", "1"),
    ("allow_introspection_functions", "1"),
    ("user_files_path", "/"),
    ("max_execution_time_leaf", "0"),
    ("bogus_setting", "1"),
    ("X-Evil\r\nSet-Cookie", "1"),
])
def test_settings_outside_the_allowlist_are_refused_with_400_naming_them(name: str, value: str) -> None:
    with pytest.raises(QueryFailed) as refused:
        reader_settings({"max_result_rows": "5", name: value}, LIMITS)
    assert refused.value.code == 452  # SETTING_CONSTRAINT_VIOLATION, sent as HTTP 400
    text = refused.value.text
    assert "\r" not in text and "\n" not in text
    assert (f"Setting '{name}'" in text) if name.isprintable() else ("Setting 'X-Evil" in text)
    assert "/proc" not in text and "environ" not in text  # the value is never echoed


def test_reader_settings_pass_and_the_limits_come_last_and_win() -> None:
    chosen, readonly = reader_settings({"output_format_json_quote_64bit_integers": "0", "date_time_output_format": "iso",
                                        "session_timezone": "UTC", "max_result_rows": "5", "max_execution_time": "3600",
                                        "max_threads": "16", "readonly": "1"}, LIMITS)
    assert readonly == "1"
    assert list(chosen)[:4] == ["allow_python_table_function", "output_format_json_quote_64bit_integers",
                                "date_time_output_format", "session_timezone"]
    assert chosen["allow_python_table_function"] == "0"
    # a request may lower a limit, never raise it; the limits are SET after the request's own settings
    assert chosen["max_result_rows"] == "5"
    assert chosen["max_execution_time"] == str(LIMITS.max_execution_time)
    assert chosen["max_threads"] == str(LIMITS.max_threads)
    assert list(chosen)[-6:] == list(LIMITS.clamped())


@pytest.mark.parametrize("value", ["x" * 257, "a\r\nb", "\x1b[31m"])
def test_values_must_be_short_printable_text(value: str) -> None:
    with pytest.raises(QueryFailed) as refused:
        reader_settings({"output_format_pretty_grid_charset": value}, LIMITS)
    assert refused.value.code == 452 and value not in refused.value.text
