"""Local files are the owner's only: after a short pipeline run (streams and sink as children, the
SDK, the CLI reading the store) and a broker of the test's own started by ``rlpulse services up``,
no file or folder under either home is readable, writable or enterable by group or others: the
chDB store (chDB's own files included), its lock and endpoint files, the logs, Faust's datadir,
the broker's config, data, log and pid file. A home left by an older version (a 0755 store
folder, a 0644 lock file and log) is tightened."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from rlpulse.producers.simulators.simulator import SimConfig, simulate
from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.store.endpoint_file import ENDPOINT_FILE
from tests.integration import until

pytestmark = [pytest.mark.integration, pytest.mark.full]  # security, and a broker of its own: make test-all


def exposed(root: Path) -> list[str]:
    """Every file or folder under ``root`` (itself included) with a group or other permission bit,
    as 'mode path'. Symlinks are skipped: chDB links tables into its store, and a link's own mode
    means nothing."""
    found = []
    for folder, dirs, files in os.walk(root):
        for path in [Path(folder)] + [Path(folder) / name for name in dirs + files]:
            st = path.lstat()
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077 and (path == Path(folder) or not stat.S_ISDIR(st.st_mode)):
                found.append(f"{stat.S_IMODE(st.st_mode):04o} {path}")
    return sorted(set(found))


def test_files_under_the_homes_are_the_owners_only(settings: Settings, own_broker) -> None:
    if not settings.clickhouse_dsn.startswith("chdb://"):
        pytest.skip("the chDB store's files are the local backend's")
    home = settings.home
    store_dir = Path(urlsplit(settings.clickhouse_dsn).path)
    # what an older version left: a world-readable store folder, lock file and log
    store_dir.mkdir(mode=0o755)
    store_dir.chmod(0o755)
    (store_dir / "rlpulse.lock").write_text("pid 1 (old)")
    (store_dir / "rlpulse.lock").chmod(0o644)
    (home / "logs").mkdir(mode=0o755)
    (home / "logs").chmod(0o755)
    (home / "logs" / "sink.log").write_text("an older run\n")
    (home / "logs" / "sink.log").chmod(0o644)

    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        truth = simulate(settings, SimConfig(project="modes", runs=1, steps=2, rollouts_per_step=4, seed=5))
        pipeline.wait_caught_up(until=until.counts(settings, {"spans": truth.spans, "step_stats": 2}))
        pipeline.check_alive()
        assert stat.S_IMODE((store_dir / ENDPOINT_FILE).stat().st_mode) == 0o600
        assert exposed(home) == []  # while the sink holds the store
        pipeline.stop()
    env = {**settings_env(settings)}
    query = subprocess.run([sys.executable, "-m", "rlpulse.cli", "query", "SELECT count() AS n FROM rlpulse.spans FINAL",
                            "--format", "csv"], env=env, capture_output=True, text=True, timeout=120)
    assert query.returncode == 0 and query.stdout.split()[1] != "0", query.stderr  # the CLI opened the store itself

    broker_home = own_broker.settings.home
    assert (broker_home / "kafka" / "data" / "meta.properties").exists()
    assert (broker_home / "kafka" / "broker.pid").exists()
    offending = exposed(home) + exposed(broker_home)
    assert offending == [], "readable by group or others:\n" + "\n".join(offending)
    for path, mode in ((store_dir, 0o700), (store_dir / "rlpulse.lock", 0o600), (home / "logs", 0o700),
                       (home / "logs" / "sink.log", 0o600), (home / "faust", 0o700), (broker_home / "kafka", 0o700),
                       (broker_home / "kafka" / "broker.pid", 0o600), (broker_home / "kafka" / "broker.log", 0o600),
                       (broker_home / "kafka" / "data", 0o700)):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path
