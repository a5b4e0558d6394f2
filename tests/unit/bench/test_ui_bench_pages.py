"""The URLs bench/ui_bench.py times are the ones ``rlpulse ui`` serves: each path is routed, each parameter parses
with ``ui_params`` as the pages read it, and the compare page's ``run=`` values name the 8 loaded runs."""

from __future__ import annotations

from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from bench.ui_bench import PROJECT, RUN, RUNS, SEARCH_PAGE, across_pages, all_pages, compare_value
from bench.ui_load import QUERY_WORD, run_id
from rlpulse.sinks.views import ui_routes
from rlpulse.sinks.views.ui_params import choice, decimal, integer, one

pytestmark = pytest.mark.full


def parsed(path: str) -> tuple[str, dict[str, list[str]]]:
    url = urlsplit(path)
    return url.path, parse_qs(url.query, keep_blank_values=True)


def test_every_page_is_a_routed_path() -> None:
    # ui_routes' docstring table lists the paths route() serves
    assert {parsed(p)[0] for p in all_pages(1000).values()} == {"/", "/run", "/step", "/trajectory", "/compare", "/search"}
    assert all(f"``{path}``" in (ui_routes.__doc__ or "") for path in ("/compare", "/search"))


def test_the_compare_urls_name_the_eight_runs_and_parse() -> None:
    pages = across_pages()
    assert set(pages) >= {"compare_8", "compare_8_time_smooth"}
    for name in ("compare_8", "compare_8_time_smooth"):
        path, query = parsed(pages[name])
        assert path == "/compare"
        runs = [tuple(unquote(part) for part in value.split("/")) for value in query["run"]]
        assert runs == [(PROJECT, run_id(i), "1") for i in range(RUNS)]
    _, by_step = parsed(pages["compare_8"])
    assert choice(by_step, "x", ("step", "time")) == "step"
    _, by_time = parsed(pages["compare_8_time_smooth"])
    assert choice(by_time, "x", ("step", "time")) == "time" and decimal(by_time, "smooth") == 0.6
    assert by_time["metric"] == ["kl", "loss"]


def test_a_slash_in_a_name_stays_one_part_of_a_compare_value() -> None:
    value = compare_value("team/a", "run/1", 2)
    assert [unquote(p) for p in value.split("/")] == ["team/a", "run/1", "2"]


def test_the_search_urls_parse() -> None:
    pages = across_pages()
    for name in ("search", "search_text", f"search_page_{SEARCH_PAGE}"):
        path, query = parsed(pages[name])
        assert path == "/search" and one(query, "project") == PROJECT and one(query, "run") == RUN
        assert integer(query, "attempt") == 1
    _, filtered = parsed(pages["search"])
    assert (decimal(filtered, "min_reward"), decimal(filtered, "max_reward"), one(filtered, "failed")) == (0.2, 0.8, "judge")
    _, text = parsed(pages["search_text"])
    assert one(text, "q") == QUERY_WORD and "min_reward" not in text
    _, deep = parsed(pages[f"search_page_{SEARCH_PAGE}"])
    assert integer(deep, "page", low=1) == SEARCH_PAGE and one(deep, "failed") == "judge"
