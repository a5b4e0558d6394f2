"""The SDK's writers across the life of their process: ``os.fork()`` and interpreter exit.

**Fork** (DataLoader workers, ``torch.multiprocessing`` or ``multiprocessing`` with the fork
start method, a plain ``os.fork()``). The child holds copies of the parent's writers, whose
sender threads did not survive the fork. An ``os.register_at_fork`` hook renews every live
writer in the child, as OpenTelemetry's ``BatchSpanProcessor`` renews its worker: a new
``writer_id``, an empty queue (the parent's queued events are the parent's to send), new locks,
and a sender thread started by the child's first event. The SDK's own locks are made anew in
the child rather than taken before the fork (the ``before``/``after_in_*`` pattern CPython's
logging uses for its module lock): taking them would make every fork wait for a sender that is
mid-delivery and order our locks against the application's, and the child needs nothing they
guard, since it keeps no queued event and restarts its sequences under its new ``writer_id``.
So a lock of ours that another thread held at the fork cannot deadlock the child. See
``TrainingTelemetry`` for what a child writer publishes.

The exception is logging. A stream's own buffer lock is renewed by no hook: a sender thread
writing a log line (the broker is down, it retries and says so) at the moment another thread
forks leaves that lock held in the child, whose next line to that stream then hangs forever.
So while a sender thread runs, a ``before`` hook takes logging's module lock and each handler's
lock (each wait bounded by ``LOCK_WAIT_S``), which no writer holds mid-line: the parent releases
them after the fork, and in the child logging's own hook renews them.

**Exit.** Sender threads are daemons: an interpreter that exits with a writer still open would
stop them with the buffer undelivered. An ``atexit`` handler (and, in a ``multiprocessing``
child, which leaves through ``os._exit`` and skips ``atexit``, a ``multiprocessing.util.Finalize``)
stops the heartbeats, then delivers what each running sender holds, each bounded by its
``SenderConfig.exit_timeout_s`` (10 s by default) from the start of the handler, and logs what
it delivered and what it could not. It sends no RUN_END: the SDK cannot tell a job that ended
from one that is dying on an exception, and a missing RUN_END is what lets the streams call a
job that died silent.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any

log = logging.getLogger(__name__)

_live: weakref.WeakSet[Any] = weakref.WeakSet()  # this process's senders and TrainingTelemetry objects
# In a forked child: the parent's event loops, producers and queues, kept from the garbage collector.
# Collecting them would close the parent's loop, which unregisters the parent's sockets from the
# epoll instance both processes share after a fork.
_inherited: list[Any] = []
_finalizer_pid = 0  # the process in which a multiprocessing finalizer is registered
_held = threading.local()  # the logging locks the forking thread holds across its fork
LOCK_WAIT_S = 0.5  # how long a fork waits for one logging handler to be free (then forks without it)


def track(obj: Any) -> None:
    """Renew ``obj`` in a forked child (``obj._after_fork_in_child()``) and let it act at exit."""
    _live.add(obj)


def keep_inherited(objects: Any) -> None:
    _inherited.append(objects)


def _before_fork() -> None:
    _held.locks = []
    if not any(getattr(obj, "running", False) for obj in list(_live)):
        return  # none of our threads runs: nothing of ours can be mid-write
    # logging's module lock first, as logging.config takes it before a handler's (same order: no deadlock)
    locks = [getattr(logging, "_lock", None)]
    loggers = [logging.getLogger()] + [x for x in list(logging.Logger.manager.loggerDict.values())
                                       if isinstance(x, logging.Logger)]
    seen: set[int] = set()
    for lg in loggers:
        for handler in list(lg.handlers):
            if id(handler) not in seen and handler.lock is not None:
                seen.add(id(handler))
                locks.append(handler.lock)
    for lock in locks:
        try:
            if lock is not None and lock.acquire(timeout=LOCK_WAIT_S):
                _held.locks.append(lock)
        except Exception:  # a handler with an unusual lock: fork without holding it
            pass


def _release_held() -> None:
    for lock in reversed(getattr(_held, "locks", ())):
        try:
            lock.release()
        except RuntimeError:  # in the child: logging's own hook already made it anew, unlocked
            pass
    _held.locks = []


def _after_fork_in_child() -> None:
    _release_held()
    for obj in list(_live):
        try:
            obj._after_fork_in_child()
        except Exception:  # a fork hook must not raise: the child would go on with a half-renewed writer
            log.exception("rlpulse: could not renew %r in the forked child", obj)


def on_sender_started() -> None:
    """A sender thread started: in a ``multiprocessing`` child make sure its exit delivers too."""
    global _finalizer_pid
    pid = os.getpid()
    if _finalizer_pid == pid:
        return
    _finalizer_pid = pid
    mp_process, mp_util = sys.modules.get("multiprocessing.process"), sys.modules.get("multiprocessing.util")
    if mp_process is not None and mp_util is not None and mp_process.parent_process() is not None:
        # A forked multiprocessing child ends in os._exit after running these finalizers, never atexit.
        mp_util.Finalize(None, deliver_at_exit, exitpriority=10)


def deliver_at_exit() -> None:
    """Stop the heartbeats, deliver what the running senders of this process hold (bounded), log the outcome."""
    started = time.monotonic()
    objects = list(_live)
    for obj in objects:
        stop = getattr(obj, "_stop_at_exit", None)
        if stop is not None:
            stop()
    buffered = undelivered = 0
    bound = 0.0
    for obj in objects:
        deliver = getattr(obj, "_deliver_at_exit", None)
        if deliver is None:
            continue
        try:
            outcome = deliver(started + obj.config.exit_timeout_s)
        except Exception:
            log.exception("rlpulse: telemetry not delivered at exit")
            continue
        if outcome is not None:
            buffered, undelivered = buffered + outcome[0], undelivered + outcome[1]
            bound = max(bound, obj.config.exit_timeout_s)
    if undelivered:
        log.warning("rlpulse: %d of %d telemetry events buffered at exit were not delivered within %.0f s "
                    "(SenderConfig.exit_timeout_s); they are lost", undelivered, buffered, bound)
    elif buffered:
        log.info("rlpulse: delivered the %d telemetry events buffered at exit in %.2f s", buffered,
                 time.monotonic() - started)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_release_held, after_in_child=_after_fork_in_child)
atexit.register(deliver_at_exit)


def run_status(exc_type: type[BaseException] | None) -> str:
    """RUN_END's status for a block left with ``exc_type``: none finished it; an interrupt (Ctrl-C,
    a cancelled task, SystemExit as a scheduler's SIGTERM handler raises it) cancelled it; any
    other exception failed it."""
    if exc_type is None:
        return "finished"
    if issubclass(exc_type, (KeyboardInterrupt, SystemExit, asyncio.CancelledError)):
        return "cancelled"
    return "failed"
