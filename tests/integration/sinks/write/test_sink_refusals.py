"""ClickHouse refusing inserts, and SIGTERM while it does: nothing lost, the sink's part.

The refusal is a fault injected on purpose at the insert call, in the real insert path:
``RLPULSE_FAULTS="insert_error=252:4"`` makes the first 4 inserts raise the error the driver
raises for TOO_MANY_PARTS (see ``rlpulse.sinks.write.writer.InsertFault``). Everything else is real: the
broker, chDB, ``rlpulse sink`` as a child process. Each test checks: events sent = rows found
exactly; the dead-letter topic empty; the sink stayed in its group (one partition assignment in
its whole life, and consumption paused then resumed); offsets committed only once the insert
succeeded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from pathlib import Path

import pytest

from rlpulse.schemas.catalogue import TABLES
from rlpulse.base.faults import Faults
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.store.clickhouse import migrate, open_store
from rlpulse.sinks.write.sink import drain
# Siblings by their own names: pytest puts tests/integration on sys.path (no __init__.py there).
from tests.integration.sinks.write.test_sink_avro import CODEC, PROJECT, publish, span, step
from tests.integration.sinks.write.test_sink_faults import (dead_letter_count, offsets, plain_counts, start_sink,
                                                      stop_sink, wait_committed)

pytestmark = [pytest.mark.integration, pytest.mark.full]  # faults: make test-all


def send_workload(settings: Settings) -> dict[str, int]:
    """12 containers of spans and 6 of steps over three runs (both partitions); returns events sent per table."""
    ensure_topics(settings)
    sent = {"spans": 0, "steps": 0}
    for r in range(3):
        messages = [("spans", CODEC.encode("Span", [span(1000 * r + 20 * m + i, run_id=f"run{r}") for i in range(20)]))
                    for m in range(4)]
        messages += [("steps", CODEC.encode("Step", [step(1000 * r + 10 * m + i, run_id=f"run{r}") for i in range(10)]))
                     for m in range(2)]
        publish(settings, messages, key=f"{PROJECT}/run{r}")
        sent["spans"] += 80
        sent["steps"] += 20
    return sent


def expect_rows(settings: Settings, sent: dict[str, int]) -> None:
    """Rows found = events sent, per table, in a plain count() (no FINAL, no OPTIMIZE: nothing was doubled)."""
    found = plain_counts(settings)
    assert found == {t: sent.get(t, 0) for t in TABLES.values()}


def test_too_many_parts_pauses_consumption_and_commits_only_after_the_insert(settings: Settings, tmp_path: Path) -> None:
    sent = send_workload(settings)
    log = tmp_path / "sink.log"
    proc = start_sink(settings, log, env=Faults(insert_error="252:4").env())
    try:
        # Offsets first, then the log: a commit seen must come after the log line of the insert
        # that got through (the log is written before the commit is sent).
        failing_seen = commit_seen = 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            end, committed = offsets(settings)
            text = log.read_text()
            if any(committed.values()):
                commit_seen += 1
                assert "succeeded after 4 failed tries" in text, text
                if committed == end:
                    break
            elif "try 1 failed" in text:
                failing_seen += 1  # inserts failing, nothing committed
            assert proc.poll() is None, text
            time.sleep(0.2)
        # sampled both phases (0.2+0.4+0.8+1.6 s of refusals): once is proof, and a loaded machine
        # reads the offsets too slowly for more (make test-all saw 2 samples, not the 3 asked before)
        assert failing_seen >= 1 and commit_seen >= 1
        code, _ = stop_sink(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0
    expect_rows(settings, sent)
    assert dead_letter_count(settings) == 0
    text = log.read_text()
    # tries 1-3 are logged, then every 10th; the 4th is the last refused
    assert len(re.findall(r"TOO_MANY_PARTS \(code 252\).*try \d failed", text)) == 3 and "retried 4" in text
    assert "dead letter from" not in text
    # It stayed in its group: one assignment in its life, consumption paused once and resumed once.
    assert text.count("partitions assigned") == 1
    assert text.count("consumption paused on") == 1 and text.count("consumption resumed") == 1


@pytest.mark.parametrize("code", [241, 242, 164, 1000])
def test_an_outage_longer_than_max_poll_interval_keeps_the_group_and_dead_letters_nothing(
        settings: Settings, code: int) -> None:
    """MEMORY_LIMIT_EXCEEDED, TABLE_IS_READ_ONLY, READONLY and an error nobody classified (1000,
    POCO_EXCEPTION) are all retried: 4 refusals take 3 s, longer than this sink's max.poll.interval
    (2 s), so a sink that stopped polling while it retried would leave its group and be assigned
    its partitions again."""
    sent = send_workload(settings)
    settings = dataclasses.replace(settings, faults=Faults(insert_error=f"{code}:4"))
    with open_store(settings.clickhouse_dsn, owner="test sink") as store:
        migrate(store)
        stats, _ = asyncio.run(drain(settings, store, timeout=120, max_poll_interval_ms=2000))
    assert stats.retries == 4 and stats.pauses == 1 and stats.assignments == 1
    assert stats.dead_letters == 0 and stats.abandoned == 0 and stats.rows == sent
    expect_rows(settings, sent)
    assert dead_letter_count(settings) == 0


def test_sigterm_during_a_retry_stops_within_10s_and_commits_nothing(settings: Settings, tmp_path: Path) -> None:
    sent = send_workload(settings)
    log = tmp_path / "sink.log"
    proc = start_sink(settings, log, env=Faults(insert_error="252").env())  # every insert, for ever
    try:
        deadline = time.monotonic() + 120
        while "try 2 failed" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        code, took = stop_sink(proc, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 0 and took < 10.0, (code, took, text[-2000:])
    assert "checkpoint abandoned uncommitted" in text
    end, committed = offsets(settings)
    assert set(committed.values()) == {0} and sum(end.values()) == 18  # nothing committed: all of it is read again
    assert plain_counts(settings) == {t: 0 for t in TABLES.values()}

    proc = start_sink(settings, log)  # no fault: everything, once
    try:
        wait_committed(settings, proc, log)
        assert stop_sink(proc)[0] == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    expect_rows(settings, sent)
    assert dead_letter_count(settings) == 0
    print(f"SIGTERM during a retry: exit {code} in {took:.2f}s")


@pytest.mark.containers  # the containers backend only (make test-containers)
def test_a_server_that_stops_answering_pauses_the_sink_until_it_is_back(backend: dict, settings: Settings,
                                                                          tmp_path: Path) -> None:
    """The ClickHouse server container frozen (``docker pause``: it keeps its port and answers
    nothing, so the insert hangs rather than fails) for 30 s while the sink writes, then thawed:
    the sink pauses consumption once the checkpoint is slow, stays in its group, commits nothing
    until the insert is in, and every event lands once."""
    if backend["name"] != "containers":
        pytest.skip("needs the ClickHouse server container (the containers backend): chDB runs inside the sink")
    from urllib.parse import urlsplit

    import docker

    port = str(urlsplit(backend["clickhouse_url"]).port)
    [container] = [c for c in docker.from_env().containers.list()
                   if any(b.get("HostPort") == port for b in (c.ports.get("8123/tcp") or []))]
    ensure_topics(settings)
    log = tmp_path / "sink.log"
    proc = start_sink(settings, log)
    try:
        deadline = time.monotonic() + 120
        while "partitions assigned" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        container.pause()
        try:
            sent = send_workload(settings)
            time.sleep(30)
            assert proc.poll() is None, log.read_text()
            assert set(offsets(settings)[1].values()) == {0}
            assert "consumption paused" in log.read_text()
        finally:
            container.unpause()
        wait_committed(settings, proc, log, timeout=300)
        assert stop_sink(proc)[0] == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        for table in TABLES.values():
            store.client.command(f"OPTIMIZE TABLE {store.database}.{table} FINAL")
    expect_rows(settings, sent)
    assert dead_letter_count(settings) == 0
    assert log.read_text().count("partitions assigned") == 1
