"""What ``rlpulse query``, ``report``, ``alerts`` and ``watch`` print carries no control character
from the data (anyone who can write to a raw topic chooses those strings).

Each command's text is made by one formatting function; each is fed rows whose run ids,
projects, terms, keys and summaries hold escape sequences (OSC, CSI, the C1 CSI), a newline,
a carriage return and bidi overrides, as anyone who can write to a raw topic could send, and the
printed text is checked for every one of them raw, and for their visible escapes.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from typing import Any

import pytest
from rich.console import Console

from rlpulse.sinks.alerts.alert_feed import format_alert
from rlpulse.sinks.read.queries import render as render_query
from rlpulse.base.terminal import print_table
from rlpulse.sinks.views.report import print_report
from rlpulse.sinks.views.watch_data import NS, Alert, Gpu, RunLine, WatchSnapshot
from rlpulse.sinks.views.watch_view import render as render_watch

RUN = "run-\x1b]0;pwned\x07-1"  # retitles the window
PROJECT = "proj\x1b[2J"  # clears the screen
TERM = "total\x9b31m"  # CSI as one C1 character
KEY = "GPU-\u202e1-UPG"  # right-to-left override
SUMMARY = "rate 0.5\nFAKE ROW\rover\u2066written\u2069"
HOSTILE = (RUN, PROJECT, TERM, KEY, SUMMARY)
SHOWN = ("run-\\x1b]0;pwned\\x07-1", "proj\\x1b[2J", "total\\x9b31m", "GPU-\\u202e1-UPG",
         "rate 0.5\\nFAKE ROW\\rover\\u2066written\\u2069")
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")


def assert_clean(text: str, *, sgr: bool = False) -> None:
    """No control, C1, bidi or zero-width character; newlines only as the output's own line ends.
    ``sgr``: rich's own colour sequences (ESC [ ... m) are allowed, nothing else with an ESC."""
    if sgr:
        text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    found = RAW.search(text)
    assert found is None, f"raw {found.group()!r} at {found.start()} in {text!r}"


# ------------------------------------------------------------------------------ rlpulse query


def test_query_table_escapes_every_cell_and_forges_no_row() -> None:
    out = render_query(["run_id", "term\x1b[1m", "n"], [(RUN, TERM, 1), (SUMMARY, KEY, 2), (PROJECT, None, 3)], "table")
    assert_clean(out)
    lines = out.splitlines()
    assert len(lines) == 2 + 3  # header, rule, one line per row: the newline in SUMMARY forged none
    assert lines[0].split() == ["run_id", "term\\x1b[1m", "n"]
    assert lines[2].split() == [SHOWN[0], SHOWN[2], "1"]
    assert lines[3].startswith(SHOWN[4] + "  " + SHOWN[3])


def test_query_csv_escapes_controls_and_keeps_a_value_whole() -> None:
    out = render_query(["run_id", "summary"], [(RUN, SUMMARY), (PROJECT, KEY)], "csv")
    assert_clean(out.replace("\n", ""))
    # A newline stays data (the cell is quoted; a CSV reader gets it back), every other control is shown.
    assert out == ('run_id,summary\n'
                   f'{SHOWN[0]},"rate 0.5\nFAKE ROW\\rover\\u2066written\\u2069"\n'
                   f'{SHOWN[1]},{SHOWN[3]}\n')


def test_query_json_is_escaped_by_json_and_reads_back_the_values() -> None:
    out = render_query(["run_id", "summary", "terms"], [(RUN, SUMMARY, [TERM, KEY])], "json")
    assert_clean(out.replace("\n", ""))
    assert out.isascii()
    assert json.loads(out) == [{"run_id": RUN, "summary": SUMMARY, "terms": [TERM, KEY]}]  # nothing lost


# ------------------------------------------------------------------------------ rlpulse report


@dataclass
class _Result:
    column_names: tuple[str, ...]
    result_rows: list[tuple]


class _Client:
    """Answers each query of print_report with hostile rows, as a store filled from raw topics would."""

    def query(self, sql: str, parameters: dict[str, Any] | None = None, settings: dict[str, Any] | None = None) -> _Result:
        if "mfu_out_of_range" in sql:  # the saved query step-throughput of an attempt
            return _Result(("project", "run_id", "attempt", "step", "time_ns", "tokens", "duration_s", "tokens_per_s", "mfu",
                            "mfu_out_of_range"), [(PROJECT, RUN, 1, 0, 1, 100, 2.0, 50.0, None, 1)])
        if "share_zero_fraction" in sql:  # the saved query term-figures of a run: a term is any writer's string
            return _Result(("project", "attempt", "step", "term", "rollouts", "share_mean", "share_std",
                            "share_zero_fraction", "graded", "failures", "failure_rate", "failure_cost", "duration_p50_s",
                            "duration_p90_s", "duration_p99_s", "duration_max_s", "judge_input_tokens",
                            "judge_output_tokens"),
                           [(PROJECT, 1, 0, TERM, 4, 0.2, 0.1, 0.5, 4, 2, 0.5, None, 1.0, 2.0, 3.0, 3.0, 10, 2)])
        if "DISTINCT project, run_id FROM rlpulse.step_term_stats" in sql:  # the runs with term figures
            return _Result(("project", "run_id"), [(PROJECT, RUN)])
        if "energy_kwh" in sql:  # the saved query gpu-time
            return _Result(("project", "run_id", "attempt", "gpus", "gpu_seconds", "gpu_hours", "held_from", "held_to",
                            "energy_gpus", "energy_kwh"), [(PROJECT, RUN, 1, 2, 3600.0, 1.0, None, None, 0, None)])
        if "HAVING countIf(type = 'STEP')" in sql:  # the attempts the per-run figures are of
            return _Result(("project", "run_id", "attempt"), [(PROJECT, RUN, 1)])
        if "count()" in sql:
            return _Result(("count()",), [(2,)])
        if "grader_failures" in sql:
            return _Result(("run_id", "attempt", "cause", "failures", "graded", "failure_rate"),
                           [(RUN, 1, TERM, 3, 10, 0.3), (SUMMARY, 1, KEY, 1, 10, 0.1)])
        if "reward_histograms" in sql:
            return _Result(("run_id", "bounds", "counts"), [(RUN, [0.0, 1.0], [1, 2, 3])])
        if "step_stats" in sql:
            return _Result(("run_id", "attempt", "step", "rollouts", "clipped", "clipped_ratio", "reward_mean",
                            "zero_fraction", "completion_mean"), [(RUN, 1, 0, 8, 1, 0.125, 0.5, 0.25, 100.0)])
        if ".steps FINAL" in sql:  # how runs ended: a status is a string any writer could send
            return _Result(("run_id", "attempt", "status", "steps"), [(RUN, 1, SUMMARY, 3)])
        if "alerts" in sql:
            return _Result(("time", "rule", "state", "key", "summary"), [("12:00:00", "xid", "FIRING", KEY, SUMMARY)])
        raise AssertionError(f"unexpected query {sql}")


@dataclass
class _Store:
    client: _Client
    database: str = "rlpulse"


def test_report_prints_hostile_rows_and_headings_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    print_report(_Store(_Client()), project=PROJECT)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert_clean(out)
    for shown in SHOWN:
        assert shown in out
    assert f"== reward histogram, run {SHOWN[0]} (all steps, term total) ==" in out
    assert f"== alerts (project {SHOWN[1]}) ==" in out
    assert f"== throughput and efficiency per run (project {SHOWN[1]}) ==" in out
    assert "1 step reported an MFU outside [0, 1]: no MFU is shown for them, and the mean leaves them out." in out
    assert not any(line.startswith("FAKE ROW") for line in out.splitlines())


def test_print_table_of_dead_letters_is_escaped_too(capsys: pytest.CaptureFixture[str]) -> None:
    """``rlpulse dlq`` prints its reasons with the same table."""
    print_table(["source", "bytes", "replayed to", "reason"], [(RUN, 10, None, SUMMARY)])
    assert_clean(capsys.readouterr().out)


# ------------------------------------------------------------------------------ rlpulse alerts


def test_alert_lines_are_one_line_without_controls() -> None:
    alert = {"time_ns": 1_700_000_000 * NS, "state": "FIRING", "rule": "grader_failure_rate\x1b[8m", "key": KEY,
             "severity": "warning", "summary": SUMMARY, "value": 0.5, "threshold": 0.2, "project": PROJECT,
             "run_id": RUN, "attempt": 1}
    line = format_alert(alert)
    assert_clean(line)
    assert "\n" not in line
    assert line.endswith(f"FIRING   grader_failure_rate\\x1b[8m {SHOWN[3]} [warning] {SHOWN[4]} "
                         "(value 0.5, threshold 0.2)")


# ------------------------------------------------------------------------------ rlpulse watch


def _snapshot() -> WatchSnapshot:
    now = 1_700_000_000 * NS
    alert = Alert("grader_failure_rate", f"{PROJECT}/{RUN}/1/{TERM}", "warning", SUMMARY, PROJECT, RUN, 1, now - 60 * NS)
    gpu = Gpu(KEY, "host\x1b[2J", 0, 0.9, 300.0, now - 5 * NS, 0.5)
    runs = [RunLine(PROJECT, RUN, 1, "RUNNING", 3, 4, 1.0, 0.5, 0.1, 0.2, 10, now - 600 * NS, now - 5 * NS, now,
                    gpus=[gpu], alerts=[alert]),
            RunLine("other\u202e", SUMMARY, 1, "STALLED", 1, 2, 0.5, None, None, None, 0, now - 600 * NS, now - 5 * NS, now)]
    return WatchSnapshot(f"chdb:///tmp/{PROJECT}", "rlpulse", now, runs, any_runs=True)


@pytest.mark.parametrize("width", [80, 250])  # narrow: a heading per project; wide: a PROJECT column
def test_watch_frame_has_no_raw_controls(width: int) -> None:
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False).print(render_watch(_snapshot()))
    out = buf.getvalue()
    assert_clean(out)
    assert "\\x1b" in out and "\\u202e" in out  # shown, not dropped
    assert not any(line.lstrip().startswith("FAKE ROW") for line in out.splitlines())


def test_watch_live_view_on_a_terminal_sends_only_its_own_colours() -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=200, force_terminal=True, color_system="truecolor")
    console.print(render_watch(_snapshot(), note="refresh 2s", error="cannot read (\x1b]0;pwned\x07); retrying"))
    out = buf.getvalue()
    assert "\x1b]0;" not in out and "\x1b[2J" not in out
    assert_clean(out, sgr=True)
    assert f"{SHOWN[0]}" in re.sub(r"\x1b\[[0-9;]*m", "", out)


# ------------------------------------------------------------------------------ the CLI's own lines


class _EmptyRunStore:
    """A store that has rows, none of the asked run, and hostile latest run names."""

    url = "chdb:///tmp/store"
    database = "rlpulse"

    def __init__(self) -> None:
        self.client = self

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> _Result:
        if "system.databases" in sql or "system.tables" in sql:
            return _Result(("n",), [(1,)])
        if "max(attempt), count()" in sql:
            return _Result(("a", "n"), [(0, 0)])
        if "ORDER BY max(t)" in sql:
            return _Result(("run_id",), [(RUN,), (SUMMARY,)])
        raise AssertionError(f"unexpected query {sql}")

    def __enter__(self) -> _EmptyRunStore:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_cli_error_naming_hostile_runs_is_one_line_and_escaped(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Any) -> None:
    import logging
    import os

    from rlpulse import cli
    from rlpulse.base.terminal import TerminalSafeFormatter

    handlers: list[logging.Handler] = []
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: handlers.extend(kw["handlers"]))
    monkeypatch.setattr("rlpulse.sinks.store.clickhouse.open_reader", lambda dsn, owner="": _EmptyRunStore())
    umask = os.umask(0o022)
    try:
        code = cli.main(["report", "missing", "--html", str(tmp_path / "out.html"), "--clickhouse-url", "chdb:///tmp/x"])
    finally:
        os.umask(umask)
    err = capsys.readouterr().err
    assert code == 1
    assert err == (f"rlpulse report: no rows name run 'missing' in chdb:///tmp/store. Latest runs: {SHOWN[0]}, "
                   f"{SHOWN[4]}\n")
    assert [type(h.formatter) for h in handlers] == [TerminalSafeFormatter]  # the log lines are escaped too
