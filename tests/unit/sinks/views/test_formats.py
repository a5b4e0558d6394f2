"""Numbers by kind, as every page of ``rlpulse ui`` and the HTML report write them (``ui_html.fmt_*``):
what a reader sees in a table cell, a tick label or a hover text."""

from __future__ import annotations

import math

import pytest

from rlpulse.sinks.views.ui_html import fmt_count, fmt_duration, fmt_number, fmt_rate, fmt_ratio

pytestmark = pytest.mark.full  # new this round: make test stays under 6 minutes

FORMATS = (fmt_number, fmt_count, fmt_ratio, fmt_rate, fmt_duration)


@pytest.mark.parametrize("fmt", FORMATS)
def test_none_and_nan_are_a_dash_and_infinity_a_sign(fmt) -> None:
    assert fmt(None) == fmt(math.nan) == "–"
    assert fmt(math.inf).startswith("∞") and fmt(-math.inf).startswith("-∞")


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_never_reads_minus_zero(fmt) -> None:
    assert fmt(-0.0) == fmt(0.0) and not fmt(-0.0).startswith("-")


def test_a_plain_number_has_four_significant_digits() -> None:
    assert [fmt_number(v) for v in (12.3456, 0.001235, 0.5, 3, 1234, 9999.4)] == [
        "12.35", "0.001235", "0.5", "3", "1234", "9999"]
    # separators from 10,000 on, and a value that rounds up to it is written whole, not "1e+04"
    assert [fmt_number(v) for v in (12345.6, 9999.7, -2_500_000)] == ["12,346", "10,000", "-2,500,000"]
    assert [fmt_number(v) for v in (3e-5, 1.2e16)] == ["3e-05", "1.2e+16"]  # scientific far out
    assert fmt_number(0.30000000000000004) == "0.3"


def test_a_count_is_whole_with_separators() -> None:
    assert [fmt_count(v) for v in (0, 7, 7600, 1234567, 12.4, 12.6, -0.4)] == [
        "0", "7", "7,600", "1,234,567", "12", "13", "0"]


def test_a_ratio_is_a_percentage() -> None:
    assert [fmt_ratio(v) for v in (0.9, 1.0, 0.125, 0.0004, 0, 0.35, 15, -0.05)] == [
        "90%", "100%", "12.5%", "0.04%", "0%", "35%", "1,500%", "-5%"]
    assert fmt_ratio(9.99996) == "1,000%"  # rounds up past 999%: never "1e+03%"
    assert fmt_ratio(0.999999) == "100%"


def test_a_rate_has_an_si_prefix() -> None:
    assert [fmt_rate(v) for v in (512, 12345, 2.5e9, 600, 0, 1.5e6, 3.2e12)] == [
        "512/s", "12.3k/s", "2.5G/s", "600/s", "0/s", "1.5M/s", "3.2T/s"]
    assert fmt_rate(999.96) == "1k/s" and fmt_rate(999.4) == "999/s"  # 999.96 is 1k, never "1e+03/s"
    assert fmt_rate(2e15) == "2e+15/s"
    assert fmt_rate(40, per=" tokens/s") == "40 tokens/s"


def test_a_duration_picks_its_unit() -> None:
    assert [fmt_duration(v) for v in (0.85, 1.5, 150, 3.2 * 3600, 0.00005, 0, 30)] == [
        "850 ms", "1.5 s", "2.5 min", "3.2 h", "0.05 ms", "0 s", "30 s"]
    # at a unit's edge it stays in the smaller one rather than show 0.999 of the next
    assert fmt_duration(59.97) == "60 s" and fmt_duration(0.9996) == "1 s"
    assert fmt_duration(1500 * 3600) == "1,500 h" and fmt_duration(999.96 * 3600) == "1,000 h"


def test_ints_and_floats_read_alike() -> None:
    for fmt in FORMATS:
        assert fmt(3) == fmt(3.0), fmt.__name__


def test_a_live_page_keeps_its_refresh_in_links_and_forms() -> None:
    from rlpulse.sinks.views.ui_html import REFRESH, href, keep_refresh

    body = '<form class="f" method="get" action="/search"><input name="q"></form><form method="post" action="/x"></form>'
    assert href("/run", [("run", "a b")]) == "/run?run=a+b" and keep_refresh(body) == body  # not live: as it was
    token = REFRESH.set(30)
    try:
        assert href("/run", [("run", "a b")]) == "/run?run=a+b&amp;refresh=30"
        assert href("/", [("refresh", "10")]) == "/?refresh=10"  # a link that says its own interval keeps it
        assert keep_refresh(body) == ('<form class="f" method="get" action="/search"><input type="hidden" name="refresh" '
                                      'value="30"><input name="q"></form><form method="post" action="/x"></form>')
    finally:
        REFRESH.reset(token)
    assert href("/run") == "/run"
