"""The GenAI instrumentations users run, end to end: a real ``openai`` client auto-instrumented by
OpenInference's ``openinference-instrumentation-openai`` and by OpenLLMetry's
``opentelemetry-instrumentation-openai`` (in ``.venv-otel``, ``tests/otel_clients/instrumented_openai.py``)
calls the loopback OpenAI-compatible server; the real OpenTelemetry SDK exports over OTLP/HTTP to
``rlpulse otlp`` (the real command, on a free port); ``rlpulse otlp-ingest``, ``rlpulse streams`` and
``rlpulse sink`` carry the spans into ClickHouse.

Each instrumentation's job is one rollout (``--rollout-id``: the id on its resource, both calls under
one root span ``rollout`` of the job's own tracer, as an agent worker makes) with one plain chat
completion and one streamed one (``include_usage``). What the instrumentations emit is one span per
call and nothing else: OpenInference ``ChatCompletion`` (``openinference.span.kind`` LLM, usage in
``llm.token_count.*``, content in ``llm.input_messages.N.*`` / ``llm.output_messages.N.*`` and
``input.value`` / ``output.value``, the response id only inside ``output.value``), OpenLLMetry
``openai.chat`` (``gen_ai.operation.name`` chat, ``gen_ai.usage.*``, ``gen_ai.input.messages`` /
``gen_ai.output.messages`` as GenAI JSON with ``parts``, ``gen_ai.response.id``).

In ClickHouse each run holds exactly those two LLM spans and the ROLLOUT entry, with the ids the job
exported; each call's model, usage, prompt, reply, finish reason and response id are what the server
reported and the client received, each status as the job exported it (no error: OK, or UNSET for
OpenLLMetry's plain call); ``rlpulse export messages`` gives the rollout's conversation.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlpulse.base.settings import Settings
from rlpulse.pipeline import Pipeline, settings_env, wait_groups_ready
from rlpulse.producers.otlp.ingest import ingest_group
from rlpulse.schemas.topics import ensure_topics
from tests.conftest import unavailable
from tests.integration import until
from tests.openai_server import FakeOpenAI
from tests.integration.producers.otlp.test_otlp_receiver import start_receiver
from tests.otel_clients import otel_venv

pytestmark = [pytest.mark.integration, pytest.mark.full]

PROJECT = "otlp-instrumented"
INSTRUMENTATIONS = ("openinference", "openllmetry")
REPO = Path(__file__).resolve().parents[4]


def run_of(which: str) -> str:
    return f"instr-{which}"


@pytest.fixture(scope="module")
def otel_python() -> Path:
    try:
        return otel_venv.ensure(log=lambda line: print(f"otel venv: {line}", file=sys.stderr))
    except (otel_venv.VenvError, OSError) as exc:
        unavailable(f"the OpenTelemetry venv {otel_venv.VENV} could not be built "
                    f"(`python tests/otel_clients/otel_venv.py` builds it): {exc}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(settings: Settings, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlpulse.cli", *args], env={**settings_env(settings), "PYTHONPATH": str(REPO)},
                          cwd=REPO, capture_output=True, text=True, timeout=180)


SPANS_SQL = f"""
    SELECT run_id, rollout_id, name, toString(kind), status, trace_id, span_id, ifNull(parent_span_id, ''),
           finish_reason, completion_tokens, attributes
    FROM $db.spans FINAL WHERE project = '{PROJECT}' ORDER BY run_id, sequence_id"""


@pytest.fixture(scope="module")
def ran(module_settings: Settings, otel_python: Path) -> Iterator[dict[str, Any]]:
    settings = module_settings
    ensure_topics(settings)
    port = _free_port()
    pipeline = Pipeline(settings)
    receiver = None
    try:
        pipeline.start(("otlp-ingest", "streams", "sink"))
        wait_groups_ready(settings, (settings.app_id, settings.sink_group, ingest_group(settings)), pipeline)
        receiver = start_receiver(settings, "127.0.0.1", port)
        jobs: dict[str, dict[str, Any]] = {}
        with FakeOpenAI() as fake:
            for which in INSTRUMENTATIONS:
                done = subprocess.run([str(otel_python), str(otel_venv.INSTRUMENTED_OPENAI), "--instrumentation", which,
                                       "--base-url", fake.base_url, "--otlp", f"http://127.0.0.1:{port}",
                                       "--run-id", run_of(which), "--project", PROJECT, "--rollout-id", f"ro-{which}"],
                                      capture_output=True, text=True, timeout=180)
                assert done.returncode == 0, f"the {which} job failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
                jobs[which] = json.loads(done.stdout.strip().splitlines()[-1])
            requests, replies = list(fake.requests), [body for _, body in fake.replies]
        pipeline.wait_caught_up(until=until.counts(settings, {
            f"SELECT count() FROM $db.spans FINAL WHERE project = '{PROJECT}'": 3 * len(INSTRUMENTATIONS)}))
        pipeline.check_alive()
        rows = until.query(settings, SPANS_SQL)
        exports = {which: _cli(settings, "export", "messages", "-o", "-", "--run", run_of(which)) for which in INSTRUMENTATIONS}
        per_call = _cli(settings, "export", "messages", "-o", "-", "--project", PROJECT, "--per-call")
        yield {"jobs": jobs, "rows": rows, "requests": requests, "replies": replies, "exports": exports, "per_call": per_call}
    finally:
        if receiver is not None:
            receiver.terminate()
            receiver.wait(30)
        pipeline.stop()


def _spans(ran: dict[str, Any], which: str) -> list[dict[str, Any]]:
    keys = ("run_id", "rollout_id", "name", "kind", "status", "trace_id", "span_id", "parent_span_id", "finish_reason",
            "completion_tokens", "attributes")
    return [dict(zip(keys, row)) for row in ran["rows"] if row[0] == run_of(which)]


@pytest.mark.parametrize("which", INSTRUMENTATIONS)
def test_the_job_exported_two_call_spans_and_its_rollout(ran: dict[str, Any], which: str) -> None:
    job = ran["jobs"][which]
    assert job["exported"] == {"spans": 3, "failed": 0}
    name = {"openinference": "ChatCompletion", "openllmetry": "openai.chat"}[which]
    assert [s["name"] for s in job["spans"]] == [name, name, "rollout"]  # in the order they ended
    assert [c["usage"] is not None for c in job["calls"]] == [True, True]  # the streamed call's usage chunk came


@pytest.mark.parametrize("which", INSTRUMENTATIONS)
def test_exactly_the_exported_spans_land_two_llm_under_one_rollout(ran: dict[str, Any], which: str) -> None:
    job, spans = ran["jobs"][which], _spans(ran, which)
    [entry] = [s for s in job["spans"] if s["name"] == "rollout"]
    exported = sorted((s["trace_id"], s["span_id"], s["parent_span_id"] or "") for s in job["spans"])
    assert sorted((s["trace_id"].lower(), s["span_id"].lower(), s["parent_span_id"].lower()) for s in spans) == exported
    # OpenLLMetry 0.62.4 sets OK on the streamed call's span only and leaves the plain call's UNSET (no error,
    # as OpenTelemetry's instrumentation guidance has it); the status is kept as the job exported it
    statuses = {"openinference": ("OK", "OK"), "openllmetry": ("UNSET", "OK")}[which]
    assert [s["status"] for s in job["spans"]] == [*statuses, "UNSET"]
    assert [(s["kind"], s["name"], s["rollout_id"], s["status"]) for s in spans] == [
        ("ROLLOUT", "rollout", f"ro-{which}", "UNSET"),  # the job's own span, its status never set
        ("LLM", job["spans"][0]["name"], f"ro-{which}", statuses[0]),
        ("LLM", job["spans"][1]["name"], f"ro-{which}", statuses[1])]
    assert {s["parent_span_id"].lower() for s in spans[1:]} == {entry["span_id"]}


@pytest.mark.parametrize("which", INSTRUMENTATIONS)
def test_each_llm_span_carries_usage_content_and_ids(ran: dict[str, Any], which: str) -> None:
    job, llm = ran["jobs"][which], [s for s in _spans(ran, which) if s["kind"] == "LLM"]
    offset = INSTRUMENTATIONS.index(which) * 2  # the server's requests, both jobs' in order
    for i, (span, call) in enumerate(zip(llm, job["calls"], strict=True)):
        a, sent, reply = span["attributes"], ran["requests"][offset + i], ran["replies"][offset + i]
        assert call["stream"] is (i == 1) and sent.get("stream", False) is (i == 1)
        # the usage the server reported is what the client received, and what the span says
        assert {k: call["usage"][k] for k in ("prompt_tokens", "completion_tokens")} == \
            {k: reply["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
        assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"], span["completion_tokens"]) == \
            (str(call["usage"]["prompt_tokens"]), str(call["usage"]["completion_tokens"]), call["usage"]["completion_tokens"])
        assert json.loads(a["gen_ai.input.messages"]) == sent["messages"]
        assert json.loads(a["gen_ai.output.messages"]) == [{"role": "assistant", "content": call["content"]}]
        assert call["content"] == reply["choices"][0]["message"]["content"]
        assert (span["finish_reason"], a["gen_ai.response.finish_reasons"]) == (call["finish_reason"], "stop")
        assert a["gen_ai.response.id"] == call["id"] == reply["id"]
        assert a["gen_ai.operation.name"] == "chat"
        # the model as rlpulse export reads it: the response's, else the request's
        assert (a.get("gen_ai.response.model") or a["gen_ai.request.model"]) == call["model"] == "gpt-test-served"
        if which == "openllmetry":  # OpenInference's llm.model_name is the response's model; the request's is in
            assert a["gen_ai.request.model"] == "gpt-test"  # llm.invocation_parameters, kept as it came
        else:
            assert json.loads(a["llm.invocation_parameters"])["model"] == "gpt-test"
        # the conventions' own message keys are folded into rlpulse's, not kept twice
        assert not [k for k in a if k.startswith(("llm.input_messages.", "llm.output_messages.")) or k in
                    ("input.value", "output.value")]


@pytest.mark.parametrize("which", INSTRUMENTATIONS)
def test_export_messages_gives_the_rollouts_conversation(ran: dict[str, Any], which: str) -> None:
    done = ran["exports"][which]
    assert done.returncode == 0, done.stderr
    [row] = [json.loads(line) for line in done.stdout.splitlines()]
    last = ran["jobs"][which]["calls"][1]  # a messages row: the last policy call's messages and its reply
    assert (row["rollout_id"], row["calls"], row["status"]) == (f"ro-{which}", 2, "UNSET")
    assert row["messages"] == [{"role": "user", "content": "Stream a short answer."},
                               {"role": "assistant", "content": last["content"]}]


def test_export_per_call_gives_every_call(ran: dict[str, Any]) -> None:
    done = ran["per_call"]
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    expected = []
    for which in INSTRUMENTATIONS:
        for prompt, call in zip(("What is 6 times 7?", "Stream a short answer."), ran["jobs"][which]["calls"], strict=True):
            expected.append((run_of(which), f"ro-{which}", [{"role": "user", "content": prompt},
                                                             {"role": "assistant", "content": call["content"]}]))
    assert [(r["run_id"], r["rollout_id"], r["messages"]) for r in rows] == expected
