"""The SQL of one page of ``rlpulse export``: which calls are the policy's, where rewards go, token ids.

A page reads every span of its trajectories (one run and attempt, the page's sequence range) once,
one row per ``span_id``, and ClickHouse builds the rows:

* **Policy calls.** An LLM span is a *grader call* when a REWARD or GRADER span is among its
  ancestors within the trajectory (a judge called by the reward function, seed 000's REWARD -> LLM),
  found by walking ``parent_span_id`` up to ``MAX_DEPTH`` spans. The others are the policy's turns.
  Grader calls are left out unless ``{graders}`` is 1, and then carry ``grader_call`` and no reward
  (agent-lightning's ``exclude_llm_call_in_reward``).
* **The final reward** of a trajectory: its ROLLOUT span's ``reward``, else its latest REWARD entry's,
  else its latest final reward annotation's (``emit_reward(final=True)``; seed 003's
  ``find_final_reward``). Its *position* is that annotation's, else that REWARD entry's start, else
  after every call.
* **Intermediate rewards**: ANNOTATION spans with a ``reward`` (``emit_reward``), placed by their
  ``sequence_id`` (start order) among the calls.
* **Placement** (``{reward_to}``): ``last-call`` gives each reward to the last policy call that started
  before it (several on one call: the final, else the latest), the others null, as agent-lightning's
  ``TracerTraceToTriplet`` does; ``final`` gives only the final reward, to the last policy call;
  ``every-call`` gives the final reward to every policy call. ``trajectory_reward`` is the final one.
* **Token ids** (``Tracer(token_ids=True)``): ``prompt_ids``, ``response_ids`` and ``response_logprobs``
  from ``rlpulse.*token_ids`` / ``rlpulse.response_logprobs``, with ``token_ids`` saying ``ok`` (both
  lists there, their lengths equal to the call's usage counts, one logprob per response id), ``absent``,
  ``cut`` (longer than the tracer's cap, not recorded) or ``mismatch`` (lengths disagree: the ids are
  not exported, since a training set cannot tell which side is wrong). Null (empty in Parquet) unless ok.
"""

from __future__ import annotations

from rlpulse.sinks.views.trajectories import SAMPLE_SQL

MAX_DEPTH = 64  # ancestors walked per call; deeper agent stacks are not known to exist
PLACEMENTS = ("last-call", "final", "every-call")
LAST = "18446744073709551615"  # after every call: the position of a reward that has none

_PAGE = """
    WITH page AS (
        SELECT rollout_id, kind, span_id, ifNull(parent_span_id, '') AS parent, sequence_id, start_time_ns, status,
               step, {sample} AS sample, reward,
               attributes['rlpulse.reward.final'] IN ('true', '1') AS reward_final,
               attributes['gen_ai.input.messages'] AS prompt_raw, attributes['gen_ai.output.messages'] AS output_raw,
               attributes['gen_ai.tool.definitions'] AS tools_raw,
               if(attributes['gen_ai.response.model'] != '', attributes['gen_ai.response.model'],
                  attributes['gen_ai.request.model']) AS model,
               toInt64OrNull(attributes['gen_ai.usage.input_tokens']) AS input_tokens,
               toInt64OrNull(attributes['gen_ai.usage.output_tokens']) AS output_tokens,
               toUInt64OrZero(attributes['rlpulse.content.cut_chars']) AS content_cut,
               attributes['gen_ai.response.finish_reasons'] AS finish_reason, attributes['gen_ai.response.id'] AS response_id,
               attributes['rlpulse.prompt_token_ids'] AS p_raw, attributes['rlpulse.response_token_ids'] AS r_raw,
               attributes['rlpulse.response_logprobs'] AS lp_raw, attributes['rlpulse.token_ids_cut'] != '' AS ids_cut
        FROM {{db}}.spans
        WHERE project = {{project:String}} AND run_id = {{run:String}} AND attempt = {{attempt:UInt32}}
          AND sequence_id BETWEEN {{lo:UInt64}} AND {{hi:UInt64}} AND has({{ids:Array(String)}}, rollout_id)
        ORDER BY span_id, sequence_id LIMIT 1 BY span_id),
    traj AS (
        SELECT rollout_id, mapFromArrays(groupArray(span_id), groupArray((parent, toString(kind)))) AS up,
               anyIf(step, kind = 'ROLLOUT') AS step, anyIf(sample, kind = 'ROLLOUT') AS sample_id,
               anyIf(status, kind = 'ROLLOUT') AS status,
               argMaxIf(reward, sequence_id, kind = 'REWARD' AND reward IS NOT NULL) AS entry_reward,
               maxIf(sequence_id, kind = 'REWARD' AND reward IS NOT NULL) AS entry_pos,
               argMaxIf(reward, sequence_id, kind = 'ANNOTATION' AND reward IS NOT NULL AND reward_final) AS final_note,
               maxIf(sequence_id, kind = 'ANNOTATION' AND reward IS NOT NULL AND reward_final) AS final_note_pos,
               coalesce(anyIf(reward, kind = 'ROLLOUT'), entry_reward, final_note) AS final_reward,
               if(final_note_pos > 0, final_note_pos, if(entry_pos > 0, entry_pos, {last})) AS final_pos,
               arrayConcat(
                   groupArrayIf((sequence_id, assumeNotNull(reward), 0),
                                kind = 'ANNOTATION' AND reward IS NOT NULL AND NOT reward_final),
                   if(final_reward IS NULL, [], [(final_pos, assumeNotNull(final_reward), 1)])) AS rewards
        FROM page GROUP BY rollout_id),
    walked AS (
        SELECT p.*, t.step AS t_step, t.sample_id AS t_sample, t.status AS t_status, t.final_reward AS final_reward,
               t.rewards AS rewards,
               arrayFold((acc, i) -> if(acc.2 OR acc.1 = '', acc,
                                        (t.up[acc.1].1, toBool(t.up[acc.1].2 IN ('REWARD', 'GRADER')))),
                         range({depth}), (p.parent, false)).2 AS grader_call
        FROM page AS p INNER JOIN traj AS t ON p.rollout_id = t.rollout_id
        WHERE p.kind = 'LLM' AND ({{graders:UInt8}} = 1 OR NOT grader_call)),
    ordered AS (
        SELECT *, leadInFrame(sequence_id, 1, {last}) OVER by_role AS next_seq,
               row_number() OVER by_role = count() OVER by_role AS last_of_role
        FROM walked
        WINDOW by_role AS (PARTITION BY rollout_id, grader_call ORDER BY sequence_id, start_time_ns, span_id
                           ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING)),
    calls AS (
        SELECT c.*, c.final_reward AS trajectory_reward,
               arrayFilter(r -> r.1 > c.sequence_id AND (r.1 < c.next_seq OR c.last_of_role), c.rewards) AS mine,
               if(c.grader_call, NULL, multiIf(
                   {{reward_to:String}} = 'every-call', c.final_reward,
                   {{reward_to:String}} = 'final', if(c.last_of_role, c.final_reward, NULL),
                   empty(mine), NULL,
                   toNullable(arraySort(r -> (r.3, r.1), mine)[-1].2))) AS placed,
               if(isValidJSON(c.output_raw) AND JSONType(c.output_raw) = 'Array', JSONExtractRaw(c.output_raw, 1),
                  c.output_raw) AS response_raw,
               toUInt32(row_number() OVER (PARTITION BY c.rollout_id ORDER BY c.sequence_id, c.start_time_ns, c.span_id)
                        - 1) AS turn,
               JSONExtract(c.p_raw, 'Array(Int64)') AS p_all, JSONExtract(c.r_raw, 'Array(Int64)') AS r_all,
               JSONExtract(c.lp_raw, 'Array(Float64)') AS lp_all,
               multiIf(c.ids_cut, 'cut', NOT (isValidJSON(c.p_raw) AND JSONType(c.p_raw) = 'Array' AND isValidJSON(c.r_raw)
                                              AND JSONType(c.r_raw) = 'Array'), 'absent',
                       (c.input_tokens IS NOT NULL AND length(p_all) != c.input_tokens)
                       OR (c.output_tokens IS NOT NULL AND length(r_all) != c.output_tokens)
                       OR (c.lp_raw != '' AND length(lp_all) != length(r_all)), 'mismatch', 'ok') AS token_ids,
               if(token_ids = 'ok', p_all, []) AS prompt_ids, if(token_ids = 'ok', r_all, []) AS response_ids,
               if(token_ids = 'ok', lp_all, []) AS response_logprobs
        FROM ordered AS c)
"""


def conversation(prompt: str, response: str) -> str:
    """A call's chat messages plus its reply as one JSON array (NULL when either is not JSON of that shape)."""
    return (f"if(isValidJSON({prompt}) AND JSONType({prompt}) = 'Array' AND isValidJSON({response}) "
            f"AND JSONType({response}) = 'Object', concat(substring(trimRight({prompt}), 1, length(trimRight({prompt})) - 1), "
            f"if(JSONLength({prompt}) = 0, '', ','), {response}, ']'), NULL)")


_CALL_COLUMNS = """{{project:String}} AS project, {{run:String}} AS run_id, {{attempt:UInt32}} AS attempt, c.t_step AS step,
           c.t_sample AS sample_id, c.rollout_id AS rollout_id, c.turn AS turn,
           toBool(c.last_of_role AND NOT c.grader_call) AS `final`,
           c.grader_call AS grader_call, c.span_id AS span_id, c.model AS model, nullIf(c.response_id, '') AS response_id,
           nullIf(c.finish_reason, '') AS finish_reason"""
_TOKEN_COLUMNS = """c.token_ids AS token_ids, c.prompt_ids AS prompt_ids, c.response_ids AS response_ids,
           c.response_logprobs AS response_logprobs"""
_ORDER = "ORDER BY indexOf({{ids:Array(String)}}, rollout_id), turn"

_TRIPLETS = _PAGE + f"""
    SELECT {_CALL_COLUMNS}, c.sequence_id AS sequence_id,
           nullIf(c.prompt_raw, '') AS prompt, nullIf(c.response_raw, '') AS response,
           c.placed AS reward, c.trajectory_reward AS trajectory_reward, c.t_status AS status, c.status AS call_status,
           c.input_tokens AS input_tokens, c.output_tokens AS output_tokens, c.content_cut AS content_cut, {_TOKEN_COLUMNS}
    FROM calls AS c
    {_ORDER}
"""

_PER_CALL = _PAGE + f"""
    SELECT {_CALL_COLUMNS}, c.placed AS reward, c.trajectory_reward AS trajectory_reward, c.t_status AS status,
           c.status AS call_status, {conversation('c.prompt_raw', 'c.response_raw')} AS messages,
           nullIf(c.tools_raw, '') AS tools, c.input_tokens AS input_tokens, c.output_tokens AS output_tokens,
           c.content_cut AS content_cut, {_TOKEN_COLUMNS}
    FROM calls AS c
    {_ORDER}
"""

# The conversation is the policy's, whatever --include-grader-calls says: a judge's prompt is no dialogue of it.
_MESSAGES = _PAGE + """
    , last AS (
        SELECT rollout_id, argMax(prompt_raw, turn) AS prompt, argMax(response_raw, turn) AS response,
               argMaxIf(tools_raw, turn, tools_raw != '') AS tools, count() AS calls, sum(content_cut) AS content_cut,
               sumOrNull(input_tokens) AS input_tokens, sumOrNull(output_tokens) AS output_tokens,
               any(t_step) AS step, any(t_sample) AS sample_id, any(final_reward) AS reward, any(t_status) AS status
        FROM calls WHERE NOT grader_call GROUP BY rollout_id)
    SELECT {{project:String}} AS project, {{run:String}} AS run_id, {{attempt:UInt32}} AS attempt, l.step AS step,
           l.sample_id AS sample_id, l.rollout_id AS rollout_id, l.reward AS reward, l.status AS status,
           """ + conversation("l.prompt", "l.response") + """ AS messages, nullIf(l.tools, '') AS tools, l.calls AS calls,
           l.input_tokens AS input_tokens, l.output_tokens AS output_tokens, l.content_cut AS content_cut
    FROM last AS l
    ORDER BY indexOf({{ids:Array(String)}}, rollout_id)
"""

_CALL = ("project", "run_id", "attempt", "step", "sample_id", "rollout_id", "turn", "final", "grader_call", "span_id",
         "model", "response_id", "finish_reason")
_TOKENS = ("token_ids", "prompt_ids", "response_ids", "response_logprobs")
COLUMNS = {
    "triplets": _CALL + ("sequence_id", "prompt", "response", "reward", "trajectory_reward", "status", "call_status",
                         "input_tokens", "output_tokens", "content_cut") + _TOKENS,
    "per-call": _CALL + ("reward", "trajectory_reward", "status", "call_status", "messages", "tools", "input_tokens",
                         "output_tokens", "content_cut") + _TOKENS,
    "messages": ("project", "run_id", "attempt", "step", "sample_id", "rollout_id", "reward", "status", "messages",
                 "tools", "calls", "input_tokens", "output_tokens", "content_cut"),
}
JSON_COLUMNS = ("prompt", "response", "messages", "tools")  # recorded JSON, kept as JSON (text in Parquet)
ARRAY_COLUMNS = ("prompt_ids", "response_ids", "response_logprobs")  # lists; null in JSONL when empty


def _json_or_text(expr: str) -> str:
    """A recorded JSON value as itself (its whitespace made one line), or, when it is not valid JSON (cut as
    text by the cap, or written by another writer), as a JSON string; null when nothing was recorded."""
    return (f"if({expr} = '', 'null', if(isValidJSON({expr}), replaceRegexpAll({expr}, '[\\\\r\\\\n\\\\t]', ' '), "
            f"toJSONString({expr})))")


def page_sql(what: str, fmt: str, database: str) -> str:
    """The query of one page of ``what`` (triplets, messages, or per-call messages) in ``fmt``; JSONL rows are
    one JSON object each, built in SQL."""
    body = {"triplets": _TRIPLETS, "messages": _MESSAGES, "per-call": _PER_CALL}[what]
    body = body.format(sample=SAMPLE_SQL, last=LAST, depth=MAX_DEPTH).replace("{db}", database)
    if fmt == "parquet":
        return body

    def value(c: str) -> str:
        if c in JSON_COLUMNS:
            return _json_or_text(f"ifNull(`{c}`, '')")
        if c in ARRAY_COLUMNS:
            return f"if(empty(`{c}`), 'null', toJSONString(`{c}`))"
        return f"ifNull(toJSONString(`{c}`), 'null')"

    parts = [f"'{'{' if i == 0 else ','}\"{c}\":', {value(c)}" for i, c in enumerate(COLUMNS[what])]
    return f"SELECT concat({', '.join(parts)}, '}}') AS line FROM ({body})"
