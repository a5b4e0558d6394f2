"""A real ``openai.OpenAI`` client instrumented by a GenAI instrumentation users run, exporting its
spans over OTLP/HTTP with the real OpenTelemetry SDK, and nothing of rlpulse. Runs in
``.venv-otel`` (tests/otel_clients/otel_venv.py) against the loopback server of
``tests/openai_server.py`` (``FakeOpenAI().base_url``), which a test starts.

    python instrumented_openai.py --instrumentation openinference|openllmetry \
        --base-url http://127.0.0.1:PORT/v1 --otlp http://127.0.0.1:4318 --run-id r1

* ``openinference``: Arize's ``openinference.instrumentation.openai.OpenAIInstrumentor``
  (``llm.*`` / ``openinference.span.kind`` attributes; input and output captured by default);
* ``openllmetry``: traceloop's ``opentelemetry.instrumentation.openai.OpenAIInstrumentor``
  (``gen_ai.*`` attributes; content captured because ``TRACELOOP_TRACE_CONTENT=true``, set here).

It makes one chat completion and one streamed chat completion (``stream_options.include_usage``,
so the last chunk carries the usage), exports each span as it ends (SimpleSpanProcessor), shuts
down, and prints ONE JSON line: the calls (response id, model, content, usage, streamed or not), the
resource attributes, and every span the exporter sent (ids, parent, name, status, attributes).

``--rollout-id ID``: the process is one rollout, as an agent worker's is: the id goes on the resource
(``akka.optimize.training.rl.rollout.id``: each span is exported alone, so a span's own attribute would not
reach its children) and both calls run under one root span ``rollout`` of the job's own tracer, the
rollout's entry that ``rlpulse export`` needs (the instrumentations' spans are LLM spans only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

P = "akka.optimize.training."


def _instrument(which: str, provider: Any) -> None:
    if which == "openinference":
        from openinference.instrumentation.openai import OpenAIInstrumentor as OpenInference

        OpenInference().instrument(tracer_provider=provider)
    else:
        # read when each span is made; "true" is its default, set so an environment's "false" cannot hide content
        os.environ["TRACELOOP_TRACE_CONTENT"] = "true"
        from opentelemetry.instrumentation.openai import OpenAIInstrumentor as OpenLLMetry

        OpenLLMetry().instrument(tracer_provider=provider)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instrumentation", choices=("openinference", "openllmetry"), required=True)
    parser.add_argument("--base-url", required=True, help="the OpenAI-compatible server's base URL, ending /v1")
    parser.add_argument("--otlp", required=True, help="the OTLP/HTTP base URL (/v1/traces is added)")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--attempt", type=int, default=1)
    parser.add_argument("--project", default="agents")
    parser.add_argument("--model", default="gpt-test")
    parser.add_argument("--api-key", default="sk-test-key")
    parser.add_argument("--rollout-id", help="run both calls as one rollout with this id, under a root span")
    args = parser.parse_args(argv)

    import openai
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult

    sent: list[Any] = []
    failed = 0

    class Counting(OTLPSpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            nonlocal failed
            result = super().export(spans)
            sent.extend(spans)
            failed += result is not SpanExportResult.SUCCESS
            return result

    resource = Resource.create({
        "service.name": f"agent-{args.instrumentation}", "service.instance.id": f"{args.instrumentation}-{args.run_id}",
        P + "run.id": args.run_id, P + "run.attempt": args.attempt, P + "project": args.project,
        **({P + "rl.rollout.id": args.rollout_id} if args.rollout_id else {}),
    })
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(Counting(endpoint=f"{args.otlp.rstrip('/')}/v1/traces")))
    _instrument(args.instrumentation, provider)

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=30)
    entry = provider.get_tracer("agent").start_as_current_span("rollout") if args.rollout_id else contextlib.nullcontext()
    with entry:
        calls = _calls(client, args.model)
    provider.shutdown()  # the streamed call's span ends when its stream is read to the end; all are exported now

    spans = [{"trace_id": f"{s.context.trace_id:032x}", "span_id": f"{s.context.span_id:016x}",
              "parent_span_id": f"{s.parent.span_id:016x}" if s.parent else None, "name": s.name,
              "status": s.status.status_code.name,
              "attributes": {k: _plain(v) for k, v in (s.attributes or {}).items()}} for s in sent]
    print(json.dumps({"instrumentation": args.instrumentation, "run_id": args.run_id,
                      "resource": {k: _plain(v) for k, v in resource.attributes.items()},
                      "calls": calls, "spans": spans, "exported": {"spans": len(sent), "failed": failed}}))
    return 1 if failed else 0


def _calls(client: Any, model: str) -> list[dict[str, Any]]:
    """One chat completion and one streamed one; what the client received of each."""
    calls: list[dict[str, Any]] = []
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 6 times 7?"}])
    calls.append({"stream": False, "id": reply.id, "model": reply.model, "content": reply.choices[0].message.content,
                  "finish_reason": reply.choices[0].finish_reason, "usage": reply.usage.model_dump() if reply.usage else None})
    pieces, usage, response_id, served, finish = [], None, None, None, None
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Stream a short answer."}],
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        response_id, served = chunk.id, chunk.model
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    calls.append({"stream": True, "id": response_id, "model": served, "content": "".join(pieces),
                  "finish_reason": finish, "usage": usage})
    return calls


if __name__ == "__main__":
    sys.exit(main())
