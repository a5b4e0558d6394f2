"""The SDK inside real training processes, against the real broker: forked workers, an interpreter
that exits with its telemetry open, many threads at once, and OpenTelemetry spans exported after
the telemetry closed. Each test reads its topics back and counts what arrived, per writer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any
from collections.abc import Callable

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from rlpulse.producers import TrainingTelemetry
from rlpulse.producers.sdk.sender import SenderConfig
from rlpulse.base.settings import Settings
from rlpulse.schemas.codec import Codec
from rlpulse.schemas.topics import read_topic

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[4]
CHILD_TIMEOUT_S = 60.0


def records(settings: Settings, short: str) -> list[dict[str, Any]]:
    """Every record of a topic, in the order the broker holds them (partition, offset, container)."""
    messages = asyncio.run(read_topic(settings.kafka_client_kwargs(), settings.topic(short)))
    codec = Codec()
    return [r for m in sorted(messages, key=lambda m: (m.partition, m.offset)) for r in codec.decode(m.value).records]


def by_writer(rows: list[dict[str, Any]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for r in rows:
        out[r["writer_id"]].append(r.get("writer_sequence") or r["sequence_id"])  # publish order
    return dict(out)


def child_env(settings: Settings, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "RLPULSE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
            "RLPULSE_TOPIC_PREFIX": settings.topic_prefix, "RLPULSE_PARTITIONS": str(settings.partitions),
            "RLPULSE_HEARTBEAT_INTERVAL": "1h", **extra}


EXITING_JOB = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
from rlpulse.producers import TrainingTelemetry
from rlpulse.producers.sdk.sender import SenderConfig
n, exit_timeout = int(sys.argv[1]), float(sys.argv[2])
tel = TrainingTelemetry(project="p", run_id="exits", sender_config=SenderConfig(exit_timeout_s=exit_timeout))
tel.start()
for i in range(n):
    tel.rollout(step=i // 100, rollout_id=f"r{i}", reward=0.5, term_shares={"judge": 0.5})
print(tel.writer_id, flush=True)
# no close(): the interpreter exits with the telemetry open
"""


def run_exiting_job(settings: Settings, n: int, exit_timeout: float, **env: str) -> tuple[str, str, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", EXITING_JOB, str(n), str(exit_timeout)], cwd=ROOT,
                          env=child_env(settings, **env), capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), done.stderr, elapsed


def test_an_interpreter_exiting_with_its_telemetry_open_delivers_the_buffer(settings: Settings) -> None:
    n = 5000
    writer, log, elapsed = run_exiting_job(settings, n, exit_timeout=10.0)
    spans, steps = records(settings, "spans"), records(settings, "steps")
    print(f"exit: {len(spans)} of {n} spans arrived; process lived {elapsed:.2f} s; {log.strip().splitlines()[-1]}")
    assert {r["writer_id"] for r in spans + steps} == {writer}
    assert [r["writer_sequence"] for r in spans] == list(range(1, n + 1))  # exactly N, each once, in order
    assert [r["rollout_id"] for r in spans[:2]] == ["r0", "r1"]
    assert [r["type"] for r in steps] == ["RUN_START"]  # no RUN_END: the SDK cannot tell an ending job from a dying one
    delivered = re.search(
        r"INFO rlpulse\.producers\.sdk\.process: rlpulse: delivered the (\d+) telemetry events buffered at exit", log
    )
    assert delivered and 0 < int(delivered.group(1)) <= n + 1, log
    assert "not delivered" not in log


def test_an_interpreter_exiting_while_the_broker_is_unreachable_gives_up_in_bounded_time_and_says_so(settings: Settings) -> None:
    n = 200
    _, log, elapsed = run_exiting_job(settings, n, exit_timeout=2.0, RLPULSE_KAFKA_BOOTSTRAP="127.0.0.1:9")
    print(f"exit with no broker: process lived {elapsed:.2f} s")
    assert elapsed < 2.0 + 8.0  # the bound, plus the interpreter's start and the producer's stop
    assert (
        f"WARNING rlpulse.producers.sdk.process: rlpulse: {n + 1} of {n + 1} telemetry events buffered at exit were not "
        f"delivered within 2 s"
    ) in log, log


# -- fork --------------------------------------------------------------------------------------
def worker(tel: TrainingTelemetry, name: str, n: int, done: Any) -> None:
    """A DataLoader-like worker: publishes through the writer it inherited, then returns (no flush, no close)."""
    for i in range(n):
        tel.rollout(step=1, rollout_id=f"{name}-{i}", reward=0.25, term_shares={"judge": 0.25})
        tel.grader(step=1, rollout_id=f"{name}-{i}", term="judge", outcome="ok" if i % 3 else "timeout", duration_s=0.2)
    done.put(tel.writer_id)


def in_forked_child(body: Callable[[], Any]) -> Any:
    """os.fork(); run ``body`` in the child, which reports through a pipe and leaves with os._exit."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(read_fd)
            out = json.dumps({"ok": body()})
        except BaseException as exc:
            out, code = json.dumps({"error": f"{type(exc).__name__}: {exc}"}), 1
        finally:
            try:
                os.write(write_fd, out.encode())
            finally:
                os._exit(code)
    os.close(write_fd)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child did not finish within {CHILD_TIMEOUT_S:.0f} s")
        time.sleep(0.01)
    with os.fdopen(read_fd) as pipe:
        report = json.loads(pipe.read() or '{"error": "no report"}')
    assert "error" not in report, report["error"]
    return report["ok"]


def test_forked_workers_publish_as_their_own_writers_and_everything_arrives(settings: Settings) -> None:
    per_worker, parent_before, parent_after = 400, 300, 300
    started = time.monotonic()
    ctx = multiprocessing.get_context("fork")
    with TrainingTelemetry(project="p", run_id="forks", settings=settings) as tel:
        for i in range(parent_before):
            tel.rollout(step=0, rollout_id=f"parent-{i}", reward=0.5, term_shares={"judge": 0.5})
        tel.step_completed(step=0, tokens=100, duration_s=1.0)
        done = ctx.Queue()
        workers = [ctx.Process(target=worker, args=(tel, f"w{k}", per_worker, done)) for k in range(2)]
        for w in workers:
            w.start()

        def plain_fork_child() -> str:  # leaves by os._exit: it must flush first
            for i in range(per_worker):
                tel.rollout(step=1, rollout_id=f"os-{i}", reward=0.75)
            assert tel.flush(30) == 0
            return tel.writer_id

        forked = in_forked_child(plain_fork_child)
        for i in range(parent_after):  # the parent goes on publishing meanwhile
            tel.rollout(step=1, rollout_id=f"parent-{parent_before + i}", reward=0.5)
        worker_ids = [done.get(timeout=CHILD_TIMEOUT_S) for _ in workers]
        for w in workers:
            w.join(CHILD_TIMEOUT_S)
            assert w.exitcode == 0
        tel.step_completed(step=1, tokens=100, duration_s=1.0)
    spans, steps = records(settings, "spans"), records(settings, "steps")
    elapsed = time.monotonic() - started
    span_ids, step_ids = by_writer(spans), by_writer(steps)
    writers = [tel.writer_id, forked, *worker_ids]
    print(
        f"fork: {len(spans)} spans from {len(span_ids)} writers in {elapsed:.2f} s: "
        + ", ".join(f"{w}: {len(span_ids.get(w, []))}" for w in writers)
    )
    assert len(set(writers)) == 4  # each child a writer of its own
    assert set(span_ids) == set(writers)
    expected = {
        tel.writer_id: parent_before + parent_after,
        forked: per_worker,
        worker_ids[0]: 2 * per_worker,
        worker_ids[1]: 2 * per_worker,
    }
    for w, n in expected.items():  # every event once, numbered 1..n per writer, in order
        assert span_ids[w] == list(range(1, n + 1)), (w, len(span_ids[w]))
    # only the parent ran the run: RUN_START, its steps and RUN_END naming its own last span
    assert set(step_ids) == {tel.writer_id} and step_ids[tel.writer_id] == [1, 2, 3, 4]
    assert [r["type"] for r in steps] == ["RUN_START", "STEP", "STEP", "RUN_END"]
    assert steps[-1]["spans_sent"] == parent_before + parent_after
    for w in worker_ids:  # a worker's writer carries that worker's events only
        assert len({r["rollout_id"].split("-")[0] for r in spans if r["writer_id"] == w}) == 1


def test_a_fork_while_another_thread_holds_the_queue_lock_does_not_deadlock_the_child(settings: Settings) -> None:
    with TrainingTelemetry(project="p", run_id="locked", settings=settings) as tel:
        assert tel.flush(30) == 0
        taken, release = threading.Event(), threading.Event()

        def hold() -> None:
            with tel.sender.queue._lock, tel._step_lock:
                taken.set()
                release.wait(60)

        holder = threading.Thread(target=hold)
        holder.start()
        assert taken.wait(10)
        try:

            def child() -> list[Any]:
                began = time.monotonic()
                for i in range(100):
                    tel.rollout(step=0, rollout_id=f"c{i}", reward=0.5)
                tel.step_completed(step=0)
                return [tel.writer_id, tel.flush(30), time.monotonic() - began]

            child_writer, left, took = in_forked_child(child)
        finally:
            release.set()
            holder.join()
    print(f"fork under a held lock: the child published and delivered 101 events in {took:.2f} s")
    assert left == 0 and child_writer != tel.writer_id
    spans, steps = by_writer(records(settings, "spans")), by_writer(records(settings, "steps"))
    assert spans == {child_writer: list(range(1, 101))}
    assert steps == {tel.writer_id: [1, 2], child_writer: [1]}


# -- threads -----------------------------------------------------------------------------------
def test_many_threads_at_once_every_event_arrives_once_with_unique_sequence_ids(settings: Settings) -> None:
    threads, per_thread = 8, 1500
    started = time.monotonic()
    with TrainingTelemetry(
        project="p", run_id="threads", settings=settings, sender_config=SenderConfig(batch_records=500)
    ) as tel:
        go = threading.Barrier(threads)

        def work(t: int) -> None:
            go.wait()
            for i in range(per_thread):
                tel.rollout(step=i // 100, rollout_id=f"t{t}-{i}", reward=0.5, term_shares={"judge": 0.5})
                tel.grader(step=i // 100, rollout_id=f"t{t}-{i}", term="judge", outcome="ok", duration_s=0.1)
                if i % 100 == 99:
                    tel.step_completed(step=i // 100)

        pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
    assert tel.dropped == 0 and tel.pending == 0
    spans, steps = records(settings, "spans"), records(settings, "steps")
    elapsed = time.monotonic() - started
    n_spans, n_steps = threads * per_thread * 2, threads * (per_thread // 100) + 2
    print(f"threads: {len(spans)} of {n_spans} spans and {len(steps)} of {n_steps} steps arrived in {elapsed:.2f} s")
    assert [r["writer_sequence"] for r in spans] == list(range(1, n_spans + 1))  # unique, no gap, in order
    assert [r["sequence_id"] for r in steps] == list(range(1, n_steps + 1))
    assert len({(r["rollout_id"], r["kind"]) for r in spans}) == n_spans
    assert steps[-1]["type"] == "RUN_END" and steps[-1]["step_count"] == threads * (per_thread // 100)


# -- OpenTelemetry spans exported after the telemetry closed -------------------------------------
def test_spans_a_batch_processor_exports_after_the_block_are_delivered_and_bad_ones_counted(settings: Settings) -> None:
    provider = TracerProvider(shutdown_on_exit=False)
    with TrainingTelemetry(project="p", run_id="late", settings=settings) as tel:
        exporter = tel.span_exporter()
        # a long delay: the processor holds every span until force_flush() or shutdown(), after the block
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=600_000))
        tracer = provider.get_tracer("agent")
        for i in range(30):
            with tracer.start_as_current_span(f"llm{i}", attributes={"rlpulse.kind": "LLM", "rlpulse.rollout_id": f"r{i}"}):
                pass
        with tracer.start_as_current_span("reward", attributes={"rlpulse.kind": "REWARD", "rlpulse.reward": float("nan")}):
            pass
    assert not tel.sender.running  # closed: RUN_END sent, the sender thread stopped
    assert provider.force_flush()  # exports the 31 spans now, to the closed telemetry
    for i in range(30, 50):
        with tracer.start_as_current_span(f"llm{i}", attributes={"rlpulse.kind": "LLM", "rlpulse.rollout_id": f"r{i}"}):
            pass
    provider.shutdown()  # exports the last 20 and flushes
    assert exporter.refused == 1 and tel.pending == 0 and tel.dropped == 0
    spans, steps = records(settings, "spans"), records(settings, "steps")
    print(f"late spans: {len(spans)} of 50 delivered after close, {exporter.refused} refused (NaN reward)")
    assert [r["name"] for r in spans] == [f"llm{i}" for i in range(50)]  # the NaN one never reaches the streams
    assert [r["writer_sequence"] for r in spans] == list(range(1, 51))
    assert [(r["type"], r["spans_sent"]) for r in steps] == [("RUN_START", 0), ("RUN_END", 0)]


def test_events_a_close_could_not_deliver_go_out_with_the_next_flush(settings: Settings) -> None:
    unreachable = dataclasses.replace(settings, kafka_bootstrap="127.0.0.1:9")
    tel = TrainingTelemetry(project="p", run_id="left", settings=unreachable)
    tel.start()
    for i in range(10):
        tel.rollout(step=0, rollout_id=f"r{i}", reward=0.5)
    assert tel.close(1.0) == 12  # RUN_START, 10 rollouts, RUN_END: kept, not dropped
    assert tel.pending == 12 and not tel.sender.running
    tel.sender.transport.settings = settings  # the broker is reachable again (here: at the address it always had)
    assert tel.flush(30) == 0  # a thread starts again for what was left
    assert [r["rollout_id"] for r in records(settings, "spans")] == [f"r{i}" for i in range(10)]
    assert [r["type"] for r in records(settings, "steps")] == ["RUN_START", "RUN_END"]


TRACED_JOB = """
import sys
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from rlpulse.producers import TrainingTelemetry
with TrainingTelemetry(project="p", run_id="traced") as tel:
    provider = TracerProvider()  # its own atexit hook shuts it down: the processor exports then
    provider.add_span_processor(BatchSpanProcessor(tel.span_exporter(), schedule_delay_millis=600_000))
    tracer = provider.get_tracer("agent")
    for i in range(int(sys.argv[1])):
        with tracer.start_as_current_span(f"llm{i}", attributes={"rlpulse.kind": "LLM"}):
            pass
print(tel.writer_id, flush=True)
# the job never calls provider.shutdown(): its spans are exported at interpreter exit, after the block
"""


def test_spans_the_tracer_provider_exports_at_interpreter_exit_after_the_block_are_delivered(settings: Settings) -> None:
    n = 40
    done = subprocess.run(
        [sys.executable, "-c", TRACED_JOB, str(n)],
        cwd=ROOT,
        env=child_env(settings),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    spans, steps = records(settings, "spans"), records(settings, "steps")
    assert {r["writer_id"] for r in spans + steps} == {done.stdout.strip()}
    assert [r["name"] for r in spans] == [f"llm{i}" for i in range(n)]
    assert [r["type"] for r in steps] == ["RUN_START", "RUN_END"]
