"""How fast ``rlpulse ui`` answers for a large run: 1,000 steps x 512 rollouts (target: each page within 1 s).

:func:`load` writes one run into a fresh chDB store with ``INSERT ... SELECT`` from ``numbers()``
(ClickHouse makes the rows, so loading 1.5 million spans takes seconds, not the pipeline's
minutes): per rollout a ROLLOUT span (reward, sample of 8, completion tokens, clipped) and two
GRADER spans (judge, format; about 1 in 10 failed), three child spans (LLM, TOOL, LLM) for the
first 8 rollouts of each step, the step events with trainer metrics, step stats, reward and
completion length histograms, grader windows and a few alerts. :func:`ui_figures` serves the page
over HTTP in this process, as ``rlpulse ui`` does (a store opened for each request), and times each
page's whole answer.

    .venv/bin/python -m bench.ui_bench              # prints the figures as JSON
    .venv/bin/python -m bench.ui_bench --steps 100  # a smaller run
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from rlpulse.base.settings import Settings
from rlpulse.sinks.store.clickhouse import Store, migrate, open_reader, open_store
from rlpulse.sinks.views.ui_server import UiServer

PROJECT, RUN = "bench", "ui-bench"
STEPS, ROLLOUTS, PER_SAMPLE = 1000, 512, 8
REPEAT = 5
TARGET_S = 1.0
NS = 1_000_000_000


def load(store: Store, steps: int = STEPS, rollouts: int = ROLLOUTS) -> int:
    """Write the run; returns the spans written."""
    db, n = store.database, steps * rollouts
    t0 = time.time_ns() - steps * 10 * NS  # a step every 10 s, ending now
    ident = f"'{PROJECT}' AS project, '{RUN}' AS run_id, toUInt32(1) AS attempt, 'train' AS stage"
    step_of, i_of = f"intDiv(number, {rollouts})", f"number % {rollouts}"
    rollout_id = f"concat('s', toString({step_of}), '-r', toString({i_of}))"
    common = (f"{ident}, lower(hex(intDiv(number, 1))) AS trace_id, toNullable({step_of}) AS step, 'w' AS writer_id, "
              f"{rollout_id} AS rollout_id")
    reward = "round((cityHash64(number, 'reward') % 1000) / 1000, 3)"
    when = f"{t0} + {step_of} * {10 * NS} + ({i_of}) * 1000000"
    c = store.client
    c.command(f"""INSERT INTO {db}.spans (project, run_id, attempt, stage, trace_id, step, writer_id, rollout_id, span_id,
        parent_span_id, name, kind, start_time_ns, end_time_ns, status, status_message, sequence_id, attributes, reward,
        completion_tokens, max_tokens, clipped, sample_id, finish_reason, policy_version)
        SELECT {common}, concat('r', toString(number)), NULL, 'rollout', 'ROLLOUT', {when}, {when} + 900000, 'OK', '',
               number * 8, map(), {reward}, toInt64(50 + cityHash64(number, 'len') % 1000), 1024,
               cityHash64(number, 'len') % 1000 > 950,
               concat('p', toString({step_of}), '-', toString(intDiv({i_of}, {PER_SAMPLE}))),
               if(cityHash64(number, 'len') % 1000 > 950, 'length', 'stop'), toNullable(toInt64({step_of}) - 1)
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
    c.command(f"""INSERT INTO {db}.spans (project, run_id, attempt, stage, trace_id, step, writer_id, rollout_id, span_id,
        parent_span_id, name, kind, start_time_ns, end_time_ns, status, status_message, sequence_id, attributes)
        SELECT {common}, concat('c', toString(number), '-', toString(k)), concat('r', toString(number)),
               ['turn 1', 'search', 'turn 2'][k + 1], ['LLM', 'TOOL', 'LLM'][k + 1], {when} + k * 200000,
               {when} + (k + 1) * 200000, 'OK', '', number * 8 + 3 + k,
               map('gen_ai.request.model', 'bench-policy', 'gen_ai.usage.output_tokens', '100')
        FROM numbers({n}) ARRAY JOIN [0, 1, 2] AS k WHERE {i_of} < 8""")
    step_t = f"{t0} + number * {10 * NS} + {9 * NS}"
    c.command(f"""INSERT INTO {db}.steps (project, run_id, attempt, stage, time_ns, type, trainer, step, step_count, tokens,
        duration_s, throughput, writer_id, sequence_id, metrics)
        SELECT {ident}, {step_t}, 'STEP', 'rl', number, number + 1, 100000, 9.0, 11111.0, 'w', number + 1,
               map('loss', 1 / (number + 1), 'kl', number / 10000, 'grad_norm', 1 + (number % 7) / 10)
        FROM numbers({steps})""")
    c.command(f"""INSERT INTO {db}.steps (project, run_id, attempt, stage, time_ns, type, trainer, step, step_count, tokens,
        duration_s, throughput, writer_id, sequence_id) VALUES
        ('{PROJECT}', '{RUN}', 1, 'train', {t0 - NS}, 'RUN_START', 'rl', -1, 0, 0, 0, 0, 'w', 0)""")
    bounds = "[0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1, 2, 5]"
    c.command(f"""INSERT INTO {db}.step_stats (project, run_id, attempt, step, rollouts, clipped, clipped_ratio, reward_mean,
        reward_std, reward_min, reward_max, reward_zero_fraction, completion_mean, completion_min, completion_max, samples,
        samples_same_reward, sample_reward_spread_mean, complete, emitted_at_ns, staleness_max, staleness_mean)
        SELECT {ident.replace(", 'train' AS stage", "")}, number, {rollouts}, 25, 25 / {rollouts}, 0.5, 0.29, 0, 1, 0.01,
               500, 50, 1049, {rollouts // PER_SAMPLE}, 0, 0.25, true, {step_t}, 1, 1.0 FROM numbers({steps})""")
    c.command(f"""INSERT INTO {db}.reward_histograms (project, run_id, attempt, step, term, bounds, bucket_counts, count, sum,
        min, max, zero_fraction, emitted_at_ns)
        SELECT {ident.replace(", 'train' AS stage", "")}, number, 'total', {bounds},
               [5, 51, 51, 51, 52, 51, 51, 51, 51, 46, 52, 0, 0, 0, 0], {rollouts}, 256.0, 0, 1, 0.01, {step_t}
        FROM numbers({steps})""")
    c.command(f"""INSERT INTO {db}.completion_length_histograms (project, run_id, attempt, step, scale, zero_count, offset,
        bucket_counts, count, sum, min, max, emitted_at_ns)
        SELECT {ident.replace(", 'train' AS stage", "")}, number, 0, 0, 5, [12, 25, 50, 100, 200, 125], {rollouts},
               256000, 50, 1049, {step_t} FROM numbers({steps})""")
    c.command(f"""INSERT INTO {db}.alerts (rule, state, key, severity, summary, value, threshold, project, run_id, attempt,
        time_ns, first_seen_ns, last_seen_ns)
        SELECT 'grader_failure_rate', if(number % 2 = 0, 'FIRING', 'RESOLVED'), '{PROJECT}/{RUN}/1/judge', 'warning',
               'judge failure rate over threshold', 0.3, 0.2, '{PROJECT}', '{RUN}', 1,
               {t0} + number * {500 * NS}, {t0} + intDiv(number, 2) * {1000 * NS}, {t0} + number * {500 * NS}
        FROM numbers(20)""")
    return n * 3 + min(rollouts, 8) * steps * 3


def settle(store: Store, timeout_s: float = 120.0) -> None:
    """Wait until ClickHouse has merged what the load wrote: a page timed while background merges of
    1.5 million fresh rows take the cores measures the merges, not the page (a store the sink filled
    over hours has long merged its parts)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not store.client.query(f"SELECT count() FROM system.merges WHERE database = '{store.database}'").result_rows[0][0]:
            return
        time.sleep(0.5)


def pages(steps: int) -> dict[str, str]:
    run = f"project={PROJECT}&run={RUN}&attempt=1"
    mid = steps // 2
    return {"runs": "/", "run": f"/run?{run}", "run_metrics": f"/run?{run}&metric=kl&metric=loss&page=3",
            "step": f"/step?{run}&step={mid}", "step_filtered": f"/step?{run}&step={mid}&sort=reward-desc&failed=judge",
            "trajectory": f"/trajectory?{run}&rollout=s{mid}-r3"}


def time_pages(url: str, token: str, steps: int, repeat: int = REPEAT) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, path in pages(steps).items():
        took = []
        for _ in range(repeat):
            request = urllib.request.Request(url.rstrip("/") + path, headers={"Authorization": f"token {token}"})
            started = time.perf_counter()
            with urllib.request.urlopen(request, timeout=60) as answer:
                body = answer.read()
                assert answer.status == 200, (name, answer.status)
            took.append(time.perf_counter() - started)
        out[f"ui_{name}_s_median"] = round(statistics.median(took), 4)
        out[f"ui_{name}_s_max"] = round(max(took), 4)
        out[f"ui_{name}_bytes"] = len(body)
    return out


def ui_figures(settings: Settings, steps: int = STEPS, rollouts: int = ROLLOUTS, repeat: int = REPEAT) -> dict[str, Any]:
    """Load a run of ``steps`` x ``rollouts`` into a fresh chDB store and time each page: median and max
    seconds per page (``ui_<page>_s_median``, ``ui_<page>_s_max``), and ``ui_within_target`` (every max under 1 s)."""
    settings.home.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="ui-bench-", dir=settings.home))
    dsn = f"chdb://{folder / 'store'}"
    try:
        started = time.perf_counter()
        with open_store(dsn, owner="bench ui") as store:
            migrate(store)
            spans = load(store, steps, rollouts)
            settle(store)
        figures: dict[str, Any] = {"ui_steps": steps, "ui_rollouts_per_step": rollouts, "ui_spans": spans,
                                   "ui_load_s": round(time.perf_counter() - started, 2)}
        with UiServer(lambda: open_reader(dsn, owner="bench ui"), dsn) as server:
            figures.update(time_pages(server.url, server.token, steps, repeat))
        figures["ui_within_target"] = all(v <= TARGET_S for k, v in figures.items() if k.endswith("_s_max"))
        return figures
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--rollouts", type=int, default=ROLLOUTS)
    parser.add_argument("--repeat", type=int, default=REPEAT)
    args = parser.parse_args()
    print(json.dumps(ui_figures(Settings.load(), args.steps, args.rollouts, args.repeat), indent=2))


if __name__ == "__main__":
    main()
