"""``make soak``: the pipeline under a steady live load for minutes (memory and lag stay flat, nothing lost).

Live runs publish span containers stamped with the current time (``bench.workload.LiveRuns``,
as in the latency phase of ``make bench``) at half the benchmark's drain rate to ``rlpulse
streams`` and ``rlpulse sink`` (``rlpulse.pipeline.Pipeline``), on a topic prefix and a chDB
store of their own. Every few seconds it samples the resident memory of each process tree and
each consumer group's lag: in messages, and in seconds of events (the age of the oldest
message the group has not committed; the sink commits after its insert). At the end the runs
end, the pipeline catches up and ClickHouse is compared with the truth (``bench.e2e.check_exact``).

Pass: after the warm-up, each process's RSS grows by less than ``--max-rss-growth-pct``
(median of the first 30 s after the warm-up against the median of the last 30 s); the lag
stays below ``--max-lag-s`` and does not trend up (the least-squares slope over the measured
part, times its length, stays below ``--max-lag-growth-s``); and the figures are exact.
Writes bench/results/soak.json; exits 1 when a criterion fails.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict, deque
from pathlib import Path
from typing import Any
from collections.abc import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The home is the checkout's .rlpulse (rlpulse.base.files picks it for a checkout's rlpulse): the
# broker `make services-up` started.

from aiokafka import AIOKafkaProducer, TopicPartition  # noqa: E402

from bench.drain import Sent, producer_kwargs, send_all  # noqa: E402
from bench.e2e import E2EConfig, bench_settings, check_exact, clean_up, show_log_tails  # noqa: E402
from bench.monitor import OffsetWatcher, process_tree  # noqa: E402
from bench.workload import LiveRuns, Message, Truth, WorkloadConfig  # noqa: E402
from rlpulse import services  # noqa: E402
from rlpulse.pipeline import Pipeline, wait_groups_ready  # noqa: E402
from rlpulse.progress import Ticker  # noqa: E402
from rlpulse.base.settings import Settings  # noqa: E402
from rlpulse.schemas.catalogue import SINK_TOPICS  # noqa: E402
from rlpulse.schemas.codec import Codec  # noqa: E402
from rlpulse.schemas.topics import ensure_topics  # noqa: E402

RESULTS = ROOT / "bench" / "results"
DEFAULT_RATE = 28_000.0  # half of an earlier drain rate (56.3k events/s); the latest bench run is preferred
EDGE_S = 30.0  # RSS at the start and at the end: the median over this many seconds
Progress = Callable[[str], None]


@dataclasses.dataclass
class SoakConfig:
    minutes: float = 10.0  # of live load, warm-up included
    warmup_minutes: float | None = None  # None: 2, or a quarter of a shorter soak
    rate: float | None = None  # span events/s; None: half of bench/results/latest.json's drain, else DEFAULT_RATE
    runs: int = 100
    # Rollouts per step. With bench's 50, 100 runs at 28k events/s each complete a step every
    # 0.35 s, and every run's state holds ~57 retained steps, rewritten whole per message: the
    # streams then fall behind (~12k events/s). 1,000 is a step every ~7 s, still quick for RL.
    rollouts: int = 1000
    per_message: int = 200  # span records per container, as the bench's latency phase
    sample_s: float = 5.0
    max_lag_s: float = 30.0
    max_lag_growth_s: float = 5.0
    max_rss_growth_pct: float = 10.0
    exact: bool = True
    keep: bool = False

    @property
    def warmup_s(self) -> float:
        return 60.0 * (self.warmup_minutes if self.warmup_minutes is not None else min(2.0, self.minutes / 4))


def default_rate() -> tuple[float, str]:
    """Half the drain rate of the latest ``make bench`` on this machine, or half of DEFAULT_RATE's drain rate."""
    try:
        drain = json.loads((RESULTS / "latest.json").read_text()).get("e2e_events_per_s")
    except (OSError, ValueError):
        drain = None
    if drain:
        return drain / 2, f"half of the drain in {RESULTS / 'latest.json'} ({drain:,.0f} events/s)"
    return DEFAULT_RATE, "half of an earlier drain rate (no bench/results/latest.json)"


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its children now (VmRSS from /proc), in MiB; 0 when gone."""
    kib = 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    kib += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return round(kib / 1024, 1)


class LagClock:
    """Per group, the messages it has not committed yet, to tell the age of the oldest one."""

    def __init__(self, groups: tuple[str, ...]):
        self.waiting: dict[str, dict[TopicPartition, deque]] = {g: defaultdict(deque) for g in groups}

    def sent(self, sent: list[Sent]) -> None:
        for x in sorted(sent, key=lambda x: (x.tp, x.offset)):
            for queues in self.waiting.values():
                queues[x.tp].append((x.offset, x.time_ns))

    def lag_s(self, group: str, committed: dict[TopicPartition, int], now_ns: int) -> float:
        oldest = None
        for tp, queue in self.waiting[group].items():
            done = committed.get(tp, 0)
            while queue and queue[0][0] < done:
                queue.popleft()
            if queue and (oldest is None or queue[0][1] < oldest):
                oldest = queue[0][1]
        return 0.0 if oldest is None else round(max(now_ns - oldest, 0) / 1e9, 2)


async def live_load(settings: Settings, pipeline: Pipeline, config: SoakConfig, rate: float, truth: Truth,
                    progress: Progress) -> list[dict[str, Any]]:
    """Publish ``rate`` span events/s for ``config.minutes``; a sample of memory and lag every ``sample_s``."""
    live = LiveRuns(WorkloadConfig(project="soak", rollouts=config.rollouts), runs=config.runs, per_message=config.per_message)
    codec, streams, sink = Codec(), settings.app_id, settings.sink_group
    raw = (settings.topic("spans"), settings.topic("steps"))
    clock = LagClock((streams, sink))
    samples: list[dict[str, Any]] = []
    producer = AIOKafkaProducer(**producer_kwargs(settings))
    await producer.start()

    async def send(batch: list[Message]) -> int:
        sent: list[Sent] = []
        for m in batch:
            truth.add(m)
        await send_all(producer, settings, codec, batch, sent)
        clock.sent([x for x in sent if x.tp.topic in raw])
        return sum(x.records for x in sent if x.short == "spans")

    try:
        async with OffsetWatcher(settings, tuple(settings.topic(s) for s in SINK_TOPICS), (streams, sink)) as watch:
            await send(live.starts(time.time_ns()))
            t0 = time.monotonic()
            sent_events, next_sample, last_print = 0, t0, t0
            while (elapsed := time.monotonic() - t0) < config.minutes * 60:
                # At most a tenth of a second's worth at a time: a publisher that fell behind (a busy
                # machine) sends what it stamps at once, never a backlog stamped long before, which
                # the streams would rightly count as late; it reports the rate it achieved instead.
                batch: list[Message] = []
                queued = 0
                while sent_events + queued < rate * elapsed and queued < rate / 10:
                    for m in live.spans(time.time_ns()):
                        batch.append(m)
                        queued += len(m.records) if m.short == "spans" else 0
                sent_events += await send(batch)
                if time.monotonic() >= next_sample:
                    pipeline.check_alive()
                    s = await watch.sample()
                    now_ns = time.time_ns()
                    sample = {"t": round(s.t - t0, 1), "events": sent_events,
                              "rss_mib": {name: rss_mib(proc.pid) for name, proc in pipeline.procs.items()},
                              "lag_s": {"streams": clock.lag_s(streams, s.committed[streams], now_ns),
                                        "sink": clock.lag_s(sink, s.committed[sink], now_ns)},
                              "lag_messages": {"streams": s.lag(streams, raw), "sink": s.lag(sink, watch.topics)}}
                    samples.append(sample)
                    next_sample += config.sample_s
                    if s.t - last_print >= 30:
                        last_print = s.t
                        progress(f"soak: {sample['t']:5.0f}s {sent_events / max(sample['t'], 1e-9):,.0f} events/s, "
                                 f"RSS {sample['rss_mib']} MiB, lag {sample['lag_s']} s")
                # behind schedule: straight on (a fixed pause here capped the rate at ~17k events/s)
                await asyncio.sleep(max(0.0, min(0.05, (sent_events - rate * (time.monotonic() - t0)) / rate)))
            await send(live.ends(time.time_ns()))
    finally:
        await producer.stop()
    return samples


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y on x."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def judge(samples: list[dict[str, Any]], config: SoakConfig, rate: float) -> dict[str, Any]:
    """RSS growth, max lag and its trend after the warm-up, and whether each passes."""
    measured = [s for s in samples if s["t"] >= config.warmup_s]
    out: dict[str, Any] = {"warmup_s": config.warmup_s, "measured_samples": len(measured), "checks": {}}
    if len(measured) < 4:
        out["checks"]["enough_samples"] = False
        return out
    first, last = measured[0]["t"], measured[-1]["t"]
    edge = min(EDGE_S, (last - first) / 4)
    for name in samples[0]["rss_mib"]:
        start = _median([s["rss_mib"][name] for s in measured if s["t"] <= first + edge])
        end = _median([s["rss_mib"][name] for s in measured if s["t"] >= last - edge])
        growth = 100 * (end - start) / start if start else None
        out[f"{name}_rss_start_mib"], out[f"{name}_rss_end_mib"] = start, end
        out[f"{name}_rss_growth_pct"] = None if growth is None else round(growth, 1)
        out[f"{name}_rss_max_mib"] = max(s["rss_mib"][name] for s in measured)
        out["checks"][f"{name}_rss_growth"] = growth is not None and growth < config.max_rss_growth_pct
    achieved = (measured[-1]["events"] - measured[0]["events"]) / (last - first) if last > first else 0.0
    out["measured_events_per_s"] = round(achieved)
    out["checks"]["load_achieved"] = achieved >= 0.9 * rate  # else the figures describe a lighter load
    lags = [(s["t"], max(s["lag_s"].values())) for s in measured]
    out["max_lag_s"] = max(lag for _, lag in lags)
    out["max_lag_s_during_warmup"] = max((max(s["lag_s"].values()) for s in samples if s["t"] < config.warmup_s), default=None)
    out["median_lag_s"] = _median([lag for _, lag in lags])
    out["lag_growth_s"] = round(_slope(lags) * (last - first), 2)  # the trend line's rise over the measured part
    out["checks"]["max_lag"] = out["max_lag_s"] < config.max_lag_s
    out["checks"]["lag_not_trending_up"] = out["lag_growth_s"] < config.max_lag_growth_s
    return out


def run_soak(base: Settings, config: SoakConfig, progress: Progress) -> dict[str, Any]:
    rate, rate_basis = (config.rate, "--rate") if config.rate else default_rate()
    tmp = Path(tempfile.mkdtemp(prefix="rlpulse-soak-"))
    settings = dataclasses.replace(bench_settings(base, E2EConfig(), tmp / "clickhouse"),
                                   topic_prefix=f"soak{uuid.uuid4().hex[:8]}")
    log_dir = RESULTS / "soak-logs"
    shutil.rmtree(log_dir, ignore_errors=True)
    result: dict[str, Any] = {"config": dataclasses.asdict(config), "rate_events_per_s": rate, "rate_basis": rate_basis,
                              "topic_prefix": settings.topic_prefix, "window_s": settings.window,
                              "allowed_lateness_s": settings.allowed_lateness, "logs": str(log_dir)}
    truth = Truth()
    try:
        ensure_topics(settings)
        with Pipeline(settings, log_dir=log_dir) as pipeline:
            pipeline.start()
            with Ticker("soak: waiting for the streams and the sink to join their consumer groups", say=progress, every=10):
                wait_groups_ready(settings, (settings.app_id, settings.sink_group), pipeline)
            progress(f"soak: {config.minutes:g} min at {rate:,.0f} span events/s ({rate_basis}), "
                     f"{config.runs} live runs, warm-up {config.warmup_s:.0f}s; logs in {log_dir}")
            started = time.monotonic()
            samples = asyncio.run(live_load(settings, pipeline, config, rate, truth, progress))
            result["achieved_events_per_s"] = round(samples[-1]["events"] / samples[-1]["t"]) if samples else None
            progress("soak: load ended; waiting for the pipeline to catch up")
            caught = time.monotonic()
            with Ticker("soak: waiting for the pipeline to catch up", say=progress, every=10) as ticker:
                pipeline.wait_caught_up(time.time_ns() + int((settings.window + settings.allowed_lateness + 3) * 1e9),
                                        timeout=600, progress=lambda line: ticker.update(f"soak: {line}"))
            result["catch_up_after_load_s"] = round(time.monotonic() - caught, 1)
            result["seconds"] = round(time.monotonic() - started, 1)
            pipeline.stop()
        result.update(judge(samples, config, rate))
        result["truth"] = truth.summary()
        if config.exact:
            progress("soak: comparing ClickHouse with the truth")
            with Ticker("soak: comparing ClickHouse with the truth", say=progress, every=10):
                result.update(check_exact(settings, truth, "soak"))
            result["checks"]["exact"] = result["e2e_exact"]
        result["samples"] = samples
    except Exception as exc:  # the figures measured so far still go to soak.json, with the reason
        result["error"] = f"{type(exc).__name__}: {exc}"
        progress(f"soak failed: {result['error']}")
        show_log_tails(log_dir, progress)
    finally:
        if not config.keep:
            clean_up(settings, tmp, progress)
    result["passed"] = bool(result.get("checks")) and all(result["checks"].values())
    return result


def summary(r: dict[str, Any]) -> str:
    lines = [f"soak {'PASSED' if r['passed'] else 'FAILED'}: {r['config']['minutes']:g} min at "
             f"{r.get('achieved_events_per_s') or 0:,} span events/s (asked {r['rate_events_per_s']:,.0f}), "
             f"warm-up {r.get('warmup_s', 0):.0f}s"]
    if r.get("error"):
        lines.append(f"  error: {r['error']}")
    for name in ("streams", "sink"):
        if f"{name}_rss_start_mib" in r:
            lines.append(f"  {name:7} RSS {r[f'{name}_rss_start_mib']:.0f} -> {r[f'{name}_rss_end_mib']:.0f} MiB "
                         f"({r[f'{name}_rss_growth_pct']:+.1f}%, max {r[f'{name}_rss_max_mib']:.0f})")
    if "max_lag_s" in r:
        lines.append(f"  lag: max {r['max_lag_s']:.1f}s (median {r['median_lag_s']:.1f}s; "
                     f"{r['max_lag_s_during_warmup']}s in the warm-up), trend {r['lag_growth_s']:+.1f}s over the soak; "
                     f"caught up {r['catch_up_after_load_s']}s after the load")
    lines.append(f"  checks: {r.get('checks')}; exact: {r.get('exact_checks', 'not checked')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make soak", description=__doc__.split("\n\n")[0])
    d = SoakConfig()
    p.add_argument("--minutes", type=float, default=d.minutes, help="minutes of live load, warm-up included")
    p.add_argument("--warmup-minutes", type=float, default=None, help="not measured (default 2, or a quarter of a shorter soak)")
    p.add_argument("--rate", type=float, default=None, help="span events/s (default: half the latest bench drain, else 28,000)")
    p.add_argument("--runs", type=int, default=d.runs, help="live training runs publishing")
    p.add_argument("--rollouts", type=int, default=d.rollouts, help="rollouts per step of each run")
    p.add_argument("--max-lag-s", type=float, default=d.max_lag_s, help="lag bound, seconds of events")
    p.add_argument("--max-lag-growth-s", type=float, default=d.max_lag_growth_s,
                   help="rise of the lag's trend line over the soak")
    p.add_argument("--max-rss-growth-pct", type=float, default=d.max_rss_growth_pct, help="RSS growth after the warm-up")
    p.add_argument("--no-exact", action="store_true", help="skip comparing ClickHouse with the truth at the end")
    p.add_argument("--keep", action="store_true", help="keep the soak's topics and chDB store")
    args = p.parse_args(argv)
    config = SoakConfig(
        minutes=args.minutes,
        warmup_minutes=args.warmup_minutes,
        rate=args.rate,
        runs=args.runs,
        rollouts=args.rollouts,
        max_lag_s=args.max_lag_s,
        max_lag_growth_s=args.max_lag_growth_s,
        max_rss_growth_pct=args.max_rss_growth_pct,
        exact=not args.no_exact,
        keep=args.keep,
    )
    settings = Settings.load()
    if not services.broker_answers(settings.kafka_bootstrap, 10.0):
        print(f"make soak: no Kafka broker answers at {settings.kafka_bootstrap}: run `rlpulse services up` (make soak does)")
        return 1
    result = run_soak(settings, config, lambda line: print(line, flush=True))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "soak.json").write_text(json.dumps(result, indent=2, default=str))
    print(summary(result) + f"\nwritten to {RESULTS / 'soak.json'}", flush=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
