"""A writer copied into a forked child, without a broker: its own writer_id, an empty queue with
sequences from 1, no RUN_START/RUN_END, and no deadlock on a lock another thread held at the fork.

Each child reports through a pipe and leaves with ``os._exit`` (never back into pytest).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any
from collections.abc import Callable

import pytest

from rlpulse.producers import TrainingTelemetry
from rlpulse.producers.sdk.sender import SenderConfig
from rlpulse.base.settings import Settings

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
SETTINGS = Settings.load({"RLPULSE_TOPIC_PREFIX": "fork", "RLPULSE_HEARTBEAT_INTERVAL": "1h"})
CHILD_TIMEOUT_S = 20.0


def in_child(body: Callable[[], Any]) -> Any:
    """Fork; run ``body`` in the child and return what it returned (JSON), failing if it hangs."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 0
        try:
            os.close(read_fd)
            out = json.dumps({"ok": body()})
        except BaseException as exc:  # reported to the parent
            out, code = json.dumps({"error": f"{type(exc).__name__}: {exc}"}), 1
        finally:
            try:
                os.write(write_fd, out.encode())
            finally:
                os._exit(code)
    os.close(write_fd)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            os.close(read_fd)
            pytest.fail(f"the forked child did not finish within {CHILD_TIMEOUT_S:.0f} s (deadlock?)")
        time.sleep(0.01)
    with os.fdopen(read_fd) as pipe:
        report = json.loads(pipe.read() or '{"error": "no report"}')
    assert "error" not in report, report["error"]
    return report["ok"]


def queued(tel: TrainingTelemetry) -> list[list[Any]]:
    return [[topic, r["writer_id"], r.get("writer_sequence") or r["sequence_id"], r.get("type") or r.get("rollout_id")]
            for topic, _, r in tel.sender.queued_records()]


def test_the_child_writes_as_a_new_writer_from_an_empty_queue():
    tel = TrainingTelemetry(project="p", run_id="r", settings=SETTINGS)  # never started: queues only
    for i in range(3):
        tel.rollout(step=0, rollout_id=f"parent{i}", reward=0.5, term_shares={"judge": 0.5})
    tel.step_completed(step=0)

    def child() -> dict[str, Any]:
        before = queued(tel)
        tel.rollout(step=1, rollout_id="child0", reward=0.25, term_shares={"judge": 0.25})  # a term the parent declared
        tel.grader(step=1, rollout_id="child0", term="judge", outcome="ok", duration_s=0.1)
        tel.step_completed(step=1)
        return {"writer_id": tel.writer_id, "before": before, "after": queued(tel), "step_count": tel.step_count,
                "pending": tel.pending}

    got = in_child(child)
    assert got["writer_id"] != tel.writer_id and len(got["writer_id"]) == 16
    assert got["before"] == []  # the parent's queued events stay the parent's to send
    w = got["writer_id"]
    assert got["after"] == [["fork.spans", w, 1, "child0"], ["fork.spans", w, 2, "child0"], ["fork.steps", w, 1, "STEP"]]
    assert got["step_count"] == 2 and got["pending"] == 3  # step_count carried over; counters the child's own
    # the parent is untouched: its 4 events, its ids
    assert [(q[1], q[2]) for q in queued(tel)] == [(tel.writer_id, 1), (tel.writer_id, 2), (tel.writer_id, 3),
                                                   (tel.writer_id, 1)]
    assert tel.pending == 4


def test_a_forked_worker_publishes_no_run_start_or_run_end():
    # An unreachable broker: the parent's sender thread runs (and retries); nothing needs to arrive here.
    settings = Settings.load({"RLPULSE_TOPIC_PREFIX": "fork", "RLPULSE_KAFKA_BOOTSTRAP": "127.0.0.1:9",
                              "RLPULSE_HEARTBEAT_INTERVAL": "1h"})
    tel = TrainingTelemetry(project="p", run_id="r", settings=settings)
    tel.start()
    try:
        def child() -> dict[str, Any]:
            tel.rollout(step=0, rollout_id="w", reward=0.5)
            left = tel.close(0.2)  # the worker's close: delivers (here: cannot), publishes no RUN_END
            return {"left": left, "heartbeat": tel._heartbeat_thread is not None}

        got = in_child(child)
        assert got == {"left": 1, "heartbeat": False}  # just its rollout: no RUN_END joined it
    finally:
        assert tel.close(0.2) == 2  # the parent's RUN_START and RUN_END


@pytest.mark.parametrize("lock", ["queue", "steps", "terms", "flush"])
def test_a_lock_held_by_another_thread_at_the_fork_does_not_deadlock_the_child(lock):
    settings = Settings.load({"RLPULSE_TOPIC_PREFIX": "fork", "RLPULSE_KAFKA_BOOTSTRAP": "127.0.0.1:9",
                              "RLPULSE_HEARTBEAT_INTERVAL": "1h"})
    tel = TrainingTelemetry(project="p", run_id="r", settings=settings, sender_config=SenderConfig(exit_timeout_s=0.5))
    tel.start()
    held = {"queue": tel.sender.queue._lock, "steps": tel._step_lock, "terms": tel._terms_lock,
            "flush": tel.sender._flush_lock}[lock]
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with held:
            taken.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(5)
    try:
        def child() -> dict[str, Any]:
            tel.rollout(step=0, rollout_id="c", reward=0.5, term_shares={"new-term": 0.5})
            tel.grader(step=0, rollout_id="c", term="other-term", outcome="ok", duration_s=0.1)
            tel.step_completed(step=0)
            tel.heartbeat()
            left = tel.flush(0.2)  # the broker is unreachable: returns at its timeout, never hangs
            return {"pending": tel.pending, "left": left, "sender": tel.sender.running}

        got = in_child(child)
        assert got == {"pending": 4, "left": 4, "sender": True}  # its own sender thread started for them
    finally:
        release.set()
        holder.join()
        tel.close(0.2)


class SlowStream(logging.Handler):
    """A handler whose writes hold a lock of their own (as a stream's buffer does) for a while."""

    def __init__(self) -> None:
        super().__init__()
        self.buffer_lock = threading.Lock()  # like io.BufferedWriter's: no fork hook renews it
        self.lines = 0

    def emit(self, record: logging.LogRecord) -> None:
        with self.buffer_lock:
            time.sleep(0.02)
            self.lines += 1


def test_a_fork_while_a_thread_is_writing_a_log_line_does_not_hang_the_childs_next_line():
    settings = Settings.load({"RLPULSE_TOPIC_PREFIX": "fork", "RLPULSE_KAFKA_BOOTSTRAP": "127.0.0.1:9",
                              "RLPULSE_HEARTBEAT_INTERVAL": "1h"})
    tel = TrainingTelemetry(project="p", run_id="r", settings=settings)
    tel.start()  # a sender thread runs (and logs its retries): the fork waits for the handlers
    handler = SlowStream()
    logger = logging.getLogger("tests.fork.chatty")
    logger.addHandler(handler)
    logger.propagate = False
    stop = threading.Event()

    def chatter() -> None:  # busy in emit (holding buffer_lock) almost all the time
        while not stop.is_set():
            logger.warning("retrying")

    thread = threading.Thread(target=chatter)
    thread.start()
    try:
        for _ in range(5):
            time.sleep(0.013)
            assert in_child(lambda: (logger.warning("from the child"), handler.lines)[1]) > 0
    finally:
        stop.set()
        thread.join()
        logger.removeHandler(handler)
        tel.close(0.2)
