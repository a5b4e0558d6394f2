"""The runs bench/ui_bench.py times ``rlpulse ui`` on: each of 1,000 steps x 512 rollouts, written into a chDB store.

:func:`load` writes one run with ``INSERT ... SELECT`` from ``numbers()`` (ClickHouse makes the
rows, so a run of 1.5 million spans takes seconds, not the pipeline's minutes):

- per rollout a ROLLOUT span (reward, sample of 8, completion tokens, clipped, and its rollout and
  reward metrics ``turns``, ``tool_calls``, ``accuracy``) and two GRADER spans (judge, format; about
  1 in 10 failed);
- for the first 8 rollouts of each step three child spans (LLM, TOOL, LLM), the LLM ones with their
  dialogue (``gen_ai.input.messages`` / ``gen_ai.output.messages``, about 1.5 KB); the user message
  of one in 8 of them holds :data:`QUERY_WORD`, what the text search looks for;
- the STEP events with trainer metrics, a RUN_START with the run's configuration (30 keys, 3 of them
  differing from run to run), step stats, per-term step figures (judge and format), reward and
  completion length histograms, and a few alerts.

Each run differs a little from the others (``variant``): its reward, loss and kl curves are offset,
its steps are further apart, so runs overlaid on the compare page are told apart.
"""

from __future__ import annotations

import time

from rlpulse.sinks.store.clickhouse import Store

PROJECT, RUN_PREFIX = "bench", "ui-bench"
RUN = f"{RUN_PREFIX}-0"  # the run the single-run pages and the search read
STEPS, ROLLOUTS, PER_SAMPLE = 1000, 512, 8
CONTENT_ROLLOUTS = 8  # per step, the rollouts traced with LLM and TOOL spans and their dialogue
QUERY_WORD = "heliotrope"  # in the prompt of one traced rollout in 8 (1,000 trajectories of a full run)
NS = 1_000_000_000

# 32 common words the dialogues are drawn from (hashed per span, so the content compresses as text does)
VOCAB = ("the answer is step by check first then value total so we find number tool call result given "
         "sum product divide search query return final because each part left right").split()
# 27 settings every run shares and 3 that differ: the compare page's "configuration that differs"
SHARED_CONFIG = {
    **{f"trainer.{k}": v for k, v in (("algorithm", "grpo"), ("epochs", "1"), ("batch_size", "512"),
                                       ("mini_batch_size", "64"), ("gradient_accumulation", "8"), ("max_steps", "1000"),
                                       ("warmup_steps", "20"), ("weight_decay", "0.0"), ("clip_ratio", "0.2"),
                                       ("kl_coef", "0.001"), ("entropy_coef", "0.0"), ("bf16", "true"),
                                       ("gradient_checkpointing", "true"), ("save_steps", "100"))},
    **{f"rollout.{k}": v for k, v in (("n", "8"), ("max_tokens", "1024"), ("top_p", "1.0"), ("engine", "vllm"),
                                       ("tensor_parallel", "2"), ("gpu_memory_utilization", "0.85"))},
    **{f"model.{k}": v for k, v in (("name", "bench-policy-7b"), ("dtype", "bfloat16"), ("max_length", "4096"))},
    **{f"reward.{k}": v for k, v in (("terms", "judge,format"), ("judge_model", "bench-judge"), ("format_weight", "0.2"),
                                      ("judge_weight", "0.8"))},
}


def run_id(variant: int) -> str:
    return f"{RUN_PREFIX}-{variant}"


def config(variant: int) -> dict[str, str]:
    """The run's 30 settings: the shared 27 and a learning rate, seed and temperature of its own."""
    return {**SHARED_CONFIG, "optimizer.learning_rate": f"{(variant + 1) * 1e-6:g}", "seed": str(variant),
            "rollout.temperature": f"{0.6 + 0.05 * variant:.2f}"}


def _words(seed: str, n: int) -> str:
    return f"arrayStringConcat(arrayMap(j -> {list(VOCAB)}[1 + cityHash64(number, '{seed}', j) % {len(VOCAB)}], range({n})), ' ')"


def load(store: Store, steps: int = STEPS, rollouts: int = ROLLOUTS, run: str = RUN, variant: int = 0,
         spans: bool = True) -> int:
    """Write run ``run`` (figures offset by ``variant``), without ``spans`` its per-step tables only; the spans written."""
    db, n, c = store.database, steps * rollouts, store.client
    period = 10 * NS + variant * NS // 2  # a step every 10 to 13.5 s, the run ending `variant` minutes ago
    t0 = time.time_ns() - variant * 60 * NS - steps * period
    ident = f"'{PROJECT}' AS project, '{run}' AS run_id, toUInt32(1) AS attempt"
    if spans:
        _spans(store, n, rollouts, t0, period, ident, variant)
    step_t = f"{t0} + number * {period} + {period - NS}"
    # the loss falls, the kl and the reward rise; each run's curve a little above the one before
    loss = f"{1 + variant / 10} / (number + 1) + {variant / 100}"
    kl = f"number / 10000 * {1 + variant / 10}"
    reward_mean = f"0.45 + 0.1 * number / {steps} + {variant / 100} + 0.02 * sin(number / 25)"
    c.command(f"""INSERT INTO {db}.steps (project, run_id, attempt, stage, time_ns, type, trainer, step, step_count, tokens,
        duration_s, throughput, writer_id, sequence_id, metrics)
        SELECT {ident}, 'train' AS stage, {step_t}, 'STEP', 'rl', number, number + 1, 100000, {period / NS},
               {100000 / (period / NS)}, 'w', number + 1, map('loss', {loss}, 'kl', {kl}, 'grad_norm', 1 + (number % 7) / 10)
        FROM numbers({steps})""")
    settings = ", ".join(f"'{k}', '{v}'" for k, v in config(variant).items())
    c.command(f"""INSERT INTO {db}.steps (project, run_id, attempt, stage, time_ns, type, trainer, step, step_count, tokens,
        duration_s, throughput, writer_id, sequence_id, config) VALUES
        ('{PROJECT}', '{run}', 1, 'train', {t0 - NS}, 'RUN_START', 'rl', -1, 0, 0, 0, 0, 'w', 0, map({settings}))""")
    bounds = "[0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1, 2, 5]"
    c.command(f"""INSERT INTO {db}.step_stats (project, run_id, attempt, step, rollouts, clipped, clipped_ratio, reward_mean,
        reward_std, reward_min, reward_max, reward_zero_fraction, completion_mean, completion_min, completion_max, samples,
        samples_same_reward, zero_std_fraction, sample_reward_spread_mean, complete, emitted_at_ns, staleness_max,
        staleness_mean)
        SELECT {ident}, number, {rollouts}, 25, 25 / {rollouts}, {reward_mean}, 0.29, 0, 1, 0.01, 500, 50, 1049,
               {rollouts // PER_SAMPLE}, 0, 0.0, 0.25, true, {step_t}, 1, 1.0 FROM numbers({steps})""")
    # seed 001's per-term figures: the judge takes about a second and spends tokens, the format check neither
    c.command(f"""INSERT INTO {db}.step_term_stats (project, run_id, attempt, step, term, rollouts, share_mean, share_std,
        share_zero_fraction, graded, failures, failure_rate, failure_cost, duration_p50_s, duration_p90_s, duration_p99_s,
        duration_max_s, judge_input_tokens, judge_output_tokens, emitted_at_ns)
        SELECT {ident}, number, term, {rollouts}, if(judge, 0.8, 0.2) * ({reward_mean}), 0.2, 0.05, {rollouts},
               toUInt64(cityHash64(number, term) % {max(1, rollouts // 5)}) AS failed, failed / {rollouts},
               if(judge, toNullable(0.02 * failed), NULL), if(judge, 0.7, 0.01), if(judge, 1.2, 0.02),
               if(judge, 2.0, 0.05), if(judge, 3.1 + {variant / 10}, 0.08), if(judge, {rollouts * 600}, 0),
               if(judge, {rollouts * 80}, 0), {step_t}
        FROM numbers({steps}) ARRAY JOIN ['judge', 'format'] AS term, [true, false] AS judge""")
    c.command(f"""INSERT INTO {db}.reward_histograms (project, run_id, attempt, step, term, bounds, bucket_counts, count, sum,
        min, max, zero_fraction, emitted_at_ns)
        SELECT {ident}, number, 'total', {bounds},
               [5, 51, 51, 51, 52, 51, 51, 51, 51, 46, 52, 0, 0, 0, 0], {rollouts}, 256.0, 0, 1, 0.01, {step_t}
        FROM numbers({steps})""")
    c.command(f"""INSERT INTO {db}.completion_length_histograms (project, run_id, attempt, step, scale, zero_count, offset,
        bucket_counts, count, sum, min, max, emitted_at_ns)
        SELECT {ident}, number, 0, 0, 5, [12, 25, 50, 100, 200, 125], {rollouts}, 256000, 50, 1049, {step_t}
        FROM numbers({steps})""")
    c.command(f"""INSERT INTO {db}.alerts (rule, state, key, severity, summary, value, threshold, project, run_id, attempt,
        time_ns, first_seen_ns, last_seen_ns)
        SELECT 'grader_failure_rate', if(number % 2 = 0, 'FIRING', 'RESOLVED'), '{PROJECT}/{run}/1/judge', 'warning',
               'judge failure rate over threshold', 0.3, 0.2, '{PROJECT}', '{run}', 1,
               {t0} + number * {500 * NS}, {t0} + intDiv(number, 2) * {1000 * NS}, {t0} + number * {500 * NS}
        FROM numbers(20)""")
    return n * 3 + min(rollouts, CONTENT_ROLLOUTS) * steps * 3 if spans else 0


def _spans(store: Store, n: int, rollouts: int, t0: int, period: int, ident: str, variant: int) -> None:
    db, c = store.database, store.client
    step_of, i_of = f"intDiv(number, {rollouts})", f"number % {rollouts}"
    rollout_id = f"concat('s', toString({step_of}), '-r', toString({i_of}))"
    common = (f"{ident}, 'train' AS stage, lower(hex(number)) AS trace_id, toNullable({step_of}) AS step, 'w' AS writer_id, "
              f"{rollout_id} AS rollout_id")
    # uniform over [0, 1), shifted up as the run goes on and by the run's variant
    reward = (f"round(least(1.0, (cityHash64(number, 'reward') % 1000) / 1000 * 0.85 + 0.1 * {step_of} / {n // rollouts}"
              f" + {variant / 100}), 3)")
    when = f"{t0} + {step_of} * {period} + ({i_of}) * 1000000"
    c.command(f"""INSERT INTO {db}.spans (project, run_id, attempt, stage, trace_id, step, writer_id, rollout_id, span_id,
        parent_span_id, name, kind, start_time_ns, end_time_ns, status, status_message, sequence_id, attributes, reward,
        completion_tokens, max_tokens, clipped, sample_id, finish_reason, policy_version, metrics)
        SELECT {common}, concat('r', toString(number)), NULL, 'rollout', 'ROLLOUT', {when}, {when} + 900000, 'OK', '',
               number * 8, map(), {reward} AS r, toInt64(50 + cityHash64(number, 'len') % 1000), 1024,
               cityHash64(number, 'len') % 1000 > 950,
               concat('p', toString({step_of}), '-', toString(intDiv({i_of}, {PER_SAMPLE}))),
               if(cityHash64(number, 'len') % 1000 > 950, 'length', 'stop'), toNullable(toInt64({step_of}) - 1),
               map('turns', toFloat64(1 + cityHash64(number, 'turns') % 5),
                   'tool_calls', toFloat64(cityHash64(number, 'turns') % 4), 'accuracy', toFloat64(r > 0.5))
        FROM numbers({n})""")
    outcome = "multiIf(cityHash64(number, term) % 20 = 0, 'timeout', cityHash64(number, term) % 20 = 1, 'error', 'ok')"
    c.command(f"""INSERT INTO {db}.spans (project, run_id, attempt, stage, trace_id, step, writer_id, rollout_id, span_id,
        parent_span_id, name, kind, start_time_ns, end_time_ns, status, status_message, sequence_id, attributes, term,
        outcome, score)
        SELECT {common}, concat('g', toString(number), term), concat('r', toString(number)), concat('grader ', term),
               'GRADER', {when} + 100000, {when} + 800000, if({outcome} = 'ok', 'OK', 'ERROR'), '',
               number * 8 + if(term = 'judge', 1, 2), map(), term, {outcome},
               if({outcome} = 'ok', toNullable(round((cityHash64(number, term) % 100) / 100, 2)), NULL)
        FROM numbers({n}) ARRAY JOIN ['judge', 'format'] AS term""")
    # the dialogue of a traced rollout: turn 1 asks (one prompt in 8 names QUERY_WORD), the tool answers, turn 2 answers
    ask = (f"concat('[{{\"role\":\"system\",\"content\":\"You are a careful assistant. Use the search tool when unsure.\"}},"
           f"{{\"role\":\"user\",\"content\":\"Task ', toString(number), ': ', "
           f"if(cityHash64(number, 'query') % 8 = 0, '{QUERY_WORD} ', ''), {_words('ask', 80)}, '\"}}]')")
    say = f"concat('[{{\"role\":\"assistant\",\"content\":\"', {_words('say', 120)}, '\"}}]')"
    llm = (f"map('gen_ai.request.model', 'bench-policy', 'gen_ai.usage.output_tokens', '100', "
           f"'gen_ai.input.messages', {ask}, 'gen_ai.output.messages', {say})")
    tool = "map('gen_ai.tool.name', 'search', 'gen_ai.tool.call.result', 'three results')"
    c.command(f"""INSERT INTO {db}.spans (project, run_id, attempt, stage, trace_id, step, writer_id, rollout_id, span_id,
        parent_span_id, name, kind, start_time_ns, end_time_ns, status, status_message, sequence_id, attributes)
        SELECT {common}, concat('c', toString(number), '-', toString(k)), concat('r', toString(number)),
               ['turn 1', 'search', 'turn 2'][k + 1], ['LLM', 'TOOL', 'LLM'][k + 1], {when} + k * 200000,
               {when} + (k + 1) * 200000, 'OK', '', number * 8 + 3 + k, if(k = 1, {tool}, {llm})
        FROM numbers({n}) ARRAY JOIN [0, 1, 2] AS k WHERE {i_of} < {CONTENT_ROLLOUTS}""")


def settle(store: Store, timeout_s: float = 300.0) -> None:
    """Wait until ClickHouse has merged what the load wrote: a page timed while background merges of
    millions of fresh rows take the cores measures the merges, not the page (a store the sink filled
    over hours has long merged its parts)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not store.client.query(f"SELECT count() FROM system.merges WHERE database = '{store.database}'").result_rows[0][0]:
            return
        time.sleep(0.5)
