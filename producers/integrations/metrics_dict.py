"""A trainer's per-step metrics dict, published through ``TrainingTelemetry``.

Most RL frameworks hand their loggers one ``{name: value}`` dict per step (verl's ``Tracking``,
OpenRLHF's ``logs_dict``, SkyRL, NeMo-RL's ``LoggerInterface``, slime, AReaL). This module turns
such a dict into what the SDK accepts and publishes it, so each integration only says which
call is a step and which key holds its duration:

    publisher = MetricsPublisher(tel)
    publisher.step(step, metrics_dict)        # a training step: STEP, counted once
    publisher.scalars(step, validation_dict)  # other figures of a step: METRICS

A trainer's own dict holds things the SDK refuses: strings, lists, tensors, ``None``, NaN, names
over ``MAX_NAME`` characters or outside ASCII, more than ``MAX_METRICS`` names. A logging hook
must not take a training run down over one of them, and must not lose figures silently: each is
converted, renamed or skipped here, counted by reason in ``skipped`` and logged (the first time
a name is met for a reason, then counted only), with a summary at ``close()``.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import logging
import math
import operator
import os
import sys
import time
from collections import Counter
from types import ModuleType
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from rlpulse.producers.sdk import events as v
from rlpulse.producers.sdk.telemetry import TrainingTelemetry

log = logging.getLogger(__name__)

# Names beyond MAX_METRICS go out as further METRICS events of the same step (nothing lost) up to
# this many per dict: a bound on what one buggy dict (a metric per sample) can put in the table.
MAX_NAMES_PER_STEP = 4 * v.MAX_METRICS
WARNED_NAMES_PER_REASON = 20  # names logged one by one per reason; past that they are only counted
MFU_WARN_INTERVAL_S = 60.0  # an MFU out of range is logged at most this often (a wrong estimate repeats every step)
_HASH_CHARS = 8

# Reasons a value or a name did not go out as given (the keys of MetricsPublisher.skipped).
NULL = "null"  # None; also NaN and infinities read back from JSON writers that store them as null
NON_NUMERIC = "non-numeric"  # a string, a list, a tensor of more than one element, ...
NON_FINITE = "non-finite"  # NaN, an infinity, an int too large for a double
BAD_NAME = "bad name"  # an empty name
DUPLICATE = "duplicate name"  # two names that became the same after renaming
OVER_LIMIT = "over limit"  # past MAX_NAMES_PER_STEP names in one dict
RENAMED = "renamed"  # sent, under a name within the SDK's limits (counted, not skipped)
REFUSED = "refused"  # the SDK refused the call (logged with its reason); the dict is not sent


def rank_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(rank, world_size) from torchrun's variables: RANK, else LOCAL_RANK; WORLD_SIZE, else
    LOCAL_WORLD_SIZE, else 1. A process that sets none is rank 0 of 1."""
    env = os.environ if env is None else env

    def number(*names: str) -> int | None:
        for name in names:
            text = env.get(name, "").strip()
            if text.isdigit():
                return int(text)
        return None

    rank = number("RANK", "LOCAL_RANK") or 0
    world = number("WORLD_SIZE", "LOCAL_WORLD_SIZE") or 1
    return rank, max(world, rank + 1)  # a launcher that sets RANK alone still gives a valid pair


def telemetry_for(project: str, run_id: str, attempt: int = 1, trainer: str = "rl", rank: int | None = None,
                  world_size: int | None = None, **kwargs: Any) -> TrainingTelemetry:
    """A ``TrainingTelemetry`` whose rank comes from the environment unless given (see
    ``rank_from_env``): on a rank other than 0 it publishes no steps, so a step counts once."""
    env_rank, env_world = rank_from_env()
    return TrainingTelemetry(project, run_id, attempt=attempt, trainer=trainer,
                             rank=env_rank if rank is None else rank,
                             world_size=env_world if world_size is None else world_size, **kwargs)


def send_settings(telemetry: TrainingTelemetry, config: Any, framework: str) -> None:
    """``config`` (the trainer's own: TRL's arguments, verl's config, OpenRLHF's args) as the run's
    settings (``TrainingTelemetry.set_config``: on RUN_START, or a second one once started), unless
    ``config`` is None or the telemetry was given settings of its own, which are the user's choice.
    Settings that cannot be read are logged, never raised: telemetry never stops training."""
    if config is None or telemetry.config:
        return
    try:
        telemetry.set_config(config)
    except ValueError:
        log.exception("rlpulse could not read %s's config as the run's settings; the run goes on without them", framework)


def metric_name(name: Any) -> str | None:
    """``name`` within the SDK's limits: text, ASCII (others escaped as ``\\uXXXX``), at most
    MAX_NAME characters (a longer one keeps its start and ends in ``~`` and a hash of the whole,
    so two long names stay apart). None for an empty name."""
    text = name if type(name) is str else str(name)
    if not text:
        return None
    if not text.isascii():
        text = text.encode("ascii", "backslashreplace").decode("ascii")
    if len(text) > v.MAX_NAME:
        digest = hashlib.blake2s(text.encode(), digest_size=_HASH_CHARS // 2).hexdigest()
        text = f"{text[:v.MAX_NAME - _HASH_CHARS - 1]}~{digest}"
    return text


def metric_value(value: Any) -> float | str:
    """``value`` as a finite float, or the reason it is not one (NULL, NON_NUMERIC, NON_FINITE).

    Python and numpy numbers, bools (0 or 1) and one-element tensors convert; ``__float__`` is how
    numpy and torch scalars say they are numbers, so no framework is imported here."""
    if type(value) is float:
        number = value
    elif value is None:
        return NULL
    elif isinstance(value, (str, bytes, bytearray)):
        return NON_NUMERIC
    elif isinstance(value, int):  # bool included: True is 1.0
        try:
            number = float(value)
        except OverflowError:
            return NON_FINITE
    elif getattr(type(value), "__float__", None) is None:
        return NON_NUMERIC
    else:
        try:
            number = float(value)
        except OverflowError:
            return NON_FINITE
        except (TypeError, ValueError, RuntimeError):  # a tensor or array of several elements
            return NON_NUMERIC
    return number if math.isfinite(number) else NON_FINITE


def to_metrics(data: Mapping[Any, Any], skipped: Counter[str] | None = None,
               seen: dict[str, set[str]] | None = None) -> dict[str, float]:
    """The finite numbers of ``data`` under names the SDK accepts, in the dict's order.

    Whatever is not sent as given is counted in ``skipped`` by reason and logged the first time
    its name is met for that reason (``seen`` remembers which), so nothing is dropped silently.
    The count is not limited here: ``MetricsPublisher`` splits a large dict into several events."""
    skipped = Counter() if skipped is None else skipped
    seen = {} if seen is None else seen
    out: dict[str, float] = {}
    for key, value in data.items():
        number = metric_value(value)
        name = metric_name(key)
        if name is None:
            _count(skipped, seen, BAD_NAME, repr(key))
        elif isinstance(number, str):
            _count(skipped, seen, number, name, value)
        elif name in out:
            _count(skipped, seen, DUPLICATE, name)
        else:
            if name is not key:
                _count(skipped, seen, RENAMED, name)
            out[name] = number
    return out


def _count(skipped: Counter[str], seen: dict[str, set[str]], reason: str, name: str, value: Any = None) -> None:
    skipped[reason] += 1
    names = seen.setdefault(reason, set())
    if name in names or len(names) >= WARNED_NAMES_PER_REASON:
        return
    names.add(name)
    shown = f" (a {type(value).__name__})" if reason == NON_NUMERIC else ""
    more = "; further names for this reason are only counted" if len(names) == WARNED_NAMES_PER_REASON else ""
    log.warning("rlpulse metrics: %r %s%s%s", name, "renamed to fit the SDK's limits" if reason == RENAMED
                else f"not sent: {reason}", shown, more)


class MetricsPublisher:
    """Publishes one trainer's metrics dicts through ``telemetry``.

    ``step()`` completes a step (a STEP event, counted once per step number: a second dict for
    the step already completed goes out as METRICS); ``scalars()`` sends figures of a step
    without completing it (validation). Neither raises: a dict the SDK refuses is logged and
    counted (REFUSED), since a logging hook that throws stops the training run it watches.
    ``owns_telemetry``: ``close()`` ends the telemetry too (RUN_END with the status given).
    """

    def __init__(self, telemetry: TrainingTelemetry, owns_telemetry: bool = False,
                 max_names_per_step: int = MAX_NAMES_PER_STEP):
        self.telemetry = telemetry
        self.owns_telemetry = owns_telemetry
        self.max_names_per_step = max_names_per_step
        self.skipped: Counter[str] = Counter()  # reason -> names (or dicts, for REFUSED) not sent as given
        self.steps = 0  # step_completed calls made
        self.dicts = 0  # dicts published, steps included
        self.closed = False
        self.mfu_out_of_range = 0  # steps whose MFU was outside [0, 1]: sent null in the STEP's field
        self._seen: dict[str, set[str]] = {}
        self._last_completed: int | None = None
        self._mfu_warned_at = -math.inf

    def step(self, step: Any, data: Mapping[Any, Any], duration_s: Any = None, tokens: Any = None,
             mfu: Any = None) -> dict[str, float]:
        """Complete ``step`` with the numbers of ``data`` as its metrics; returns what was sent.

        ``duration_s``, ``tokens`` and ``mfu`` fill the STEP's own fields when they are a finite
        number within range (a wrong one is left out of the field, still sent as a metric). ``mfu``
        is a fraction from 0 to 1 (seed 001), as verl reports it; one outside that is left null
        with a warning naming it (``mfu_out_of_range`` counts them), never raised into training."""
        number = self._step_number(step)
        if number is None:
            return {}
        if number == self._last_completed:  # the same step logged twice: its step counts once
            return self.scalars(number, data)
        metrics = self._limited(data)
        first = dict(list(metrics.items())[:v.MAX_METRICS])
        fields = dict(duration_s=_within(duration_s, 0.0, v.MAX_DURATION_S, 0.0), mfu=self._mfu(number, mfu),
                      tokens=int(_within(tokens, 0.0, float(2**62), 0.0)))
        if not self._call(self.telemetry.step_completed, number, metrics=first, **fields):
            return {}
        self._last_completed = number
        self.steps += 1
        self.dicts += 1
        self._send_rest(number, metrics, len(first))
        return metrics

    def scalars(self, step: Any, data: Mapping[Any, Any]) -> dict[str, float]:
        """Send the numbers of ``data`` as figures of ``step`` (METRICS) without completing it."""
        number = self._step_number(step)
        if number is None:
            return {}
        metrics = self._limited(data)
        if not metrics or not self._send_rest(number, metrics, 0):
            return {}
        self.dicts += 1
        return metrics

    def close(self, status: str = "finished") -> None:
        """Log what was skipped over the run; end the telemetry if this publisher owns it. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.skipped:
            log.warning("rlpulse metrics: %d dicts published (%d steps); not sent as given: %s", self.dicts, self.steps,
                        ", ".join(f"{reason} {count}" for reason, count in sorted(self.skipped.items())))
        if self.owns_telemetry:
            self.telemetry.close(status=status)

    # -- internals -------------------------------------------------------------------------
    def _mfu(self, step: int, value: Any) -> float | None:
        """The STEP's MFU field: ``value`` if a fraction from 0 to 1, else None.

        Out of range is a FLOPs estimate that does not fit the model or a device peak that is not
        the device's: the SDK refuses it, and a logging hook must not stop the job over it."""
        number = metric_value(value)
        if isinstance(number, str):  # None or not a number: no MFU (the metric's own skip is counted)
            return None
        if 0.0 <= number <= 1.0:
            return number
        self.mfu_out_of_range += 1
        now = time.monotonic()
        if now - self._mfu_warned_at >= MFU_WARN_INTERVAL_S:
            self._mfu_warned_at = now
            log.warning("rlpulse metrics: step %d reports MFU %r, outside 0 to 1 (a fraction; seed 001): its STEP "
                        "has no MFU (the trainer's metric keeps the value); %d such steps so far, logged at most "
                        "every %.0f s", step, value, self.mfu_out_of_range, MFU_WARN_INTERVAL_S)
        return None

    def _step_number(self, step: Any) -> int | None:
        try:
            number = operator.index(step)  # numpy's integers too
        except TypeError:
            number = -1
        if number < 0:
            self._refuse(f"a dict for step {step!r:.40} (a step is a non-negative integer)")
            return None
        return number

    def _limited(self, data: Mapping[Any, Any]) -> dict[str, float]:
        if not isinstance(data, Mapping):
            self._refuse(f"a {type(data).__name__} in place of a dict")
            return {}
        metrics = to_metrics(data, self.skipped, self._seen)
        if len(metrics) > self.max_names_per_step:
            over = list(metrics)[self.max_names_per_step:]
            for name in over:
                _count(self.skipped, self._seen, OVER_LIMIT, name)
            metrics = dict(list(metrics.items())[:self.max_names_per_step])
        return metrics

    def _send_rest(self, step: int, metrics: dict[str, float], start: int) -> bool:
        """METRICS events of at most MAX_METRICS names each for ``metrics`` past ``start``."""
        items = list(metrics.items())
        sent = True
        for at in range(start, len(items), v.MAX_METRICS):
            sent = self._call(self.telemetry.log, step, dict(items[at:at + v.MAX_METRICS])) and sent
        return sent

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> bool:
        try:
            method(*args, **kwargs)
        except ValueError as exc:  # a bug of ours or a limit changed under us: say so, keep training
            self._refuse(f"a dict of step {args[0] if args else '?'} ({exc})")
            return False
        return True

    def _refuse(self, what: str) -> None:
        """Count a dict not sent at all; log the first WARNED_NAMES_PER_REASON (a fault repeats every step)."""
        self.skipped[REFUSED] += 1
        if self.skipped[REFUSED] <= WARNED_NAMES_PER_REASON:
            log.warning("rlpulse metrics: not sent: %s%s", what, "; further ones are only counted"
                        if self.skipped[REFUSED] == WARNED_NAMES_PER_REASON else "")


def _within(value: Any, low: float, high: float, default: Any) -> Any:
    number = metric_value(value)
    return number if not isinstance(number, str) and low <= number <= high else default


def patch_on_import(module_name: str, patch: Callable[[ModuleType], None]) -> None:
    """Call ``patch(module)`` once ``module_name`` is imported: now if it already is, else right
    after its code runs, before anything can use it.

    Why not import it here: a Ray ``worker_process_setup_hook`` runs in every worker before Ray
    gives it its GPUs, and importing verl there runs ``torch.cuda.is_available()``, which fixes
    the devices CUDA sees for the life of the process. Waiting for the framework's own import
    also keeps the hook free for workers that never load the module."""
    module = sys.modules.get(module_name)
    if module is not None:
        patch(module)
        return
    sys.meta_path.insert(0, _PatchOnImport(module_name, patch))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``module_name`` as the path finder would and wraps its loader; leaves once it has."""

    def __init__(self, module_name: str, patch: Callable[[ModuleType], None]):
        self.module_name, self.patch = module_name, patch

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != self.module_name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one module, once
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:  # another finder's module: it loads unpatched, and says so
            log.warning("rlpulse: %s is not loaded from its package's folder; the hook on it is not installed", fullname)
            return None
        spec.loader = _PatchingLoader(spec.loader, self.patch)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Callable[[ModuleType], None]):
        self.loader, self.patch = loader, patch

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.patch(module)
