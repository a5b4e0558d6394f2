"""The default home (one per checkout, else the XDG data folder) and the progress ticker."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import rlpulse
from rlpulse.progress import Ticker, elapsed
from rlpulse.schemas.settings import Settings, default_home, checkout_root


def _checkout(tmp_path: Path, name: str = "rlpulse", makefile: bool = True) -> Path:
    """A fake source tree: <root>/rlpulse/ beside a pyproject.toml naming ``name`` (and a Makefile)."""
    root = tmp_path / "src"
    (root / "rlpulse").mkdir(parents=True)
    (root / "pyproject.toml").write_text(f'[build-system]\nrequires = []\n\n[project]\nname = "{name}"\nversion = "0.1.0"\n')
    if makefile:
        (root / "Makefile").write_text("demo:\n")
    return root


def test_a_checkout_keeps_its_home_inside_it(tmp_path: Path) -> None:
    root = _checkout(tmp_path)
    assert checkout_root(root / "rlpulse") == root
    assert default_home(root / "rlpulse", env={"XDG_DATA_HOME": "/elsewhere"}) == root / ".rlpulse"


@pytest.mark.parametrize("name, makefile", [("rlpulse", False), ("someone-else", True)])
def test_outside_a_checkout_the_home_is_the_xdg_data_folder(tmp_path: Path, name: str, makefile: bool) -> None:
    root = _checkout(tmp_path, name=name, makefile=makefile)
    assert checkout_root(root / "rlpulse") is None
    assert default_home(root / "rlpulse", env={"XDG_DATA_HOME": "/data"}) == Path("/data/rlpulse")
    assert default_home(root / "rlpulse", env={}) == Path.home() / ".local" / "share" / "rlpulse"


def test_an_installed_package_has_no_checkout(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    (site / "rlpulse").mkdir(parents=True)
    assert default_home(site / "rlpulse", env={"XDG_DATA_HOME": str(tmp_path / "xdg")}) == tmp_path / "xdg" / "rlpulse"


def test_this_checkout_and_the_override() -> None:
    here = Path(rlpulse.__file__).resolve().parents[1]
    assert Settings.load({}).home == here / ".rlpulse"  # the folder the Makefile's targets use
    assert Settings.load({"RLPULSE_HOME": "/tmp/other"}).home == Path("/tmp/other")
    assert Settings.load({}).clickhouse_dsn == f"chdb://{here / '.rlpulse' / 'clickhouse'}"


@pytest.mark.parametrize("seconds, text", [(0.4, "0s"), (8.9, "8s"), (59, "59s"), (60, "1m00s"), (125, "2m05s"),
                                           (3725, "1h02m")])
def test_elapsed(seconds: float, text: str) -> None:
    assert elapsed(seconds) == text


def test_ticker_says_what_it_waits_for_with_the_elapsed_time() -> None:
    now = [100.0]
    lines: list[str] = []

    def said(line: str) -> bool:
        deadline = time.monotonic() + 5
        while line not in lines and time.monotonic() < deadline:
            time.sleep(0.005)
        return line in lines

    with Ticker("fetching jars", say=lines.append, every=0.01, clock=lambda: now[0]) as ticker:
        now[0] = 112.0
        assert said("fetching jars ... 12s")
        ticker.update("waiting for the broker")
        now[0] = 170.0
        assert said("waiting for the broker ... 1m10s")
    n = len(lines)
    time.sleep(0.05)
    assert len(lines) == n  # it stopped with the block


def test_a_short_wait_says_nothing() -> None:
    lines: list[str] = []
    with Ticker("quick", say=lines.append, every=5.0):
        pass
    assert lines == []
