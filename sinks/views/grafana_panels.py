"""The Grafana dashboard's time series panels, grouped in rows by the question a user opens it with.

A saved query answers one question in one table (per step, per GPU, per run over a time range); a
panel over time needs a ``time`` column, one row per point, so each panel here has its own SQL. It
reads the same tables with the same dedup as the saved query it draws (argMax over ``emitted_at_ns``,
``LIMIT 1 BY`` the natural key), and carries that query's description (sinks/views/grafana.py), so
the (i) of a panel says what the numbers are in the words ``rlpulse query --list`` uses.

Every panel shows the dashboard's run (``run_id``, ``attempt``) within its time range: the SQL uses
the saved queries' placeholders (``{run_id:String}``, ``{since:DateTime64(3, 'UTC')}``, ...), which
grafana.py maps to percent-encoded variables and the plugin's time macros, so the injection
guarantees of the tables hold here as well.

The rows come back in the ClickHouse plugin's "time series" format: ``time`` (a DateTime64), then
the ``labels`` columns (text: one series per value), then the numeric ``values``; the plugin turns
such a long frame into one series per label value, which needs the rows in time order.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlpulse.sinks.read.queries import load_saved

RUN = "run_id = {run_id:String} AND attempt = {attempt:UInt32}"


def in_range(column: str) -> str:
    """``column`` within the dashboard's time range (the plugin's $__fromTime_ms / $__toTime_ms)."""
    return f"{column} >= {{since:DateTime64(3, 'UTC')}} AND {column} < {{until:DateTime64(3, 'UTC')}}"


def _body(name: str) -> str:
    """A saved query's SQL without its header, to read as a subquery (one source for its figures)."""
    return "\n".join(line for line in load_saved(name).splitlines() if not line.strip().startswith("--")).strip()


@dataclass(frozen=True)
class TimeSeries:
    """One time series panel: ``sql`` returns the columns ``time``, ``labels`` then ``values``."""

    title: str
    saved: str  # the saved query whose whole description the panel carries
    drawn: str  # what the panel draws of it, after that description
    sql: str
    values: tuple[str, ...]
    labels: tuple[str, ...] = ()
    unit: str = "short"
    fraction: bool = False  # a share 0..1: the axis runs from 0 to 1, shown as 0..100 %
    bars: bool = False  # counts per window: bars, stacked by label

    @property
    def columns(self) -> tuple[str, ...]:
        return ("time", *self.labels, *self.values)


# A step's time is its STEP event's (the trainer's clock); a step the streams figured without one
# (a LEFT JOIN's 0) takes the time its figures were emitted. Not emitted_at alone: the streams stamp
# it when they emit, so a backlog replayed at once would put every step at the same instant.
_STEP_STATS = f"""(
    SELECT step,
           argMax(reward_mean, emitted_at_ns) AS reward_mean,
           argMax(clipped_ratio, emitted_at_ns) AS clipped_ratio,
           max(emitted_at_ns) AS emitted_ns
    FROM {{db}}.step_stats
    WHERE {RUN}
    GROUP BY step
) AS s
LEFT JOIN
(
    SELECT step, max(time_ns) AS at_ns
    FROM {{db}}.steps
    WHERE {RUN} AND type = 'STEP'
    GROUP BY step
) AS t ON t.step = s.step"""
_STEP_TIME = "fromUnixTimestamp64Nano(if(t.at_ns = 0, s.emitted_ns, t.at_ns), 'UTC')"

REWARD = TimeSeries(
    title="Reward per step",
    saved="reward-percentiles",
    drawn="each step's mean reward (step_stats) and its p10/p50/p90, at the time of the step's STEP event",
    sql=f"""SELECT
    {_STEP_TIME} AS time,
    round(s.reward_mean, 4) AS mean,
    p.p10 AS p10,
    p.p50 AS p50,
    p.p90 AS p90
FROM {_STEP_STATS}
LEFT JOIN
(
{_body("reward-percentiles")}
) AS p ON p.step = s.step
WHERE {in_range("time")}
ORDER BY time""",
    values=("mean", "p10", "p50", "p90"),
)

CLIPPED = TimeSeries(
    title="Clipped ratio",
    saved="clipped-ratio-trend",
    drawn="each step's clipped ratio (rollouts cut at the length limit), at the time of the step's STEP event",
    sql=f"""SELECT
    {_STEP_TIME} AS time,
    round(s.clipped_ratio, 4) AS clipped_ratio
FROM {_STEP_STATS}
WHERE {in_range("time")}
ORDER BY time""",
    values=("clipped_ratio",),
    unit="percentunit",
    fraction=True,
)

# window_start is in the GROUP BY (it follows window_start_ns) so that the outer query reads the column:
# an `any(window_start) AS window_start` would make the WHERE's window_start that aggregate.
FAILURES = TimeSeries(
    title="Grader failures by cause",
    saved="failures-by-cause",
    drawn="the failures of every grader term per window and cause (timeout, error, ...)",
    sql=f"""SELECT window_start AS time, cause, sum(failures) AS failures
FROM
(
    SELECT term, cause, window_start, argMax(failures, emitted_at_ns) AS failures
    FROM {{db}}.grader_failures
    WHERE {RUN} AND {in_range("window_start")}
    GROUP BY term, cause, window_start_ns, window_start
)
GROUP BY time, cause
ORDER BY time, cause""",
    values=("failures",),
    labels=("cause",),
    bars=True,
)

FAILURE_RATE = TimeSeries(
    title="Grader failure rate by term",
    saved="failures-by-cause",
    drawn="each grader term's failure rate per window: failures / graded (0 when nothing was graded)",
    sql=f"""SELECT window_start AS time, term, round(if(graded = 0, 0, failures / graded), 4) AS failure_rate
FROM
(
    SELECT term, window_start, argMax(graded, emitted_at_ns) AS graded, argMax(failures, emitted_at_ns) AS failures
    FROM {{db}}.grader_windows
    WHERE {RUN} AND {in_range("window_start")}
    GROUP BY term, window_start_ns, window_start
)
ORDER BY time, term""",
    values=("failure_rate",),
    labels=("term",),
    unit="percentunit",
    fraction=True,
)


def _engine(columns: str) -> str:
    """Each engine's samples in time (its pod, else its URL, names the series); one row per natural key."""
    return f"""SELECT time, instance, {columns}
FROM
(
    SELECT time, if(pod = '', url, pod) AS instance, {columns}, project, pod, url, engine, time_ns
    FROM {{db}}.engine_samples
    WHERE {RUN} AND {in_range("time")}
    LIMIT 1 BY project, pod, url, engine, time_ns
)
ORDER BY time, instance"""


KV_CACHE = TimeSeries(
    title="Engine KV-cache usage",
    saved="engine-by-step",
    drawn="each engine's KV-cache usage per sample (0 to 100 %)",
    sql=_engine("kv_cache_usage"),
    values=("kv_cache_usage",),
    labels=("instance",),
    unit="percentunit",
    fraction=True,
)

QUEUE = TimeSeries(
    title="Engine queue: requests running and waiting",
    saved="engine-by-step",
    drawn="each engine's requests running and waiting per sample",
    sql=_engine("requests_running, requests_waiting"),
    values=("requests_running", "requests_waiting"),
    labels=("instance",),
)


def _gpu(column: str) -> str:
    """Each GPU's samples of the run in time, by the samples' own run and attempt (what the poller
    placed on the GPU then; gpu-time counts them the same way); one row per (hw_id, time_ns)."""
    return f"""SELECT time, gpu, {column}
FROM
(
    SELECT time, concat(host, ' gpu ', toString(`index`)) AS gpu, {column}, hw_id, time_ns
    FROM {{db}}.gpu_samples
    WHERE {RUN} AND {in_range("time")}
    LIMIT 1 BY hw_id, time_ns
)
ORDER BY time, gpu"""


GPU_UTILISATION = TimeSeries(
    title="GPU utilisation",
    saved="gpu-utilization-by-run",
    drawn="each GPU's utilisation per sample (NVML's 0..1 fraction, shown as 0 to 100 %)",
    sql=_gpu("gpu_utilization"),
    values=("gpu_utilization",),
    labels=("gpu",),
    unit="percentunit",
    fraction=True,
)

GPU_POWER = TimeSeries(
    title="GPU power",
    saved="gpu-utilization-by-run",
    drawn="each GPU's power draw per sample, in watts",
    sql=_gpu("power_w"),
    values=("power_w",),
    labels=("gpu",),
    unit="watt",
)

# (row title, its panels), top to bottom; the panels of a row two to a line.
ROWS: tuple[tuple[str, tuple[TimeSeries, ...]], ...] = (
    ("Is training healthy?", (REWARD, CLIPPED)),
    ("Are graders failing?", (FAILURES, FAILURE_RATE)),
    ("Are the engines and GPUs busy?", (KV_CACHE, QUEUE, GPU_UTILISATION, GPU_POWER)),
)
TABLES_ROW = "Tables"
