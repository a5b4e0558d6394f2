"""The options of ``make bench`` / ``rlpulse bench``, in one place for both.

Imports nothing: ``rlpulse``'s CLI loads this file to build ``rlpulse bench --help``.
"""

from __future__ import annotations

import argparse

REPS = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int, default=1000, help="concurrent runs in the backlog (1,012 events each)")
    p.add_argument("--reps", type=int, default=REPS, help="drains, each of a fresh backlog; the rate is their median")
    p.add_argument("--quick", action="store_true",
                   help="a drain figure in under 2 minutes, to check a hot-path change before committing it: the same "
                        "backlog drained once, with its CPU per event; no SDK figures, ceilings or profile; 5 s of latency")
    p.add_argument("--smoke", action="store_true",
                   help="try the harness end to end: 50 runs, one drain, one run of each ceiling and of SDK -> Kafka, "
                        "5 s of latency (the figures are too small to compare)")
    p.add_argument("--save-baseline", action="store_true",
                   help="also write this run's figures to bench/results/baseline.json, which every run is compared with")
    p.add_argument("--skip-sdk", action="store_true", help="leave out bench/sdk.py's figures")
    p.add_argument("--skip-e2e", action="store_true", help="leave out the ceilings, the drains and the latency")
    p.add_argument("--skip-ui", action="store_true",
                   help="leave out rlpulse ui's answer times for 8 runs of 1,000 steps x 512 rollouts (bench/ui_bench.py)")
    p.add_argument("--drain-timeout", type=float, default=300.0, help="seconds before a drain counts as not completed")
    p.add_argument("--latency-s", type=float, default=None,
                   help="seconds of live load for the latency figures (default 20; 5 with --quick or --smoke)")
    p.add_argument("--no-profile", action="store_true", help="do not attach py-spy during the first drain")
    p.add_argument("--keep", action="store_true", help="keep the benchmark's topics and chDB stores afterwards")
    p.add_argument("--output", metavar="DIR", default=None,
                   help="folder for latest.json, its timestamped copy, the processes' logs and profiles (default bench/results)")


def to_argv(args: argparse.Namespace) -> list[str]:
    """The command line that gives ``args`` back (for running bench/run.py as a child)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    argv: list[str] = []
    for action in p._actions:  # noqa: SLF001 - argparse has no public list of its actions
        if not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        argv += [flag] if isinstance(action, argparse._StoreTrueAction) else [flag, str(value)]  # noqa: SLF001
    return argv
