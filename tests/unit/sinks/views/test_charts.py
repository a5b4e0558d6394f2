"""The one chart module of the ui and the HTML report (``ui_charts``): what a reader of a chart sees
(tick labels, hover text, where a point sits), without a store or a browser."""

from __future__ import annotations

import re

from rlpulse.sinks.views import ui_charts as charts
from rlpulse.sinks.views.ui_html import fmt_count, fmt_number, fmt_ratio
import pytest

pytestmark = pytest.mark.full  # new this round: make test stays under 6 minutes


def _ticks(svg: str) -> dict[str, float]:
    """y tick label -> its pixel (the grid line's)."""
    return {label: float(y) - 4 for y, label in re.findall(r'<text class="y-tick" x="[^"]*" y="([^"]*)"[^>]*>([^<]*)<', svg)}


def test_a_fraction_on_a_ratio_axis_sits_at_its_percentage() -> None:
    svg = charts.lines("gpu", "GPU", charts.Axis(0, 3), {"gpu0": [(0, 0.9), (1, 0.45), (2, 0.0), (3, 1.0)]},
                       y_range=(0.0, 1.0), fmt=fmt_ratio)
    ticks = _ticks(svg)
    assert list(ticks) == ["0%", "25%", "50%", "75%", "100%"]
    dots = re.findall(r'data-value="([^"]*)" cx="[^"]*" cy="([^"]*)"[^>]*><title>([^<]*)</title>', svg)
    assert [(v, t) for v, _, t in dots] == [("0.9", "gpu0 at step 0: 90%"), ("0.45", "gpu0 at step 1: 45%"),
                                           ("0", "gpu0 at step 2: 0%"), ("1", "gpu0 at step 3: 100%")]
    for value, cy, _ in dots:
        assert abs(float(cy) - (ticks["0%"] + float(value) * (ticks["100%"] - ticks["0%"]))) < 0.06


def test_a_dense_chart_has_hover_values_of_every_series_across_its_width() -> None:
    steps = 1000
    series = {f"s{i}": [(s, s * (i + 1) / 1000) for s in range(steps)] for i in range(8)}
    svg = charts.lines("dense", "Dense", charts.Axis(0, steps - 1), series)
    assert "<circle" not in svg  # too many points for dots: the hover columns carry the values
    hover = svg.split('<g class="hover"')[1]
    columns = re.findall(r'<rect x="([^"]+)" y="[^"]+" width="([^"]+)"[^>]*><title>([^<]*)</title></rect>', hover)
    # 1,000 steps on ~510 px: a column per HOVER_PX (at most HOVER_COLUMNS), each naming its first step and
    # every series' value there, side by side from the left edge to the right one with no gap
    assert charts.HOVER_COLUMNS <= len(columns) <= charts.HOVER_COLUMNS + 1
    for _, _, text in columns:
        step = int(text.split(" | ")[0].removeprefix("step "))
        assert text == f"step {step} | " + " | ".join(f"s{i}: {fmt_number(step * (i + 1) / 1000)}" for i in range(8))
    assert float(columns[0][0]) == charts.LEFT
    ends = [round(float(x) + float(w), 1) for x, w, _ in columns]
    assert all(abs(float(x) - end) <= 0.11 for (x, _, _), end in zip(columns[1:], ends))
    assert abs(ends[-1] - (charts.W - charts.RIGHT)) <= 0.11
    assert len(svg) < 150_000  # 8,000 points in 0.13 MB (0.3 MB with a hover column per step)


def test_bands_add_their_range_to_the_hover_text() -> None:
    svg = charts.lines("m", "M", charts.Axis(0, 1), {"mean": [(0, 0.5), (1, 0.25)]},
                       bands={"mean ± std": [(0, 0.4, 0.6), (1, 0.25, 0.25)]})
    assert re.findall(r"<rect [^>]*><title>([^<]*)</title>", svg) == [
        "step 0 | mean ± std: 0.4 to 0.6 | mean: 0.5", "step 1 | mean ± std: 0.25 to 0.25 | mean: 0.25"]


def test_an_axis_ends_on_a_labelled_tick_and_counts_tick_whole_numbers() -> None:
    svg = charts.lines("t", "T", charts.Axis(0, 1), {"tokens/s": [(0, 505.0), (1, 480.0)]})
    assert list(_ticks(svg)) == ["0", "200", "400", "600"]
    zeros = charts.lines("n", "N", charts.Axis(0, 1), {"tokens": [(0, 0.0), (1, 0.0)]}, fmt=fmt_count)
    assert list(_ticks(zeros)) == ["0", "1"]  # never 0, 0, 1, 1, 1 for 0, 0.25, ...


def test_an_empty_chart_is_known_as_such() -> None:
    axis = charts.Axis(0, 5)
    assert charts.is_empty(charts.lines("x", "X", axis, {"a": []}))
    assert charts.is_empty(charts.bars("x", "X", axis, {}))
    assert charts.is_empty(charts.heatmap("x", "X", axis, ["≤0"], {}))
    assert charts.is_empty(charts.alert_lanes("x", "X", axis, []))
    assert not charts.is_empty(charts.lines("x", "X", axis, {"a": [(1, 2.0)]}))


def test_a_time_axis_ticks_round_clock_times_and_bars_fill_their_window() -> None:
    ns = charts.NS
    start = 1_700_000_000 * ns  # 22:13:20 UTC
    axis = charts.time_axis([start, start + 30 * ns], unit=10 * ns)  # three 10 s windows
    assert [label for _, label in axis.ticks()] == ["22:13:20", "22:13:30", "22:13:40", "22:13:50", "22:14:00"]
    svg = charts.bars("f", "F", axis, {start: {"timeout": 2}, start + 10 * ns: {"timeout": 3}, start + 30 * ns: {"x": 1}})
    segments = re.findall(r'<rect class="segment" [^>]*x="([^"]*)" y="[^"]*" width="([^"]*)"[^>]*><title>([^<]*)</title>',
                          svg)
    assert [t for *_, t in segments] == ["22:13:20 timeout: 2", "22:13:30 timeout: 3", "22:13:50 x: 1"]
    width = axis.slot() * 10 * ns
    assert all(abs(float(w) - 0.8 * width) < 0.2 for _, w, _ in segments)
    assert float(segments[0][0]) > charts.LEFT and float(segments[-1][0]) + float(segments[-1][1]) < charts.W - charts.RIGHT


def test_hover_text_of_a_hostile_label_is_escaped() -> None:
    svg = charts.lines("h", "<b>", charts.Axis(0, 1), {'<img src=x onerror="1">': [(0, 1.0)]}, unit="<i>")
    assert "<img" not in svg and "<i>" not in svg and "<b>" not in svg


def test_a_nan_or_an_infinity_is_left_out_of_a_line_not_a_500() -> None:
    nan, inf = float("nan"), float("inf")
    svg = charts.lines("m", "M", charts.Axis(0, 3), {"loss": [(0, 1.0), (1, nan), (2, inf), (3, 2.0)]},
                       bands={"± std": [(0, 0.5, 1.5), (1, nan, 1.0)]})
    assert re.findall(r'data-x="(\d+)" data-value="([^"]+)"', svg) == [("0", "1"), ("3", "2")]
    assert charts.is_empty(charts.lines("n", "N", charts.Axis(0, 1), {"loss": [(0, nan), (1, -inf)]}))
