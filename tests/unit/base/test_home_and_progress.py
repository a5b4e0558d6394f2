"""The default home (one per checkout, else the XDG data folder), the broker address it records,
and the progress ticker."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest

import rlpulse
from rlpulse import kafka_jvm
from rlpulse.progress import Ticker, elapsed
from rlpulse.base.settings import Settings, broker_address_file, checkout_root, default_home, recorded_bootstrap


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


def test_the_bootstrap_is_the_flag_then_the_variable_then_the_homes_broker_then_the_default(tmp_path: Path) -> None:
    home = {"RLPULSE_HOME": str(tmp_path)}
    assert Settings.load(home).kafka_bootstrap == "127.0.0.1:9092"  # nothing recorded
    written = kafka_jvm.record_address(Settings(home=tmp_path), "127.0.0.1:29092")
    assert written == broker_address_file(tmp_path) == tmp_path / "kafka" / "bootstrap"
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    assert recorded_bootstrap(tmp_path) == "127.0.0.1:29092"
    assert Settings.load(home).kafka_bootstrap == "127.0.0.1:29092"
    assert Settings.load({}, home=tmp_path).kafka_bootstrap == "127.0.0.1:29092"  # a home given as a flag too
    assert Settings.load({**home, "RLPULSE_KAFKA_BOOTSTRAP": "10.0.0.1:9092"}).kafka_bootstrap == "10.0.0.1:9092"
    assert Settings.load({**home, "RLPULSE_KAFKA_BOOTSTRAP": "10.0.0.1:9092"},
                         kafka_bootstrap="10.0.0.2:9092").kafka_bootstrap == "10.0.0.2:9092"
    other = tmp_path / "other"
    assert Settings.load({"RLPULSE_HOME": str(other)}).kafka_bootstrap == "127.0.0.1:9092"  # another home's own
    kafka_jvm.forget_address(Settings(home=tmp_path))
    assert recorded_bootstrap(tmp_path) is None
    assert Settings.load(home).kafka_bootstrap == "127.0.0.1:9092"


def test_a_cluster_is_recorded_with_every_node(tmp_path: Path) -> None:
    kafka_jvm.record_address(Settings(home=tmp_path), "127.0.0.1:27100,127.0.0.1:27102,127.0.0.1:27104")
    settings = Settings.load({"RLPULSE_HOME": str(tmp_path)})
    assert settings.kafka_bootstrap == "127.0.0.1:27100,127.0.0.1:27102,127.0.0.1:27104"
    assert kafka_jvm.host_port(settings.kafka_bootstrap) == ("127.0.0.1", 27100)


def test_status_says_where_the_address_came_from(tmp_path: Path) -> None:
    record = tmp_path / "kafka" / "bootstrap"
    assert kafka_jvm.address_line(Settings(home=tmp_path)) == (
        "broker address: 127.0.0.1:9092 (no broker recorded in this home: --bootstrap, the environment, else the default)")
    kafka_jvm.record_address(Settings(home=tmp_path), "127.0.0.1:29092")
    assert kafka_jvm.address_line(Settings.load({"RLPULSE_HOME": str(tmp_path)})) == (
        f"broker address: 127.0.0.1:29092 (recorded in {record} by `rlpulse services up`)")
    assert kafka_jvm.address_line(Settings.load({"RLPULSE_HOME": str(tmp_path)}, kafka_bootstrap="h:1")) == (
        "broker address: h:1 (from --bootstrap or the environment; this home's broker was recorded at 127.0.0.1:29092)")


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
