"""``make bench`` / ``rlpulse bench``: the performance figures and their targets (docs/performance.md), side by side in one run.

SDK call cost and SDK-to-Kafka throughput (bench/sdk.py), Kafka's own producer and consumer
ceilings from the broker's jars, a backlog of about a million events of 1,000 concurrent runs
drained through ``rlpulse streams`` and ``rlpulse sink`` with the figures checked against the
truth, event-to-row latency at half that rate, peak memory and a profile of each process.

Prints a table and writes bench/results/latest.json and a timestamped copy (or both under
``--output DIR``). The broker is the settings' (``RLPULSE_KAFKA_*``, TLS and SASL included).
This machine is shared and noisy: compare the ratios measured in one run, not absolute numbers
across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The home is the checkout's .rlpulse (rlpulse.base.files picks it for a checkout's rlpulse): the
# broker `make services-up` started.

from bench.compare import compare, load_baseline, table  # noqa: E402
from bench.drain import DrainConfig  # noqa: E402
from bench.e2e import E2EConfig, delete_topics, run_e2e  # noqa: E402
from bench.options import REPS, add_arguments  # noqa: E402
from bench.stats import ratio  # noqa: E402
from bench.workload import WorkloadConfig  # noqa: E402
from rlpulse import services  # noqa: E402
from rlpulse.progress import Ticker  # noqa: E402
from rlpulse.base.settings import Settings  # noqa: E402

RESULTS = ROOT / "bench" / "results"
BASELINE = RESULTS / "baseline.json"  # committed: every run is compared with it (bench/compare.py)
MANY_TOPICS = 500  # a broker holding more is said to (see broker_topics)
SDK_KEYS = ("sdk_call_ns_median", "sdk_call_ns_p99", "sdk_floor_ns_median", "producer_events_per_s",
            "sdk_call_ns_median_broker_down", "sdk_call_ns_p99_broker_down")

def _say(text: str) -> None:
    print(text, flush=True)


def sdk_figures(settings: Settings, repetitions: int = REPS) -> dict[str, Any]:
    """bench/sdk.py's figures (its owner keeps them); a failure is recorded, not fatal."""
    out: dict[str, Any] = {}
    try:
        from bench import sdk
    except ImportError as exc:
        return {"errors": {"sdk": f"bench/sdk.py could not be imported: {exc}"}}
    # three repetitions of SDK-to-broker too (one with --smoke): the design asks for medians
    for name, call in (("sdk_call", lambda: sdk.measure_sdk_call()),
                       ("sdk_call_broker_down", lambda: sdk.measure_sdk_call_broker_down()),
                       ("sdk_to_kafka", lambda: sdk.measure_sdk_to_kafka(settings, repetitions=repetitions))):
        try:
            _say(f"sdk: {name} ...")
            with Ticker(f"sdk: {name} running", say=_say, every=10):
                out.update(call())
        except Exception as exc:
            out.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
            _say(traceback.format_exc(limit=4))
    return out


def ui_figures_or_error(settings: Settings, errors: dict[str, str]) -> dict[str, Any]:
    """rlpulse ui's answer times for 8 runs of 1,000 steps x 512 rollouts (bench/ui_bench.py); a failure, and each
    page that did not answer 200, is recorded."""
    try:
        from bench.ui_bench import ui_figures

        _say("ui: loading 8 runs of 1,000 steps x 512 rollouts into a store and timing each page ...")
        with Ticker("ui: loading and timing the pages", say=_say, every=10):
            figures = ui_figures(settings)
        for page, why in figures.get("ui_failed_pages", {}).items():
            errors[f"ui {page}"] = why
        if figures.get("ui_note"):
            _say(f"ui: {figures['ui_note']}")
        return figures
    except Exception as exc:
        errors["ui"] = f"{type(exc).__name__}: {exc}"
        _say(traceback.format_exc(limit=4))
        return {}


def add_ratios(r: dict[str, Any]) -> None:
    r["sdk_call_over_floor"] = ratio(r.get("sdk_call_ns_median"), r.get("sdk_floor_ns_median"))
    r["producer_over_ceiling"] = ratio(r.get("producer_events_per_s"), r.get("producer_ceiling_events_per_s"))
    r["e2e_over_consumer_ceiling"] = ratio(r.get("e2e_events_per_s"), r.get("consumer_ceiling_events_per_s"))


def _git_commit() -> str | None:
    run = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return run.stdout.strip() or None


def broker_topics(settings: Settings) -> int | None:
    """How many topics the broker holds: every client's metadata fetch carries them all, so start-up
    and latency on a broker holding thousands (a test suite's leftovers) are not comparable with a
    fresh one's. None when it cannot be listed."""
    from aiokafka.admin import AIOKafkaAdminClient

    async def count() -> int:
        admin = AIOKafkaAdminClient(**settings.kafka_client_kwargs())
        await admin.start()
        try:
            return len(await admin.list_topics())
        finally:
            await admin.close()

    try:
        return asyncio.run(count())
    except Exception:  # a figure beside the others, never a reason not to measure
        return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="make bench", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = Settings.load()
    try:
        services.require_broker(settings)  # with the settings' TLS and SASL; a refusal is said in one line
    except services.ServicesError as exc:
        _say(f"make bench: {exc}")
        return 1
    results_dir = Path(args.output).resolve() if args.output else RESULTS
    started = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    results_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
                               "git_commit": _git_commit(), "cpus": os.cpu_count(), "python": platform.python_version(),
                               "kafka_bootstrap": settings.kafka_bootstrap,
                               "kafka_security_protocol": settings.kafka_security_protocol,
                               "broker_topics": broker_topics(settings), "errors": {}}
    if (results["broker_topics"] or 0) > MANY_TOPICS:
        _say(f"make bench: the broker holds {results['broker_topics']:,} topics; start-up and latency are slower than on "
             "a fresh broker's (compare runs on brokers holding alike)")
    results.update({k: None for k in SDK_KEYS})
    if not args.skip_sdk and not args.quick:
        sdk = sdk_figures(settings, repetitions=1 if args.smoke else REPS)
        results["errors"].update(sdk.pop("errors", {}))
        results.update(sdk)
        if not args.keep:  # bench/sdk.py's topics (under <prefix>-sdkbench-): give the broker's disk back
            asyncio.run(delete_topics(settings, (f"{settings.topic_prefix}-sdkbench-",)))
    if not args.skip_e2e:
        # --quick: the same 1,000-run backlog drained once, no ceilings, no profile, 5 s of latency;
        # --smoke: every phase once on 50 runs
        workload = WorkloadConfig(runs=50 if args.smoke else args.runs)
        short = args.quick or args.smoke
        latency_s = args.latency_s if args.latency_s is not None else 5.0 if short else 20.0
        config = E2EConfig(workload=workload, latency_s=latency_s, keep=args.keep,
                           reps=1 if short else args.reps,
                           ceiling_reps=0 if args.quick else 1 if args.smoke else REPS,
                           consumer_reps=0 if args.quick else 1 if args.smoke else 2,
                           drain=DrainConfig(timeout_s=args.drain_timeout,
                                             profile_s=0 if args.no_profile or args.quick else 15.0))
        e2e = run_e2e(settings, config, results_dir, _say)
        results["errors"].update(e2e.pop("errors", {}))
        results.update(e2e)
        results["e2e_config"] = {"workload": dataclasses.asdict(workload), "drain": {
            k: v for k, v in dataclasses.asdict(config.drain).items() if k != "profile_dir"}}
    if not (args.skip_ui or args.quick or args.smoke):
        results.update(ui_figures_or_error(settings, results["errors"]))
    add_ratios(results)
    results["seconds"] = round(time.time() - started, 1)
    text = json.dumps(results, indent=2, default=str)
    (results_dir / "latest.json").write_text(text)
    (results_dir / f"{stamp}.json").write_text(text)
    for name in ("streams", "sink"):
        top = results.get(f"profile_{name}_top")
        if top:
            _say(f"\nprofile of rlpulse {name} ({results_dir / f'profile-{name}.txt'}):\n" + "\n".join(top[:16]))
    baseline = load_baseline(BASELINE)
    if baseline is not None:
        results["vs_baseline"] = compare(results, baseline)
        results["baseline_commit"] = baseline.get("git_commit")
        (results_dir / "latest.json").write_text(json.dumps(results, indent=2, default=str))
    _say("\n" + table(results, results.get("vs_baseline"), results.get("baseline_commit")))
    if args.save_baseline:
        BASELINE.write_text(json.dumps(results, indent=2, default=str))
        _say(f"saved as the baseline: {BASELINE} (commit it)")
    for what, why in results["errors"].items():
        _say(f"not measured or failed: {what}: {why}")
    _say(f"\n{results['seconds']:.0f}s; written to {results_dir / 'latest.json'} and {results_dir / (stamp + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
