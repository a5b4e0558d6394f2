"""A run's configuration, from ``TrainingTelemetry(config=...)`` through the real broker, ``rlpulse
streams`` and ``rlpulse sink`` into ``steps.config``, read back by the saved query ``run-config``:

* the settings flattened to dotted names, values as text (lists as JSON, NaN as ``nan``), a
  secret-looking key as ``***``: exactly one row per setting;
* per attempt: a second attempt with other settings has its own rows;
* ``set_config`` on a started object (as an integration handed one does): the settings go out on a
  second RUN_START stamped with the first one's time, ``run-config`` reads them, and the run's step
  count, its step boundaries and its alerts are as without it;
* a run with no settings has no rows.
"""

from __future__ import annotations

import pytest

from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.producers import TrainingTelemetry
from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.read.queries import run_query, saved_sql
from rlpulse.sinks.store.clickhouse import open_reader
from tests.integration import until

pytestmark = [pytest.mark.integration, pytest.mark.full]

CONFIG = {"optim": {"lr": 1e-5, "betas": [0.9, 0.99]}, "num_generations": 8, "use_vllm": True, "kl_coef": float("nan"),
          "hub_token": "hf_secret", "model": "Qwen/Qwen2.5-0.5B", "scheduler": None}
EXPECTED = [("hub_token", "***"), ("kl_coef", "nan"), ("model", "Qwen/Qwen2.5-0.5B"), ("num_generations", "8"),
            ("optim.betas", "[0.9,0.99]"), ("optim.lr", "1e-05"), ("scheduler", "null"), ("use_vllm", "true")]


def publish(settings: Settings) -> None:
    with TrainingTelemetry(project="rc", run_id="cfg", settings=settings, config=CONFIG) as tel:
        tel.step_completed(0)
    with TrainingTelemetry(project="rc", run_id="cfg", attempt=2, settings=settings, config={"optim": {"lr": 2e-5}}) as tel:
        tel.step_completed(0)
    with TrainingTelemetry(project="rc", run_id="late", settings=settings) as tel:
        tel.step_completed(0)
        tel.step_completed(1)
        assert tel.set_config({"seed": 7, "learning_rate": 3e-6}) == {"learning_rate": "3e-06", "seed": "7"}
        tel.step_completed(2)
    with TrainingTelemetry(project="rc", run_id="none", settings=settings) as tel:
        tel.step_completed(0)


@pytest.fixture(scope="module")
def ran(module_settings: Settings) -> Settings:
    settings = module_settings
    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start()
        wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
        publish(settings)
        pipeline.wait_caught_up(until=until.counts(settings, {
            "SELECT count() FROM $db.steps FINAL WHERE project = 'rc' AND type = 'RUN_END'": 4,
            "SELECT count() FROM $db.steps FINAL WHERE project = 'rc' AND type = 'RUN_START'": 5}))
        pipeline.stop()
    return settings


def run_config(settings: Settings, run_id: str) -> list[tuple]:
    store = open_reader(settings.clickhouse_dsn, owner="test")
    try:
        columns, rows = run_query(store.client, saved_sql("run-config", {"run_id": run_id}, store.database),
                                  {"run_id": run_id})
    finally:
        store.close()
    assert columns == ["project", "run_id", "attempt", "key", "value"]
    return rows


def test_a_runs_settings_are_one_row_each_per_attempt(ran: Settings) -> None:
    assert run_config(ran, "cfg") == [("rc", "cfg", 1, k, v) for k, v in EXPECTED] + [("rc", "cfg", 2, "optim.lr", "2e-05")]


def test_settings_given_to_a_started_run_ride_a_second_run_start_that_changes_nothing_else(ran: Settings) -> None:
    assert run_config(ran, "late") == [("rc", "late", 1, "learning_rate", "3e-06"), ("rc", "late", 1, "seed", "7")]
    starts = until.query(ran, "SELECT time_ns, step_count, length(config) FROM $db.steps FINAL "
                              "WHERE run_id = 'late' AND type = 'RUN_START' ORDER BY sequence_id")
    assert starts is not None and len(starts) == 2
    assert starts[0][0] == starts[1][0] and [(s[1], s[2]) for s in starts] == [(0, 0), (2, 2)]
    ends = until.query(ran, "SELECT step_count FROM $db.steps FINAL WHERE run_id = 'late' AND type = 'RUN_END'")
    assert ends == [(3,)]
    assert until.query(ran, "SELECT count() FROM $db.alerts FINAL WHERE run_id = 'late'") == [(0,)]


def test_a_run_without_settings_has_no_rows(ran: Settings) -> None:
    assert run_config(ran, "none") == []
    # its RUN_START's config is the empty map (the Avro default), as on every other event
    got = until.query(ran, "SELECT type, length(config) FROM $db.steps FINAL WHERE run_id = 'none' "
                            "AND type != 'HEARTBEAT' ORDER BY sequence_id")
    assert got == [("RUN_START", 0), ("STEP", 0), ("RUN_END", 0)]
