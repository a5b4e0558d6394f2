"""End to end: a backlog with known truth, Kafka's ceilings on it, the drain, latency, exactness.

One run, in this order, on a topic prefix and a chDB store of its own:

1. publish the backlog (containers keyed ``project/run_id``, as the SDK writes them) before
   any consumer exists;
2. ConsumerPerformance reads that same spans topic (the ceiling for the drain), and
   ProducerPerformance writes records the size of its containers to a topic beside it;
3. ``rlpulse streams`` and ``rlpulse sink`` start (``rlpulse.pipeline.Pipeline``) and drain it;
4. a live load at half the measured drain rate gives the event-to-row latency;
5. the pipeline stops and ClickHouse's figures are compared with the truth.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any
from collections.abc import Callable

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from bench import kafka_perf
from bench.drain import DrainConfig, Sent, measure_drain, measure_latency, producer_kwargs, send_all
from bench.monitor import EventIndex
from bench.stats import median
from bench.workload import LiveRuns, Message, Truth, WorkloadConfig, messages
from rlpulse import services
from rlpulse.pipeline import Pipeline
from rlpulse.progress import Ticker
from rlpulse.base import env as envvars
from rlpulse.base.settings import Settings
from rlpulse.schemas.codec import Codec
from rlpulse.schemas.topics import ensure_topics

Progress = Callable[[str], None]


@dataclasses.dataclass
class E2EConfig:
    workload: WorkloadConfig = dataclasses.field(default_factory=WorkloadConfig)
    drain: DrainConfig = dataclasses.field(default_factory=DrainConfig)
    window: str = "10s"
    allowed_lateness: str = "2s"
    reps: int = 3  # drains, each of a fresh backlog; the rate is their median
    budget_s: float = 660.0  # no further repetition starts when it would end past this
    ceiling_reps: int = 3  # ProducerPerformance runs
    consumer_reps: int = 2  # ConsumerPerformance runs per backlog (so reps x this in all)
    latency_s: float = 20.0
    latency_default_rate: float = 5000.0  # when the drain gave no rate to halve
    keep: bool = False  # keep the topics and the chDB store for a look afterwards


def bench_settings(base: Settings, config: E2EConfig, store: Path) -> Settings:
    """A prefix and a store of its own, short windows: nothing else on the broker is touched."""
    return dataclasses.replace(
        base,
        topic_prefix=f"bench{uuid.uuid4().hex[:8]}",
        clickhouse_url=f"chdb://{store}",
        home=store.parent,  # the streams' Faust data dir too goes where the cleanup looks
        window=Settings.load({envvars.WINDOW: config.window}).window,
        allowed_lateness=Settings.load({envvars.ALLOWED_LATENESS: config.allowed_lateness}).allowed_lateness,
    )


async def publish_backlog(
    settings: Settings, workload: WorkloadConfig, index: EventIndex, truth: Truth, progress: Progress
) -> dict[str, Any]:
    codec = Codec()
    producer = AIOKafkaProducer(**producer_kwargs(settings))
    await producer.start()
    sent: list[Sent] = []
    span_bytes = 0
    started = time.monotonic()
    try:
        batch: list[Message] = []
        generated, report = 0, 250_000
        for m in messages(workload, time.time_ns()):
            truth.add(m)
            batch.append(m)
            generated += len(m.records)
            if len(batch) >= 200:  # a few hundred sends in flight: batching without holding the backlog in memory
                await send_all(producer, settings, codec, batch, sent)
                batch = []
            if generated >= report:
                progress(f"backlog: {generated:,}/{workload.events:,} events published")
                report += 250_000
        await send_all(producer, settings, codec, batch, sent)
        await producer.flush()
    finally:
        await producer.stop()
    seconds = time.monotonic() - started
    for x in sorted(sent, key=lambda x: (x.tp, x.offset)):
        index.add(x.tp, x.offset, x.records)
        span_bytes += x.size if x.short == "spans" else 0
    summary = truth.summary()
    return {
        "backlog_events": index.total,
        "backlog_publish_s": round(seconds, 1),
        **summary,
        "span_container_bytes_mean": span_bytes / summary["span_messages"],
        "span_records_per_message": summary["span_events"] / summary["span_messages"],
    }


async def _create_topic(settings: Settings, name: str) -> None:
    admin = AIOKafkaAdminClient(**settings.kafka_client_kwargs())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, settings.partitions, 1)])
    finally:
        await admin.close()


async def delete_topics(settings: Settings, prefixes: tuple[str, ...] | None = None) -> list[str]:
    """Every topic of this benchmark's prefix (its own, Faust's changelogs), to give the disk back."""
    prefixes = prefixes or (settings.topic_prefix + ".", settings.topic_prefix + "-")
    admin = AIOKafkaAdminClient(**settings.kafka_client_kwargs())
    await admin.start()
    try:
        ours = [t for t in await admin.list_topics() if t.startswith(prefixes)]
        if ours:
            await admin.delete_topics(ours)
        return ours
    finally:
        await admin.close()


def show_log_tails(log_dir: Path, progress: Progress) -> None:
    """The last lines of each process's log: why a failed run failed."""
    for log in sorted(log_dir.glob("*.log")):
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        progress(f"--- last lines of {log} ---\n{tail}")


def clean_up(settings: Settings, tmp: Path, progress: Progress) -> None:
    """Delete the run's topics and its scratch folder (the chDB store); best effort, said when it fails."""
    try:
        asyncio.run(delete_topics(settings))
    except Exception as exc:
        progress(f"could not delete the run's topics ({settings.topic_prefix}.*): {exc}")
    shutil.rmtree(tmp, ignore_errors=True)


def check_exact(settings: Settings, truth: Truth, project: str) -> dict[str, Any]:
    """ClickHouse's figures against the truth: failures by cause per run, rollouts and clipped per step,
    raw rows. The latest emission of each window or step wins, as FINAL would merge them."""
    from rlpulse.sinks.store.clickhouse import open_store

    with open_store(settings.clickhouse_dsn, owner="rlpulse bench") as store:
        db, q = store.database, store.client.query
        p = {"p": project}
        failures = {
            (r, t, c): int(n)
            for r, t, c, n in q(
                f"SELECT run_id, term, cause, sum(f) FROM (SELECT run_id, attempt, term, cause, window_start, "
                f"argMax(failures, emitted_at_ns) AS f FROM {db}.grader_failures FINAL WHERE project = {{p:String}} "
                f"GROUP BY run_id, attempt, term, cause, window_start) GROUP BY run_id, term, cause",
                parameters=p,
            ).result_rows
        }
        steps = {
            (r, int(s)): (int(n), int(c))
            for r, s, n, c in q(
                f"SELECT run_id, step, argMax(rollouts, emitted_at_ns), argMax(clipped, emitted_at_ns) FROM {db}.step_stats "
                f"FINAL WHERE project = {{p:String}} GROUP BY run_id, attempt, step",
                parameters=p,
            ).result_rows
        }
        spans = q(f"SELECT count() FROM {db}.spans FINAL WHERE project = {{p:String}}", parameters=p).result_rows[0][0]
        step_rows = q(f"SELECT count() FROM {db}.steps FINAL WHERE project = {{p:String}}", parameters=p).result_rows[0][0]
        kinds = dict(q(f"SELECT kind, count() FROM {db}.spans FINAL WHERE project = {{p:String}} AND kind IN ('LLM', 'TOOL') "
                       "GROUP BY kind", parameters=p).result_rows)
        metrics = q(f"SELECT count() FROM {db}.step_metrics WHERE project = {{p:String}}", parameters=p).result_rows[0][0]
        engine_rows = q(f"SELECT count() FROM {db}.engine_samples FINAL WHERE project = {{p:String}}",
                        parameters=p).result_rows[0][0]
    want_failures = {k: n for k, n in truth.failures.items() if n}
    got_failures = {k: n for k, n in failures.items() if n}
    want_steps = truth.step_stats()
    checks = {
        "failures_by_cause": _diff(want_failures, got_failures),
        "step_rollouts_clipped": _diff(want_steps, steps),
        "span_rows": None if spans == truth.events["spans"] else f"{spans} rows, expected {truth.events['spans']}",
        "step_rows": None if step_rows == truth.events["steps"] else f"{step_rows} rows, expected {truth.events['steps']}",
        "llm_tool_spans": _diff({k: n for k, n in truth.kinds.items() if k in ("LLM", "TOOL")}, kinds),
        "trainer_metrics": None if metrics == truth.metrics else f"{metrics} step_metrics rows, expected {truth.metrics}",
        "engine_rows": None if engine_rows == truth.events["hardware"] else
        f"{engine_rows} engine_samples rows, expected {truth.events['hardware']}",
    }
    return {"e2e_exact": all(v is None for v in checks.values()), "exact_checks": {k: v or "exact" for k, v in checks.items()}}


def _diff(want: dict, got: dict, show: int = 3) -> str | None:
    wrong = [k for k in want if got.get(k) != want[k]] + [k for k in got if k not in want]
    if not wrong:
        return None
    examples = ", ".join(f"{k}: expected {want.get(k)}, got {got.get(k)}" for k in sorted(wrong, key=str)[:show])
    return f"{len(wrong)} of {len(want)} keys differ (e.g. {examples})"


def run_e2e(base: Settings, config: E2EConfig, results: Path, progress: Progress) -> dict[str, Any]:
    """``config.reps`` drains, each of a fresh backlog on a fresh prefix and store; the rate is their median.

    The first repetition is also profiled and gives the producer ceiling, the last one the latency.
    Figures that could not be measured are None, with the reason under ``errors``.
    """
    out: dict[str, Any] = {"e2e_window_s": None, "e2e_runs": config.workload.runs, "errors": {}}
    shutil.rmtree(results / "logs", ignore_errors=True)  # the processes' logs of the latest run only
    reps: list[dict[str, Any]] = []
    consumer_runs: list[dict[str, Any]] = []
    started = time.monotonic()
    for rep in range(config.reps):
        last = rep == config.reps - 1
        if rep and reps and time.monotonic() - started + reps[-1]["rep_seconds"] > config.budget_s:
            progress(f"e2e: skipping repetitions {rep + 1}..{config.reps}: they would run past {config.budget_s:.0f}s")
            last = True
        progress(f"e2e: repetition {rep + 1} of {config.reps}")
        figures = _repetition(base, config, results, rep, last, out, consumer_runs, progress)
        reps.append(figures)
        if last or not figures.get("drain_complete"):
            break  # an incomplete drain would only time out again
    rates = [r.get("e2e_events_per_s") for r in reps]
    out.update(
        {
            "e2e_reps": len(reps),
            "e2e_events_per_s": median(rates),
            "e2e_events_per_s_reps": rates,
            "e2e_exact": bool(reps) and all(r.get("e2e_exact") for r in reps),
            "drain_complete": bool(reps) and all(r.get("drain_complete") for r in reps),
            # memory: the worst repetition, since the figure is a bound
            "streams_peak_rss_mib": max((r["streams_peak_rss_mib"] for r in reps if r.get("streams_peak_rss_mib")), default=None),
            "sink_peak_rss_mib": max((r["sink_peak_rss_mib"] for r in reps if r.get("sink_peak_rss_mib")), default=None),
        }
    )
    for key in (
        "streams_only_events_per_s",
        "streams_cpu_us_per_event",
        "sink_cpu_us_per_event",
        "broker_cpu_us_per_event",
        "drain_seconds",
        "startup_to_first_streams_commit_s",
        "startup_to_streams_group_ready_s",
        "startup_to_sink_group_ready_s",
        "startup_to_first_sink_commit_s",
    ):
        out[key] = median(r.get(key) for r in reps)
    out["exact_checks"] = [r.get("exact_checks") for r in reps]
    out["e2e_rep_figures"] = reps
    if consumer_runs:
        out.update(kafka_perf.consumer_figures(consumer_runs, out["span_records_per_message"], out["span_messages"]))
    return out


def _repetition(
    base: Settings,
    config: E2EConfig,
    results: Path,
    rep: int,
    last: bool,
    out: dict[str, Any],
    consumer_runs: list[dict[str, Any]],
    progress: Progress,
) -> dict[str, Any]:
    """One backlog, its consumer ceiling, its drain (and, as told, the producer ceiling, profile, latency)."""
    tmp = Path(tempfile.mkdtemp(prefix="rlpulse-bench-"))
    settings = bench_settings(base, config, tmp / "clickhouse")
    out.update(
        {
            "e2e_window_s": settings.window,
            "e2e_allowed_lateness_s": settings.allowed_lateness,
            "e2e_partitions": settings.partitions,
        }
    )
    figures: dict[str, Any] = {"topic_prefix": settings.topic_prefix}
    index, truth = EventIndex(), Truth()
    log_dir = results / "logs" / settings.topic_prefix
    begun = time.monotonic()
    try:
        ensure_topics(settings)
        progress(f"backlog: {config.workload.events:,} events of {config.workload.runs} runs on {settings.topic('spans')}")
        out.update(asyncio.run(publish_backlog(settings, config.workload, index, truth, progress)))
        _ceilings(base, settings, config, out, consumer_runs, with_producer=rep == 0, progress=progress)
        pipeline = Pipeline(settings, log_dir=log_dir)
        try:
            progress(f"drain: starting rlpulse streams and rlpulse sink (logs in {log_dir})")
            started = time.monotonic()
            pipeline.start()
            drain = dataclasses.replace(config.drain, profile_dir=results, profile_s=config.drain.profile_s if rep == 0 else 0,
                                        broker_pid=services.our_pid(base))
            drained = asyncio.run(measure_drain(settings, pipeline, index, drain, started, progress))
            for name in ("streams", "sink"):
                profile = drained.figures.pop(f"profile_{name}", None)
                if profile and "text" in profile:
                    (results / f"profile-{name}.txt").write_text(profile["text"])
                    out[f"profile_{name}_top"] = profile["lines"][:16]
                elif profile:
                    out["errors"][f"profile_{name}"] = profile["error"]
            figures.update(drained.figures)
            figures["drain_timeline"] = drained.timeline[::4]  # every 2 s is plenty to see the shape
            progress(f"drain: {_rate(figures.get('e2e_events_per_s'))} events/s over {figures.get('drain_seconds')}s")
            if last:
                rate = (
                    median([figures.get("e2e_events_per_s"), *out.get("e2e_events_per_s_reps", [])])
                    or config.latency_default_rate
                )
                live = LiveRuns(
                    dataclasses.replace(config.workload, project=config.workload.project + "-live"), runs=100, per_message=200
                )
                progress(f"latency: live load at {rate / 2:,.0f} events/s for {config.latency_s:.0f}s")
                out.update(asyncio.run(measure_latency(settings, Codec(), live, rate / 2, config.latency_s, progress)))
        finally:
            pipeline.stop()
        if figures.get("drain_complete"):
            with Ticker("exact: comparing ClickHouse with the truth", say=progress, every=10):
                figures.update(check_exact(settings, truth, config.workload.project))
            progress(f"exact: {figures['e2e_exact']} {figures['exact_checks']}")
        else:
            figures["e2e_exact"] = False
            out["errors"]["e2e_exact"] = "a drain did not complete, so its figures were not compared"
    except Exception as exc:  # one failed phase must not lose the figures the others measured
        out["errors"][f"e2e_rep{rep + 1}"] = f"{type(exc).__name__}: {exc}"
        figures.setdefault("e2e_exact", False)
        progress(f"e2e failed: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}")
        show_log_tails(log_dir, progress)
    finally:
        if not config.keep:
            clean_up(settings, tmp, progress)
        else:
            progress(f"kept topics {settings.topic_prefix}.* and the chDB store {tmp / 'clickhouse'}")
    figures["rep_seconds"] = round(time.monotonic() - begun, 1)
    return figures


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _ceilings(
    base: Settings,
    settings: Settings,
    config: E2EConfig,
    out: dict[str, Any],
    consumer_runs: list[dict[str, Any]],
    with_producer: bool,
    progress: Progress,
) -> None:
    """Kafka's own tools on this backlog's spans topic (consumer) and a topic beside it (producer);
    none with ``consumer_reps`` and ``ceiling_reps`` 0 (``--quick``)."""
    if config.consumer_reps == 0 and config.ceiling_reps == 0:
        return
    try:
        progress(f"ceilings: ConsumerPerformance x{config.consumer_reps} on {settings.topic('spans')}")
        libs = kafka_perf.tools_libs(base)  # the broker's jars, under the real RLPULSE_HOME
        with Ticker("ceilings: ConsumerPerformance running", say=progress, every=10):
            consumer_runs += [
                kafka_perf.consumer_perf(settings, libs, settings.topic("spans"), out["span_messages"])
                for _ in range(config.consumer_reps)
            ]
    except Exception as exc:
        out["errors"]["consumer_ceiling"] = f"{type(exc).__name__}: {exc}"
    if not with_producer:
        return
    try:
        perf_topic = settings.topic("perf")
        asyncio.run(_create_topic(settings, perf_topic))
        progress(
            f"ceilings: ProducerPerformance x{config.ceiling_reps} on {perf_topic}, "
            f"{out['span_container_bytes_mean']:.0f}-byte records"
        )
        with Ticker("ceilings: ProducerPerformance running", say=progress, every=10):
            out.update(
                kafka_perf.producer_ceiling(
                    settings,
                    kafka_perf.tools_libs(base),
                    perf_topic,
                    round(out["span_container_bytes_mean"]),
                    out["span_records_per_message"],
                    config.ceiling_reps,
                )
            )
    except Exception as exc:
        out["errors"]["producer_ceiling"] = f"{type(exc).__name__}: {exc}"
