"""Commands that read ClickHouse only (``ui``, ``query``, ``report``, ``watch``) offer no Kafka flags:
``--help`` shows no --bootstrap or --topic-prefix, and passing one is a usage error (exit 2) that
says why, under the command's own usage line. The pipeline's commands keep them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlpulse.cli import build_parser, main

pytestmark = pytest.mark.full  # new this round: make test stays under 6 minutes

REPO = Path(__file__).resolve().parents[3]
CLICKHOUSE_ONLY = ("ui", "query", "report", "watch")


def help_of(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", CLICKHOUSE_ONLY)
def test_clickhouse_only_commands_offer_no_kafka_flags(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(command, capsys)
    assert "--bootstrap" not in text and "--topic-prefix" not in text, text
    assert "--clickhouse-url" in text and "--verbose" in text


@pytest.mark.parametrize("command", ["status", "streams", "sink", "simulate", "alerts"])
def test_the_pipelines_commands_keep_them(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(command, capsys)
    assert "--bootstrap KAFKA_BOOTSTRAP" in text and "--topic-prefix TOPIC_PREFIX" in text


@pytest.mark.parametrize("argv", [["query", "--bootstrap", "h:1", "SELECT 1"], ["report", "--topic-prefix=x"],
                                  ["watch", "--once", "--bootstrap"], ["ui", "--topic-prefix", "x"]])
def test_a_kafka_flag_is_a_usage_error_that_says_why(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    flag = next(a for a in argv if a.startswith("--") and a != "--once").split("=")[0]
    assert err.startswith(f"usage: rlpulse {argv[0]} "), err
    assert err.splitlines()[-1] == (f"rlpulse {argv[0]}: error: {flag}: rlpulse {argv[0]} reads ClickHouse only and "
                                    "takes no Kafka flags (--bootstrap, --topic-prefix)")


@pytest.mark.full  # two interpreters started: a second or two
def test_as_a_user_runs_them() -> None:
    run = subprocess.run([sys.executable, "-m", "rlpulse.cli", "ui", "--help"], capture_output=True, text=True,
                         cwd=REPO, env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"}, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[:2] == ["usage: rlpulse ui [-h] [--host HOST] [--port PORT] [--allow-host NAME]",
                                           "                  [--clickhouse-url CLICKHOUSE_URL] [-v]"]
    run = subprocess.run([sys.executable, "-m", "rlpulse.cli", "query", "--bootstrap", "127.0.0.1:9092", "SELECT 1"],
                         capture_output=True, text=True, cwd=REPO, env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"},
                         timeout=60)
    assert (run.returncode, run.stdout) == (2, ""), run.stderr
    assert run.stderr.splitlines()[-1] == ("rlpulse query: error: --bootstrap: rlpulse query reads ClickHouse only and "
                                           "takes no Kafka flags (--bootstrap, --topic-prefix)")
