"""The queries behind one scrape, read from ClickHouse through the same path as ``rlpulse query``.

Every per-run query starts from the same set of runs (``LIVE``): the attempts of the ``steps`` table
that are still running, or ended (a RUN_END, or no row for ``idle_after``) at most ``grace`` ago,
newest first, at most ``max_runs`` of them. Only rows since ``now - idle_after - grace`` are read
for it: any run in the set has one there, and a step count only rises, so the highest one there is
the attempt's. Samples (GPUs, engines, capacity) are each key's latest within ``window``. The
tables are ReplacingMergeTrees read without FINAL: per natural key the latest emission wins
(argMax over emitted_at_ns or time_ns), as the saved queries in sinks/read/queries/ do.

Each query returns ``candidates`` (``count() OVER ()``, before its LIMIT), so what a cap leaves
out is counted, never silently dropped.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

NS = 1_000_000_000
MAX_SAMPLE_KEYS = 10_000  # GPUs, engines, pool/project/instance rows and firing alerts served at most, each

LIVE = """live AS
(
    SELECT project, run_id, attempt, trainer, step_count, count() OVER () AS candidates
    FROM
    (
        SELECT project, run_id, attempt, argMax(trainer, time_ns) AS trainer, max(step_count) AS step_count,
               max(time_ns) AS last_ns, maxIf(time_ns, type = 'RUN_END') AS end_ns, countIf(type = 'RUN_END') > 0 AS ended
        FROM {db}.steps
        WHERE time_ns >= {cutoff_ns:Int64}
        GROUP BY project, run_id, attempt
    )
    WHERE if(ended, end_ns >= {ended_since_ns:Int64}, last_ns >= {idle_since_ns:Int64})
    ORDER BY last_ns DESC, project, run_id, attempt
    LIMIT {max_runs:UInt32}
)"""
_IN_LIVE = "(project, run_id, attempt) IN (SELECT project, run_id, attempt FROM live)"

QUERIES: dict[str, str] = {
    # the runs: trainer and step count; candidates counted before the LIMIT
    "runs": f"""WITH {LIVE}
SELECT project, run_id, attempt, trainer, step_count, candidates FROM live""",
    # the latest STEP event of each run: tokens, tokens/s, MFU
    "latest_step": f"""WITH {LIVE}
SELECT project, run_id, attempt, argMax((tokens, throughput, mfu), time_ns) AS last
FROM {{db}}.steps
WHERE type = 'STEP' AND {_IN_LIVE}
GROUP BY project, run_id, attempt""",
    # the clipped ratio of each run's latest step
    "clipped": f"""WITH {LIVE}
SELECT project, run_id, attempt, argMax(clipped_ratio, (step, emitted_at_ns)) AS clipped_ratio
FROM {{db}}.step_stats
WHERE {_IN_LIVE}
GROUP BY project, run_id, attempt""",
    # grader failures per run, term and cause: the latest emission of each window, summed
    "failures": f"""WITH {LIVE}
SELECT project, run_id, attempt, term, cause, sum(failures) AS failures
FROM
(
    SELECT project, run_id, attempt, term, cause, window_start_ns, argMax(failures, emitted_at_ns) AS failures
    FROM {{db}}.grader_failures
    WHERE {_IN_LIVE}
    GROUP BY project, run_id, attempt, term, cause, window_start_ns
)
GROUP BY project, run_id, attempt, term, cause""",
    # the reward histogram per run and term: each step's latest emission, summed bucket by bucket
    "rewards": f"""WITH {LIVE}
SELECT project, run_id, attempt, term, b, sumForEach(bc) AS counts, sum(n) AS total_count, sum(s) AS total_sum
FROM
(
    SELECT project, run_id, attempt, step, term, argMax((bounds, bucket_counts, count, sum), emitted_at_ns) AS last,
           last.1 AS b, last.2 AS bc, last.3 AS n, last.4 AS s
    FROM {{db}}.reward_histograms
    WHERE {_IN_LIVE}
    GROUP BY project, run_id, attempt, step, term
)
GROUP BY project, run_id, attempt, term, b""",
    # completion lengths per run: each step's latest emission, its buckets downscaled to the run's
    # lowest scale (bucket i at scale s is floor(i / 2^(s - low)) at scale low) and summed
    "lengths": f"""WITH {LIVE},
    per_step AS
    (
        SELECT project, run_id, attempt, step,
               argMax((scale, zero_count, offset, bucket_counts, count, sum), emitted_at_ns) AS last
        FROM {{db}}.completion_length_histograms
        WHERE {_IN_LIVE}
        GROUP BY project, run_id, attempt, step
    ),
    per_run AS
    (
        SELECT project, run_id, attempt, min(last.1) AS low, sum(last.2) AS zeros, sum(last.5) AS n,
               sum(last.6) AS total
        FROM per_step
        GROUP BY project, run_id, attempt
    ),
    buckets AS
    (
        SELECT s.project AS project, s.run_id AS run_id, s.attempt AS attempt,
               toInt64(floor((s.last.3 + i - 1) / pow(2, s.last.1 - r.low))) AS idx, sum(c) AS n
        FROM per_step AS s
        INNER JOIN per_run AS r ON s.project = r.project AND s.run_id = r.run_id AND s.attempt = r.attempt
        ARRAY JOIN s.last.4 AS c, arrayEnumerate(s.last.4) AS i
        WHERE c > 0
        GROUP BY project, run_id, attempt, idx
    )
SELECT r.project, r.run_id, r.attempt, r.low, r.zeros, r.n, r.total,
       arraySort(x -> x.1, groupArrayIf((b.idx, b.n), b.n > 0)) AS buckets
FROM per_run AS r
LEFT JOIN buckets AS b ON b.project = r.project AND b.run_id = r.run_id AND b.attempt = r.attempt
GROUP BY r.project, r.run_id, r.attempt, r.low, r.zeros, r.n, r.total""",
    # each run's placements with a GPU UUID: the latest pod and node per (role, rank, hw_id)
    "placements": f"""WITH {LIVE}
SELECT project, run_id, attempt, role, rank, assumeNotNull(hw_id) AS hw_id, argMax((pod, node), time_ns) AS last
FROM {{db}}.placements
WHERE hw_id IS NOT NULL AND hw_id != '' AND {_IN_LIVE}
GROUP BY project, run_id, attempt, role, rank, hw_id""",
    # each GPU's latest sample within the window
    "gpus": """SELECT hw_id, argMax((project, run_id, attempt, power_w, temperature_c, gpu_utilization, memory_used_bytes,
                      memory_utilization, memory_activity, throttle_reasons, xid_errors, xid_last), time_ns) AS last,
       count() OVER () AS candidates
FROM {db}.gpu_samples
WHERE time_ns >= {since_ns:Int64} AND hw_id != ''
GROUP BY hw_id
ORDER BY max(time_ns) DESC, hw_id
LIMIT {max_keys:UInt32}""",
    # each engine's latest sample within the window
    "engines": """SELECT project, run_id, attempt, pod, url, engine,
       argMax((model_name, requests_running, requests_waiting, kv_cache_usage, awake), time_ns) AS last,
       count() OVER () AS candidates
FROM {db}.engine_samples
WHERE time_ns >= {since_ns:Int64}
GROUP BY project, run_id, attempt, pod, url, engine
ORDER BY max(time_ns) DESC, project, run_id, attempt, pod, url, engine
LIMIT {max_keys:UInt32}""",
    # each trainer-service instance's latest report per pool (project '') and per project within the window
    "capacity": """SELECT pool, project, instance,
       argMax((serving, accelerator, devices_declared, devices_observed, devices_granted, devices_queued,
               claims_granted, claims_queued, quota), time_ns) AS last,
       count() OVER () AS candidates
FROM {db}.capacity
WHERE time_ns >= {since_ns:Int64}
GROUP BY pool, project, instance
ORDER BY max(time_ns) DESC, pool, project, instance
LIMIT {max_keys:UInt32}""",
    # the alerts whose latest record is FIRING (RESOLVED wins a tie on time_ns, as stalled-runs.sql)
    "alerts": """SELECT rule, key, last.2, last.3, last.4, last.5, count() OVER () AS candidates
FROM
(
    SELECT rule, key, argMax((state, severity, project, run_id, attempt, time_ns), (time_ns, state = 'RESOLVED')) AS last
    FROM {db}.alerts
    GROUP BY rule, key
)
WHERE last.1 = 'FIRING'
ORDER BY last.6 DESC, rule, key
LIMIT {max_keys:UInt32}""",
}
CAPPED = ("runs", "gpus", "engines", "capacity", "alerts")
_DB = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Scope:
    """What one scrape serves: the runs' grace, idleness and cap, the samples' window, the time limit."""

    grace_s: float = 900.0
    idle_after_s: float = 3600.0
    max_runs: int = 1000
    window_s: float = 300.0
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("grace_s", "idle_after_s", "window_s", "timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name.removesuffix('_s').replace('_', '-')} must be a duration of 0 or more, got {value!r}")
        if self.timeout_s < 1:
            raise ValueError(f"query-timeout must be at least 1s, got {self.timeout_s}s")
        if not 1 <= self.max_runs <= 1_000_000:
            raise ValueError(f"max-runs must be from 1 to 1000000, got {self.max_runs}")

    def params(self, now_ns: int) -> dict[str, int]:
        grace, idle = int(self.grace_s * NS), int(self.idle_after_s * NS)
        return {"cutoff_ns": now_ns - idle - grace, "ended_since_ns": now_ns - grace, "idle_since_ns": now_ns - idle - grace,
                "max_runs": self.max_runs, "since_ns": now_ns - int(self.window_s * NS), "max_keys": MAX_SAMPLE_KEYS}


@dataclass
class Rows:
    """Each query's rows (tuples, in its column order) and what each cap left out."""

    now_ns: int
    tables: dict[str, list[tuple]] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)  # runs, gpus, engines, capacity, alerts


def _placeholders(sql: str) -> set[str]:
    return set(re.findall(r"\{([A-Za-z_][A-Za-z0-9_]*):[^{}]+\}", sql))


def read(client: Any, database: str, scope: Scope, now_ns: int | None = None) -> Rows:
    """Run every query of a scrape on ``client`` (a store opened by ``open_reader``), within
    ``scope.timeout_s`` in all: each query's max_execution_time is what is left of it."""
    if not _DB.match(database):
        raise ValueError(f"invalid database name {database!r}")
    now_ns = time.time_ns() if now_ns is None else now_ns
    params = scope.params(now_ns)
    deadline = time.monotonic() + scope.timeout_s
    rows = Rows(now_ns)
    for name, template in QUERIES.items():
        left = deadline - time.monotonic()
        if left < 0.05:
            raise TimeoutError(f"the scrape's queries took over {scope.timeout_s:g}s (query-timeout); {name} not run")
        sql = template.replace("{db}", database)
        wanted = {k: v for k, v in params.items() if k in _placeholders(sql)}
        result = client.query(sql, parameters=wanted,
                              settings={"readonly": 1, "max_execution_time": max(1, math.ceil(left))})
        rows.tables[name] = [tuple(r) for r in result.result_rows]
    for name in CAPPED:  # each of these queries' last column is its candidates, counted before the LIMIT
        got = rows.tables[name]
        rows.dropped[name] = max(0, int(got[0][-1]) - len(got)) if got else 0
    return rows
