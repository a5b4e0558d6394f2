-- Content kept out of ClickHouse for one run, per step: trajectories and spans capped, characters cut.
-- Params (required): run_id: String.
-- From the spans (deduplicated with FINAL); every figure of the streams still counts every event.
-- trajectories: distinct rollout_id of the step; trajectories_capped and spans_capped: past the cap
-- of full trajectories per step (RLPULSE_SPAN_CAP), stored without their content (content_capped = 1);
-- sink_cut_chars: characters of attribute values the sink removed (capped spans' content, values over
-- RLPULSE_SINK_CONTENT_MAX_CHARS); sdk_cut_chars: characters the SDK cut before sending (its own cap,
-- the attribute rlpulse.content.cut_chars, kept in content_sdk_cut_chars). Steps where nothing was dropped
-- have no row.
SELECT
    project,
    run_id,
    attempt,
    step,
    uniqExact(rollout_id) AS trajectories,
    uniqExactIf(rollout_id, content_capped = 1) AS trajectories_capped,
    count() AS spans,
    countIf(content_capped = 1) AS spans_capped,
    sum(content_cut_chars) AS sink_cut_chars,
    sum(content_sdk_cut_chars) AS sdk_cut_chars
FROM {db}.spans FINAL
WHERE run_id = {run_id:String}
GROUP BY project, run_id, attempt, step
HAVING spans_capped > 0 OR sink_cut_chars > 0 OR sdk_cut_chars > 0
ORDER BY project, attempt, step
