"""The pure parts of ``rlpulse ui``'s compare and search pages: the EMA, each run's colour and dash, the
overlay chart's markup, the URL parameters (a bad one is a 400 that says what was expected), what differs
between configurations, and the search's conditions."""

from __future__ import annotations

import re

import pytest

from rlpulse.sinks.views import compare_data as cd
from rlpulse.sinks.views import overlay_charts as oc
from rlpulse.sinks.views import search_data as sd
from rlpulse.sinks.views.ui_compare import CompareView, parse
from rlpulse.sinks.views.ui_params import parse_run, run_param
from rlpulse.sinks.views.ui_params import BadParameter
from rlpulse.sinks.views.ui_search import decimal_param
from rlpulse.sinks.views.ui_search import parse as parse_search

pytestmark = pytest.mark.full


def test_ema_is_tensorboards_debiased_smoothing() -> None:
    assert oc.ema([1.0, 2.0, 3.0], 0.0) == [1.0, 2.0, 3.0]
    # by hand: last = 0.4*1 = 0.4 -> 0.4/0.4 = 1; last = 0.6*0.4 + 0.4*3 = 1.44 -> 1.44/0.64 = 2.25;
    # last = 0.6*1.44 + 0.4*0 = 0.864 -> 0.864/0.784
    assert oc.ema([1.0, 3.0, 0.0], 0.6) == pytest.approx([1.0, 2.25, 0.864 / 0.784], rel=1e-12)
    assert oc.ema([5.0] * 50, 0.9) == pytest.approx([5.0] * 50, rel=1e-12)  # a flat line stays flat from the start
    assert oc.ema([], 0.5) == []
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="from 0 to below 1"):
            oc.ema([1.0], bad)


def test_eight_runs_get_eight_colours_and_eight_dash_patterns() -> None:
    styles = [oc.style(i) for i in range(cd.MAX_RUNS)]
    assert len({c for c, _ in styles}) == len({d for _, d in styles}) == cd.MAX_RUNS == 8
    for _, dash in styles:  # each a valid stroke-dasharray (or solid), not a repeat of another one scaled
        assert dash == "" or re.fullmatch(r"\d+( \d+)+", dash)
    normalised = {tuple(int(x) / max(map(int, d.split())) for x in d.split()) if d else () for _, d in styles}
    assert len(normalised) == 8
    with pytest.raises(ValueError, match="at most 8 runs"):
        oc.style(8)
    assert 'stroke-dasharray="9 4"' in oc.swatch(1) and "stroke-dasharray" not in oc.swatch(0)


def test_an_overlay_draws_each_run_in_its_style_with_exact_points_and_hover_titles() -> None:
    series = [oc.Series(0, "p/a/1", "a #1", [oc.Point(0, 0.0, 0.5), oc.Point(1, 1.0, 0.25)]),
              oc.Series(1, "p/b%2Fc/2", "b/c #2", [oc.Point(1, 1.0, 1.0, lo=0.5, hi=1.5)]),
              oc.Series(2, "p/empty/1", "empty #1", [])]
    svg = oc.overlay("x", "Title", oc.Axis(0.0, 1.0), series, smooth=0.5)
    lines = re.findall(r'<polyline class="series" data-run="([^"]+)"[^>]* stroke="([^"]+)" stroke-width="[\d.]+"'
                       r'( stroke-dasharray="[^"]+")?', svg)
    assert lines == [("p/a/1", oc.COLOURS[0], ""), ("p/b%2Fc/2", oc.COLOURS[1], ' stroke-dasharray="9 4"')]
    points = re.findall(r'data-run="([^"]+)" data-step="(\d+)" data-x="([^"]+)" data-value="([^"]+)" data-raw="([^"]+)"', svg)
    assert points == [("p/a/1", "0", "0.0", "0.5", "0.5"), ("p/a/1", "1", "1.0", repr(oc.ema([0.5, 0.25], 0.5)[1]), "0.25"),
                      ("p/b%2Fc/2", "1", "1.0", "1.0", "1.0")]
    assert 'data-lo="0.5" data-hi="1.5"' in svg and svg.count('class="band"') == 1
    assert "<title>a #1 at step 1: 0.25 (smoothed: 0.3333)</title>" in svg
    strips = re.findall(r'<rect class="hover"[^>]*><title>([^<]*)</title>', svg)
    assert strips == ["step 0\na #1 at step 0: 0.5 (smoothed: 0.5)",
                      "step 1\na #1 at step 1: 0.25 (smoothed: 0.3333)\nb/c #2 at step 1: 1 (smoothed: 1); p10 0.5, p90 1.5"]
    assert "empty" not in svg  # a run without points has no line and no key
    assert oc.overlay("x", "Title", oc.Axis(0.0, 1.0), [series[2]]) == ""  # nothing to draw: no empty panel


def test_the_time_axis_is_continuous_and_labels_its_fractional_ticks() -> None:
    axis = oc.TimeAxis(0.0, 0.05)
    assert axis.x(0.0) == oc.LEFT and axis.x(0.05) == oc.W - oc.RIGHT
    svg = oc.overlay("t", "T", axis, [oc.Series(0, "p/a/1", "a", [oc.Point(0, 0.0, 1.0), oc.Point(1, 0.05, 2.0)])])
    assert ">0.01</text>" in svg and ">0.05</text>" in svg and "minutes since the run’s first step" in svg
    assert "after its first step" in svg


def test_run_parameters_round_trip_and_bad_ones_say_what_was_expected() -> None:
    for key in (("p", "r", 1), ("p", "a/b c%", 7), ("proj/x", "r", None)):
        assert parse_run(run_param(key)) == key
    assert run_param(("p", "a/b", 2)) == "p/a%2Fb/2"
    for value, message in (("alpha", "run: expected PROJECT/RUN or PROJECT/RUN/ATTEMPT, each part percent-encoded, "
                                     "got 'alpha'"),
                           ("p/r/x", "run: the attempt is a whole number from 1, got 'x' in 'p/r/x'"),
                           ("p/r/0", "run: the attempt is a whole number from 1, got '0' in 'p/r/0'"),
                           ("p/r/²", "run: the attempt is a whole number from 1, got '²' in 'p/r/²'"),  # isdigit, not int
                           ("/r", "run: expected PROJECT/RUN or PROJECT/RUN/ATTEMPT, each part percent-encoded, got '/r'"),
                           ("p/r/1/2", "run: expected PROJECT/RUN or PROJECT/RUN/ATTEMPT, each part percent-encoded, "
                                       "got 'p/r/1/2'")):
        with pytest.raises(BadParameter) as caught:
            parse_run(value)
        assert str(caught.value) == message


def test_compare_parameters() -> None:
    view = parse({"run": ["p/a/1", "p/b", "p/a/1"], "x": ["time"], "smooth": ["0.6"], "from": ["3"], "metric": ["kl", ""],
                  "config": ["all"]})
    assert view == CompareView([("p", "a", 1), ("p", "b", None)], "time", 0.6, 3, None, ["kl"], True)
    assert view.params() == [("run", "p/a/1"), ("run", "p/b"), ("x", "time"), ("smooth", 0.6), ("from", 3), ("to", None),
                             ("config", "all"), ("metric", "kl")]
    assert parse({}).wanted == [] and parse({"smooth": [""]}).smooth == 0.0
    bad = {"smooth": (["1"], "smooth: expected an EMA weight from 0 to below 1 (0.6 smooths as TensorBoard's default), "
                             "got '1'"),
           "x": (["wall"], "x: one of step, time, got 'wall'"),
           "from": (["a"], "from: expected a whole number, got 'a'"),
           "run": ([f"p/r{i}" for i in range(9)], "run: at most 8 runs can be compared at once (eight colours and dash "
                                                  "patterns tell them apart); the URL names 9")}
    for name, (values, message) in bad.items():
        with pytest.raises(BadParameter) as caught:
            parse({name: values})
        assert str(caught.value) == message
    with pytest.raises(BadParameter, match="smooth: expected a number, got 'x'"):
        parse({"smooth": ["x"]})


def test_search_parameters() -> None:
    s = parse_search({"project": ["p"], "run": ["r"], "min_reward": ["0"], "max_reward": ["0.5"], "status": ["ERROR"],
                      "failed": ["judge"], "clipped": ["0"], "from": ["1"], "to": ["2"], "q": ["hi"], "page": ["3"]})
    assert s == sd.Search("p", "r", 0, 0.0, 0.5, "ERROR", "judge", False, 1, 2, "hi", 3)
    assert decimal_param(0.0) == "0" and decimal_param(0.1) == "0.1" and decimal_param(None) is None
    for query, message in (({}, "the URL needs run="),
                           ({"run": ["r"], "status": ["FAILED"]}, "status: one of (none), OK, ERROR, got 'FAILED'"),
                           ({"run": ["r"], "q": ["x" * 201]}, "q: at most 200 characters of text to search for, got 201"),
                           ({"run": ["r"], "from": ["5"], "to": ["4"]}, "from (5) is after to (4): nothing could match"),
                           ({"run": ["r"], "page": ["0"]}, "page: expected a number from 1, got '0'")):
        with pytest.raises(BadParameter) as caught:
            parse_search(query)
        assert str(caught.value) == message


def test_only_runs_that_sent_a_configuration_take_part_in_what_differs() -> None:
    a, b, c = ("p", "a", 1), ("p", "b", 1), ("p", "c", 1)
    config = {a: {"lr": "1e-05", "seed": "1", "x": "1"}, b: {"lr": "3e-05", "seed": "1"}, c: {}}
    assert cd.differing(config) == ["lr", "x"]  # x: missing in b; c sent nothing, so it is not "missing" everything
    assert cd.differing({a: config[a], c: {}}) == []
    assert cd.differing({}) == []


def test_search_conditions() -> None:
    narrow, reward, params = sd.where(sd.Search("p", "r", 1, min_reward=0.5, status="OK", failed="judge", clipped=True,
                                                lo=2, q="x"))
    assert "step >= {lo_s:Int64}" in narrow and "status = {status:String}" in narrow and "ifNull(clipped, false)" in narrow
    assert "term = {term:String}" in narrow and f"positionCaseInsensitiveUTF8({sd.DIALOGUE}, {{q:String}}) > 0" in narrow
    assert reward == "rw >= {lo_r:Float64}"
    assert params == {"p": "p", "r": "r", "a": 1, "lo_s": 2, "status": "OK", "lo_r": 0.5, "term": "judge", "q": "x"}
    narrow, reward, params = sd.where(sd.Search("p", "r", 1, failed=sd.ANY_TERM, clipped=False))
    assert "term =" not in narrow and "NOT ifNull(clipped, false)" in narrow and reward == "true" and "term" not in params


def test_a_nan_or_an_infinity_is_left_out_of_a_runs_figures() -> None:
    nan, inf = float("nan"), float("inf")
    rows = [("p", "a", 1, 0, 0.5), ("p", "a", 1, 1, nan), ("p", "a", 1, 2, -inf), ("p", "b", 2, 0, 1.0)]
    assert cd._by_run(rows) == {("p", "a", 1): {0: 0.5}, ("p", "b", 2): {0: 1.0}}
    spread = [("p", "a", 1, 0, 0.1, 0.5, 0.9), ("p", "a", 1, 1, 0.1, nan, 0.9)]
    assert cd._by_run(spread, lambda v: tuple(float(x) for x in v)) == {("p", "a", 1): {0: (0.1, 0.5, 0.9)}}
