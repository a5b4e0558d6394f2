"""The SDK's writers across the life of their process: ``os.fork()`` and interpreter exit.

**Fork** (DataLoader workers, ``torch.multiprocessing`` or ``multiprocessing`` with the fork
start method, a plain ``os.fork()``). The child holds copies of the parent's writers, whose
sender threads did not survive the fork. An ``os.register_at_fork`` hook renews every live
writer in the child, as OpenTelemetry's ``BatchSpanProcessor`` renews its worker: a new
``writer_id``, an empty queue (the parent's queued events are the parent's to send), new locks,
and a sender thread started by the child's first event. Locks are made anew in the child, never
taken before the fork (``before=``/``after_in_*`` hooks, as CPython's logging does): taking them
in ``before`` would make every fork wait for a sender that is mid-delivery and order our locks
against the application's, and the child needs nothing they guard, since it keeps no queued
event and restarts its sequences under its new ``writer_id``. So a lock another thread held at
the fork cannot deadlock the child. See ``TrainingTelemetry`` for what a child writer publishes.

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

import atexit
import logging
import os
import sys
import time
import weakref
from typing import Any

log = logging.getLogger(__name__)

_live: "weakref.WeakSet[Any]" = weakref.WeakSet()  # this process's senders and TrainingTelemetry objects
# In a forked child: the parent's event loops, producers and queues, kept from the garbage collector.
# Collecting them would close the parent's loop, which unregisters the parent's sockets from the
# epoll instance both processes share after a fork.
_inherited: list[Any] = []
_finalizer_pid = 0  # the process in which a multiprocessing finalizer is registered


def track(obj: Any) -> None:
    """Renew ``obj`` in a forked child (``obj._after_fork_in_child()``) and let it act at exit."""
    _live.add(obj)


def keep_inherited(objects: Any) -> None:
    _inherited.append(objects)


def _after_fork_in_child() -> None:
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
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(deliver_at_exit)
