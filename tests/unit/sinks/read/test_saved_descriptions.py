"""A saved query's description is its whole leading comment paragraph, as ``rlpulse query --list``,
the Grafana panels and docs/reference/queries.md show it: never its first line cut mid-sentence."""

from __future__ import annotations

import subprocess
import sys

from rlpulse.commands import saved_listing
from rlpulse.sinks.read.queries import SAVED, list_saved, load_saved, placeholders, split_header
import pytest

pytestmark = pytest.mark.full  # new this round: make test stays under 6 minutes


def test_the_description_is_the_paragraph_up_to_params() -> None:
    sql = ("-- Clipped ratio per step of one run\n--   and its change.  Params (required): run_id: String.\n"
           "-- Dedup: no FINAL.\nSELECT 1")
    assert split_header(sql) == ("Clipped ratio per step of one run and its change.",
                                 "Params (required): run_id: String. Dedup: no FINAL.")
    # a blank comment line ends it too, and a Params line at a line's start
    assert split_header("-- One.\n-- Two.\n--\n-- Notes.\nSELECT 1") == ("One. Two.", "Notes.")
    assert split_header("-- One\n-- two.\n-- Params: none.\nSELECT 1") == ("One two.", "Params: none.")
    assert split_header("-- Only a description.\nSELECT 1") == ("Only a description.", "")
    # "Params" inside a sentence (a column named so) does not end it
    assert split_header("-- Counts of the Params table.\nSELECT 1")[0] == "Counts of the Params table."


def _header(sql: str) -> str:
    """The header comment's words, one line: what split_header divides between description and notes."""
    lines = []
    for line in sql.splitlines():
        if not line.strip().startswith("--"):
            break
        lines.append(line.strip()[2:])
    return " ".join(" ".join(lines).split())


def test_every_saved_query_has_a_whole_sentence() -> None:
    saved = list_saved()
    # every .sql file (another query added later is held to the same header)
    assert set(saved) == {path.stem for path in SAVED.glob("*.sql")} and len(saved) >= 22
    for name, about in saved.items():
        # one or more whole sentences: capitalised (or a figure's name: p10/p50/p90), a full stop at the end
        assert about[:1].isalnum() and about.endswith("."), f"{name}: {about!r}"
        assert "Params" not in about and "  " not in about and "--" not in about, name
        assert len(about) > 40, f"{name}: {about!r}"
        about_, notes = split_header(load_saved(name))
        # the description runs up to the Params sentence every header states, and nothing is dropped
        assert notes.startswith("Params"), f"{name}: the header names no parameters after its description: {notes!r}"
        assert f"{about_} {notes}" == _header(load_saved(name)), name
    assert saved["engine-by-step"] == (
        "The rollout engines of one run, step by step: requests running and waiting, KV-cache usage, token and "
        "preemption rates, time to first token, the prefix cache's hit rate, the time requests waited before they "
        "ran, the inter-token latency, and the share of samples the engines were awake.")
    assert saved["capacity-over-time"] == ("Pool occupancy over time: per minute and pool, the devices declared, "
                                           "observed, granted and queued, and the queued claims.")
    assert saved["final-rewards"] == (
        "The final reward of each rollout of a run (seed 003's find_final_reward), where it came from, and how many "
        "intermediate rewards (emit_reward) it had; rollouts without a reward have a NULL one.")
    assert saved["gpu-time"] == ("GPU time per run: per project, run and attempt, the GPUs it held, their GPU-seconds "
                                 "and the energy they drew.")


def test_list_wraps_each_description_whole_to_the_width() -> None:
    saved = list_saved()
    width = max(map(len, saved))
    text = saved_listing(saved, 80)
    entries: dict[str, list[str]] = {}
    current = ""
    for line in text.splitlines():
        assert len(line) <= 80, line
        if line.startswith(" "):  # a wrapped line of the entry above, under the hanging indent
            assert line[:width + 2].isspace() and not line[width + 2].isspace(), line
            entries[current].append(line.strip())
        else:
            current, _, rest = line.partition(" ")
            entries[current] = [rest.strip()]
            assert line[width:width + 2] == "  "
    assert list(entries) == list(saved)
    for name, lines in entries.items():
        params = placeholders(load_saved(name))
        takes = (" (--param " + ", ".join(f"{n}: {t}" for n, t in params.items()) + ")") if params else ""
        assert " ".join(lines) == saved[name] + takes
    assert len(entries["engine-by-step"]) > 2  # wrapped, not cut
    # as a user reads it in an 80-column terminal
    start = text.index("checkpoints ")
    assert text[start:text.index("content-dropped ")] == (
        "checkpoints             Checkpoint saves and restores of one run: step,\n"
        "                        operation, outcome, duration, size and error. (--param\n"
        "                        run_id: String)\n"
        "clipped-ratio-trend     Clipped ratio per step of one run and its change from\n"
        "                        the previous step. (--param run_id: String, attempt:\n"
        "                        UInt32)\n")


def test_query_list_follows_the_terminal_width() -> None:
    run = subprocess.run([sys.executable, "-m", "rlpulse.cli", "query", "--list"], capture_output=True, text=True,
                         env={"COLUMNS": "120", "PATH": "/usr/bin:/bin"}, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout == saved_listing(list_saved(), 120)
    assert max(map(len, run.stdout.splitlines())) <= 120
