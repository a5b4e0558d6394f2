"""A job that traces with the plain OpenTelemetry API gets its span tree into ClickHouse."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Status, StatusCode

from rlpulse.producers import TrainingTelemetry
from rlpulse.pipeline import Pipeline, wait_groups_ready
from rlpulse.schemas.settings import Settings
from rlpulse.schemas.topics import ensure_topics
from rlpulse.sinks.clickhouse import open_store

pytestmark = pytest.mark.integration


def traced_job(settings: Settings) -> None:
    """Seed 000's tree: a ROLLOUT entry span with LLM and TOOL children, then a REWARD entry span."""
    with TrainingTelemetry(project="otel", run_id="tr", attempt=2, settings=settings) as tel:
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(tel.span_exporter()))
        tracer = provider.get_tracer("agent")
        with tracer.start_as_current_span("process", attributes={"rlpulse.kind": "ROLLOUT", "rlpulse.rollout_id": "ro-1", "rlpulse.step": 4}):
            with tracer.start_as_current_span("chat", attributes={"rlpulse.kind": "LLM", "gen_ai.usage.output_tokens": 57}):
                pass
            with tracer.start_as_current_span("tool:search", attributes={"rlpulse.kind": "TOOL"}) as tool:
                with tracer.start_as_current_span("http", attributes={"http.status": 503}) as http:
                    http.set_status(Status(StatusCode.ERROR, "upstream down"))
                tool.set_attribute("retried", True)
        with tracer.start_as_current_span("score", attributes={"rlpulse.kind": "REWARD", "rlpulse.rollout_id": "ro-1", "rlpulse.reward": 0.75}):
            with tracer.start_as_current_span("judge", attributes={"rlpulse.kind": "LLM"}):
                pass
        provider.shutdown()  # exports what the batch processor holds
        assert tel.flush(30) == 0


def test_span_tree_rebuilt_from_clickhouse(settings: Settings) -> None:
    ensure_topics(settings)
    with Pipeline(settings) as pipeline:
        pipeline.start(("sink",))
        wait_groups_ready(settings, (settings.sink_group,), pipeline)
        traced_job(settings)
        pipeline.wait_caught_up(0)
        pipeline.stop()
    with open_store(settings.clickhouse_dsn, owner="test") as store:
        db = store.database
        rows = store.client.query(f"""
            SELECT sequence_id, span_id, parent_span_id, name, kind, rollout_id, step, status, status_message,
                   reward, attributes, start_time_ns
            FROM {db}.spans FINAL WHERE run_id = 'tr' AND attempt = 2 ORDER BY sequence_id""").result_rows
    by_id = {r[1]: r for r in rows}

    def depth(row) -> int:
        return 0 if row[2] is None else 1 + depth(by_id[row[2]])

    tree = [(depth(r), r[3], r[4]) for r in rows]
    # sequence order is start order: the tree reads top-down like the code that made it
    assert tree == [(0, "process", "ROLLOUT"), (1, "chat", "LLM"), (1, "tool:search", "TOOL"), (2, "http", "CUSTOM"),
                    (0, "score", "REWARD"), (1, "judge", "LLM")]
    assert [r[0] for r in rows] == list(range(1, 7))  # strictly increasing from 1, no gaps
    assert [r[11] for r in rows] == sorted(r[11] for r in rows)
    assert {r[5] for r in rows} == {"ro-1"}  # children take their entry span's rollout id
    http, score = by_id[rows[3][1]], rows[4]
    assert (http[7], http[8], http[10]["http.status"]) == ("ERROR", "upstream down", "503")
    assert rows[0][6] == 4 and score[9] == 0.75 and by_id[rows[2][1]][10]["retried"] == "true"
