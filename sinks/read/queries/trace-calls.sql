-- A run's traced LLM and TOOL calls per step and model or tool: calls, errors, latency, tokens.
-- Params (required): run_id: String.
-- From the spans rlpulse.producers.tracing publishes (OpenTelemetry GenAI attributes): an LLM span is
-- named by its response's model (else the request's), a TOOL span by gen_ai.tool.name. Latency is
-- the span's duration; tool_calls_asked counts the tool calls the model's replies asked for.
-- Dedup: no FINAL. One row per span_id (LIMIT 1 BY span_id) before aggregating.
SELECT
    project,
    attempt,
    step,
    kind,
    model_or_tool,
    count() AS calls,
    countIf(status = 'ERROR') AS errors,
    round(quantile(0.5)(duration_ms), 3) AS p50_ms,
    round(quantile(0.9)(duration_ms), 3) AS p90_ms,
    sum(input_tokens) AS input_tokens,
    sum(output_tokens) AS output_tokens,
    sum(tool_calls) AS tool_calls_asked
FROM
(
    SELECT
        project, attempt, step, kind, status,
        multiIf(kind = 'TOOL', attributes['gen_ai.tool.name'], attributes['gen_ai.response.model'] != '',
                attributes['gen_ai.response.model'], attributes['gen_ai.request.model']) AS model_or_tool,
        (end_time_ns - start_time_ns) / 1e6 AS duration_ms,
        toInt64OrZero(attributes['gen_ai.usage.input_tokens']) AS input_tokens,
        toInt64OrZero(attributes['gen_ai.usage.output_tokens']) AS output_tokens,
        toInt64OrZero(attributes['rlpulse.tool_calls']) AS tool_calls
    FROM {db}.spans
    WHERE run_id = {run_id:String} AND kind IN ('LLM', 'TOOL')
    ORDER BY span_id, sequence_id
    LIMIT 1 BY span_id
)
GROUP BY project, attempt, step, kind, model_or_tool
ORDER BY project, attempt, step, kind, model_or_tool
