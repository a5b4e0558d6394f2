"""TRL's ``GRPOTrainer`` in two lines: rollouts, grader calls, steps and every scalar TRL logs.

::

    from rlpulse.producers.integrations.trl import instrument
    instrument(trainer, project="math", run_id="grpo-7")   # before trainer.train()

``instrument`` wraps each reward function in ``trainer.reward_funcs`` (sync and async ones; a reward
model, an ``nn.Module``, is left as it is and its term is missing from the rollouts, with a warning),
adds a ``TrainerCallback`` and wraps ``trainer.train`` so that RUN_END says how training ended
(finished; failed on an exception; cancelled on Ctrl-C or SystemExit). Nothing here imports
transformers or TRL until ``instrument`` is called with a trainer.

**Steps.** rlpulse's steps are TRL's: step ``n`` is the ``n``-th optimizer update, the
``global_step`` under which TRL logs it (``trainer.state.log_history[i]["step"]``). TRL generates
and scores a batch of completions while ``global_step == k``, inside update ``k + 1``, and logs that
batch's figures (``reward``, ``completions/clipped_ratio``, ...) with update ``k + 1``. So a
rollout, and each grader call that scored it, belongs to step ``k + 1``, the first update that
trains on it. When ``steps_per_generation`` (or ``num_iterations``) exceeds one, the same
completions also feed the next updates; TRL logs their figures once, and rlpulse counts them once,
at their first step. With ``logging_steps`` above one TRL logs the mean of the batches' figures since
its last log; rlpulse keeps each step's.

**Policy version and staleness.** A rollout's ``policy_version`` is the step that trains from the
weights that generated it: the weights after ``k`` updates are the input (PPO's old policy) of
update ``k + 1``, so a batch generated at ``global_step == k`` has version ``k + 1``. Staleness,
``step - policy_version``, is therefore 0 for TRL's synchronous GRPO; an asynchronous trainer that
trains step ``n`` on rollouts made by the weights step ``v`` started from has ``n - v``.

**Rollouts** (one ROLLOUT span per completion of a training batch; evaluation batches are left out):
``rollout_id`` ``s<step>-<i>`` and ``sample_id`` ``s<step>-p<g>``, with ``i`` the completion's
index in the batch gathered across processes and ``g = i // num_generations`` its prompt group;
``reward`` is TRL's: the sum over reward functions of ``weight * value`` (``reward_weights``), failed
ones left out (TRL's ``nansum``); ``term_shares`` holds each function's ``weight * value`` under its
TRL name, and 0.0 for a function that failed on the completion (seed 001: a failed score counts as
zero for its term), so a completion every function failed has every term at 0.0 and reward 0.0,
as ``nansum`` gives (TRL leaves it out of its logged ``reward`` and ``reward_std``);
``completion_tokens`` is the completion's length; ``finish_reason`` is ``stop`` when its last token
is an EOS or the pad token, else ``length`` (clipped), exactly as TRL counts
``completions/clipped_ratio``, not from the length limit.

**Graders** (one GRADER span per completion and reward function), with the reward call's own start
and end. The outcome is ``ok`` with the function's value as ``score``; else the cause, and TRL is
given None (NaN, which its ``nansum`` skips): the function raised -> ``error`` for every completion
of the call; it returned None or NaN -> ``ungradable``; an infinite value -> ``unreadable`` (passed
to TRL unchanged). A function names its own cause by raising ``GraderFailure(cause)`` (every
completion of the call) or returning one in place of a score (that completion). The telemetry
``instrument`` builds holds the grader calls until their step completes (``grader_calls="step"``;
seed 001: "the job reports the calls for a step when it reports that step"): TRL scores a batch
inside the step that trains on it, and the calls of a step the job never completed (it crashed or
was stopped) are not published, as TRL never logs that step's ``rewards/*``. Pass
``grader_calls="call"`` to ``instrument`` to publish each call as it is made.

**Telemetry off.** ``instrument(trainer, ..., enabled=False)`` keeps the reward functions' side of
this and nothing else: each function gives TRL what it gives it instrumented (None for a raised
exception or a ``GraderFailure``, raised or returned; every other value unchanged), and no telemetry
is made, nothing connects to Kafka, no callback is added and ``train`` is left as it is. A judge
written this way and run by TRL with no ``instrument`` at all breaks TRL: TRL 1.16 turns a returned
``GraderFailure`` into ``TypeError: must be real number`` and stops on a raised one.

**Scalars.** Every number TRL logs (``on_log``: loss, grad_norm, learning_rate, kl, entropy,
``clip_ratio/*`` (PPO's ratio clipping, not truncation), rewards/*, completions/*, ...) goes to
``step_metrics``: the first log of a step with ``step_completed``, later ones (the train summary)
with ``log``. Values that are not finite numbers (TRL logs None for a figure with no valid value)
are skipped and counted; the first skip of each name is logged, and a summary at the end.

**Prompts and completions** (content on: ``content=True`` or ``RLPULSE_TRACE_CONTENT=1``): an LLM span
``trl.generate`` per rollout (``rlpulse.producers.integrations.completions``) from the ``prompts`` and
``completions`` the reward functions get; ``trainer._generate`` is wrapped for its time and ``prompt_ids``.

**Settings.** ``trainer.args`` (a ``GRPOConfig``: its ``to_dict()``, tokens hidden) are the run's settings,
on its RUN_START (a telemetry already started: on a second one, ``set_config``; one given its own keeps them).

**Ranks.** The process index and count of TRL's accelerator are the SDK's rank and world size:
each process publishes the rollouts and grader calls it scored; rank 0 alone counts steps.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from typing import Any, Literal, overload
from collections.abc import Callable, Mapping

from rlpulse.producers.integrations.trl_values import GraderFailure, for_trl, outcome_of, scalars
from rlpulse.producers.integrations.completions import (DEFAULT_CONTENT_LIMIT, Completion, CompletionPublisher,
                                                        Generations, completion_publisher)
from rlpulse.producers.integrations.metrics_dict import send_settings
from rlpulse.producers.sdk import events as v
from rlpulse.producers.sdk.batch import RolloutBatch
from rlpulse.producers.sdk.process import run_status
from rlpulse.producers.sdk.telemetry import TrainingTelemetry

log = logging.getLogger(__name__)

__all__ = ["GraderFailure", "TrlTelemetry", "instrument"]


class TrlTelemetry:
    """The glue between one ``GRPOTrainer`` and one ``TrainingTelemetry``; ``instrument`` builds it.

    Its ``on_*`` methods are the ``TrainerCallback`` events it uses (``callback`` gives it to the
    trainer as a real ``TrainerCallback``); ``wrap`` makes a reward function report its calls.
    """

    def __init__(self, telemetry: TrainingTelemetry, trainer: Any, completions: CompletionPublisher | None = None):
        self.tel, self.trainer = telemetry, trainer
        self.completions = completions  # None: the content switch is off, no prompt or completion is sent
        self.generations = Generations()  # _generate's, timed (see instrument)
        self.skipped: dict[str, int] = {}  # metric name -> values skipped (not a finite number, or a bad name)
        self._lock = threading.Lock()  # async reward functions report from TRL's event-loop thread
        # step -> (its rollouts, the indices of the reward functions heard, the rollout ids given)
        self._batches: dict[int, tuple[RolloutBatch, set[int], set[str]]] = {}
        self._wrapped = 0
        self._step_started: float | None = None
        self._tokens_seen = 0
        self._pending: tuple[int, int, float] | None = None  # (step, tokens, duration_s) awaiting its log
        self._configured = False

    # -- reward functions ------------------------------------------------------------------------
    def wrap(self, func: Callable[..., Any], index: int) -> Callable[..., Any]:
        """``func`` (``trainer.reward_funcs[index]``), reporting each call; async stays async (TRL runs those concurrently)."""
        self._wrapped += 1
        return _wrapped(func, functools.partial(self._failed, index), functools.partial(self._scored, index))

    def _failed(self, index: int, kwargs: Mapping[str, Any], start: int, exc: Exception) -> list[None]:
        end = time.time_ns()
        count = len(kwargs.get("prompts") or kwargs.get("completion_ids") or ())
        cause = exc.cause if isinstance(exc, GraderFailure) else "error"
        if cause == "error":
            log.warning("reward function %s raised %s: %s; its %d scores are NaN for TRL and `error` graders here",
                        self._name(index), type(exc).__name__, exc, count, exc_info=exc)
        self._record_safely(index, kwargs, start, end, [GraderFailure(cause)] * count)
        return [None] * count

    def _scored(self, index: int, kwargs: Mapping[str, Any], start: int, result: Any) -> Any:
        end = time.time_ns()
        values = list(result)
        expected = len(kwargs.get("prompts") or ())
        if expected and len(values) != expected:  # TRL raises on it; nothing here can be matched to a completion
            log.warning("reward function %s returned %d values for %d completions: its call is not recorded",
                        self._name(index), len(values), expected)
            self._record_safely(index, kwargs, start, end, None)
            return result
        self._record_safely(index, kwargs, start, end, values)
        return [for_trl(x) for x in values]

    def _name(self, index: int) -> str:
        names = getattr(self.trainer, "reward_func_names", None) or ()
        return names[index] if index < len(names) else f"reward_{index}"

    def _record_safely(self, index: int, kwargs: Mapping[str, Any], start: int, end: int, values: list[Any] | None) -> None:
        try:
            self._record(index, kwargs, start, end, values)
        except Exception:  # telemetry never stops training; what it could not record is said, not hidden
            log.exception("rlpulse could not record a call of reward function %s", self._name(index))

    def _record(self, index: int, kwargs: Mapping[str, Any], start: int, end: int, values: list[Any] | None) -> None:
        """One reward function's call over a batch: its grader spans, its terms of the batch's rollouts."""
        model = getattr(self.trainer, "model", None)
        if model is not None and not getattr(model, "training", True):
            return  # an evaluation batch: not a training rollout
        state = kwargs.get("trainer_state") or getattr(self.trainer, "state", None)
        step = int(getattr(state, "global_step", 0)) + 1  # see the module docstring: generated at k, step k + 1
        completion_ids = kwargs.get("completion_ids") or []
        count = len(values) if values is not None else len(completion_ids)
        accelerator = getattr(self.trainer, "accelerator", None)
        offset = int(getattr(accelerator, "process_index", 0)) * count  # TRL gathers the processes' batches in order
        group = int(getattr(self.trainer, "num_generations", 1) or 1)
        weights = getattr(self.trainer, "reward_weights", None)
        weight = float(weights[index]) if weights is not None and index < len(weights) else 1.0
        term = self._name(index)
        stops = self._stop_tokens()
        fresh: list[tuple[int, str, dict[str, Any]]] = []  # rollouts given by this call: their text goes out once
        with self._lock:
            if step not in self._batches:
                self._batches[step] = (self.tel.rollouts(step, policy_version=step), set(), set())
            batch, heard, given = self._batches[step]
            for i in range(count):
                rollout_id = f"s{step}-{offset + i}"
                if rollout_id not in given:
                    given.add(rollout_id)
                    fields: dict[str, Any] = {"sample_id": f"s{step}-p{(offset + i) // group}"}
                    if i < len(completion_ids):
                        ids = list(completion_ids[i])
                        fields["completion_tokens"] = len(ids)
                        fields["finish_reason"] = "stop" if not ids or ids[-1] in stops else "length"
                    batch.rollout(rollout_id, **fields)
                    fresh.append((i, rollout_id, fields))
                if values is None:
                    continue
                outcome, score = outcome_of(values[i])
                self.tel.grader(step, rollout_id, term, outcome, score=score, start_ns=start, end_ns=end)
                # a failed score counts as zero for its term (seed 001) and adds nothing to the reward (TRL's nansum)
                batch.term(rollout_id, term, None if score is None else weight * score)
            heard.add(index)
            done = len(heard) >= self._wrapped
        if fresh and self.completions is not None:
            try:
                self._texts(step, kwargs, fresh, start)
            except Exception:  # as in _record_safely, and the batch below is still published
                log.exception("rlpulse could not publish the prompts and completions of step %d", step)
        if done:
            self._publish(lambda s: s == step)

    def _texts(self, step: int, kwargs: Mapping[str, Any], fresh: list[tuple[int, str, dict[str, Any]]],
               called: int) -> None:
        """The LLM spans of the rollouts a reward call gave first: TRL's prompts and completions of the batch."""
        prompts, completions = kwargs.get("prompts") or [], kwargs.get("completions") or []
        ids = kwargs.get("completion_ids") or []
        prompt_ids, start, end = self.generations.of(kwargs.get("completion_ids"))
        own = list(prompt_ids or ())  # the generation's prompt ids, one per completion, when it was timed
        texts = [Completion(rollout_id, prompts[i], completions[i], len(own[i]) if i < len(own) else None,
                            fields.get("completion_tokens"), own[i] if i < len(own) else None,
                            ids[i] if i < len(ids) else None, fields.get("finish_reason"))
                 for i, rollout_id, fields in fresh if i < len(prompts) and i < len(completions)]
        if self.completions is not None:
            self.completions.publish(step, texts, called if start is None else start, called if end is None else end)

    def _stop_tokens(self) -> set[int]:
        """EOS and pad ids: a completion ending on neither was cut at the length limit (TRL's rule)."""
        trainer = self.trainer
        tokenizer = getattr(trainer, "_tokenizer", None) or getattr(trainer, "processing_class", None)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a multimodal processor holds its tokenizer
        stops = set(getattr(trainer, "eos_token_ids", None) or ())
        for name in ("eos_token_id", "pad_token_id"):
            token = getattr(tokenizer, name, None)
            if isinstance(token, int):
                stops.add(token)
        return stops

    def _publish(self, which: Callable[[int], bool]) -> None:
        with self._lock:
            steps = sorted(s for s in self._batches if which(s))
            batches = [self._batches.pop(s)[0] for s in steps]
        for batch in batches:
            try:
                batch.publish()
            except Exception:  # as in _record_safely
                log.exception("rlpulse could not publish the rollouts of step %d", batch.step)

    # -- TrainerCallback events ------------------------------------------------------------------
    def configure(self, args: Any) -> None:
        """``args`` (the trainer's ``TrainingArguments``) as the run's settings, once (the module docstring)."""
        if self._configured or args is None:
            return
        self._configured = True
        send_settings(self.tel, args, "TRL")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.configure(args)
        self.tel.start()
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._complete_pending()
        self._step_started = time.monotonic()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = int(state.global_step)
        self._publish(lambda s: s <= step)  # a batch whose functions did not all report (one raised BaseException)
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        tokens, self._tokens_seen = max(seen - self._tokens_seen, 0), seen
        duration = time.monotonic() - self._step_started if self._step_started is not None else 0.0
        self._complete_pending()
        # completed when its log arrives (on_log follows on_step_end), with the scalars logged for it
        self._pending = (step, tokens, duration)

    def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        history = getattr(state, "log_history", None)
        entry = history[-1] if history else None
        if isinstance(entry, Mapping) and entry.get("step") == state.global_step:
            # The copy Trainer.log appended before any callback ran: callbacks before this one may
            # change `logs` (transformers' PrinterCallback pops total_flos from it).
            logs = {name: value for name, value in entry.items() if name != "step"}
        metrics = scalars(logs or {}, self.skipped)
        chunks = [dict(list(metrics.items())[i:i + v.MAX_METRICS]) for i in range(0, len(metrics), v.MAX_METRICS)]
        step = int(state.global_step)
        if self._pending is not None and self._pending[0] == step:
            _, tokens, duration = self._pending
            self._pending = None
            self.tel.step_completed(step, tokens=tokens, duration_s=duration, metrics=chunks[0] if chunks else None)
            chunks = chunks[1:]
        for chunk in chunks:
            self.tel.log(step, chunk)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._publish(lambda s: True)
        self._complete_pending()

    def _complete_pending(self) -> None:
        if self._pending is not None:
            step, tokens, duration = self._pending
            self._pending = None
            self.tel.step_completed(step, tokens=tokens, duration_s=duration)

    # -- the end ---------------------------------------------------------------------------------
    def close(self, status: str = "finished") -> int:
        """Publish what is pending, then RUN_END with ``status``; the undelivered count."""
        self._publish(lambda s: True)
        self._complete_pending()
        if self.skipped:
            log.warning("TRL values not published (not finite numbers): %s",
                        ", ".join(f"{name} x{n}" for name, n in sorted(self.skipped.items())))
        return self.tel.close(status=status)


def _wrapped(func: Callable[..., Any], failed: Callable[[Mapping[str, Any], int, Exception], Any],
             scored: Callable[[Mapping[str, Any], int, Any], Any]) -> Callable[..., Any]:
    """``func`` calling ``failed(kwargs, start_ns, exc)`` when it raises (TRL would stop training) and
    ``scored(kwargs, start_ns, result)`` when it returns; what they return is what TRL gets. Async stays async."""
    if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__):
        @functools.wraps(func)
        async def graded_async(*args: Any, **kwargs: Any) -> Any:
            start = time.time_ns()
            try:
                result = await func(*args, **kwargs)
            except Exception as exc:
                return failed(kwargs, start, exc)
            return scored(kwargs, start, result)
        return graded_async

    @functools.wraps(func)
    def graded(*args: Any, **kwargs: Any) -> Any:
        start = time.time_ns()
        try:
            result = func(*args, **kwargs)
        except Exception as exc:  # TRL would stop training; the term is NaN for this batch instead
            return failed(kwargs, start, exc)
        return scored(kwargs, start, result)
    return graded


def _values_only(func: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``func`` giving TRL what an instrumented one gives it, reporting nothing: ``instrument(..., enabled=False)``."""

    def failed(kwargs: Mapping[str, Any], start: int, exc: Exception) -> list[None]:
        count = len(kwargs.get("prompts") or kwargs.get("completion_ids") or ())
        if not isinstance(exc, GraderFailure):
            log.warning("reward function %s raised %s: %s; its %d scores are NaN for TRL (rlpulse telemetry is off)",
                        name, type(exc).__name__, exc, count, exc_info=exc)
        return [None] * count

    def scored(kwargs: Mapping[str, Any], start: int, result: Any) -> Any:
        values = list(result)
        expected = len(kwargs.get("prompts") or ())
        return result if expected and len(values) != expected else [for_trl(x) for x in values]  # TRL raises on a wrong length

    return _wrapped(func, failed, scored)


def callback(hooks: TrlTelemetry) -> Any:
    """``hooks`` as a ``transformers.TrainerCallback`` (a subclass made here, so that this module
    imports without transformers)."""
    try:
        from transformers import TrainerCallback
    except ImportError:  # no transformers, so no real trainer: a stand-in (a test's) takes the hooks as they are
        return hooks
    cls = type("RlpulseTrlCallback", (TrainerCallback,), {
        name: staticmethod(getattr(hooks, name))
        for name in ("on_train_begin", "on_step_begin", "on_step_end", "on_log", "on_train_end")
    })
    return cls()


def _is_module(func: Any) -> bool:
    try:
        from torch import nn
    except ImportError:
        return False
    return isinstance(func, nn.Module)


@overload
def instrument(trainer: Any, project: str, run_id: str, attempt: int = 1, stage: str = "",
               telemetry: TrainingTelemetry | None = None, content: bool | None = None,
               content_limit: int = DEFAULT_CONTENT_LIMIT, token_ids: bool = False, *,
               enabled: Literal[True] = True, **telemetry_kwargs: Any) -> TrlTelemetry: ...


@overload
def instrument(trainer: Any, project: str, run_id: str, attempt: int = 1, stage: str = "",
               telemetry: TrainingTelemetry | None = None, content: bool | None = None,
               content_limit: int = DEFAULT_CONTENT_LIMIT, token_ids: bool = False, *,
               enabled: bool, **telemetry_kwargs: Any) -> TrlTelemetry | None: ...


def instrument(trainer: Any, project: str, run_id: str, attempt: int = 1, stage: str = "",
               telemetry: TrainingTelemetry | None = None, content: bool | None = None,
               content_limit: int = DEFAULT_CONTENT_LIMIT, token_ids: bool = False, *,
               enabled: bool = True, **telemetry_kwargs: Any) -> TrlTelemetry | None:
    """Report ``trainer``'s (a TRL ``GRPOTrainer``) rollouts, grader calls, steps and scalars.

    Call before ``trainer.train()``. ``telemetry_kwargs`` go to ``TrainingTelemetry`` (``settings``,
    ``transport``, ...); rank and world size come from ``trainer.accelerator``. Pass ``telemetry`` to
    publish through an existing one instead (its own ``grader_calls`` then holds). Returns the glue
    (``.tel`` is the telemetry).
    ``content`` (None: ``RLPULSE_TRACE_CONTENT``): also publish each rollout's prompt and completion, each
    content attribute at most ``content_limit`` characters; ``token_ids``: their token ids too.

    ``enabled=False`` turns the telemetry off and keeps the reward functions working: they give TRL
    exactly what they give it instrumented (a ``GraderFailure``, returned or raised, and any other
    exception become None, which TRL reads as NaN; other values pass unchanged), and nothing else is
    touched: no telemetry is made, nothing connects to Kafka, no callback is added, ``train`` is left
    alone. It returns None then. Without ``instrument`` at all, TRL gets a returned ``GraderFailure``
    as it is (TRL 1.16 raises ``TypeError: must be real number``) and stops on a raised one.
    """
    if not enabled:
        names = getattr(trainer, "reward_func_names", None) or ()
        funcs = trainer.reward_funcs
        for i, func in enumerate(list(funcs)):
            if not _is_module(func) and callable(func):
                funcs[i] = _values_only(func, names[i] if i < len(names) else f"reward_{i}")
        log.info("rlpulse telemetry is off (instrument(enabled=False)): the reward functions give TRL None for a failure")
        return None
    accelerator = getattr(trainer, "accelerator", None)
    if telemetry is None:
        telemetry_kwargs.setdefault("grader_calls", "step")  # the module docstring says why
        telemetry = TrainingTelemetry(project, run_id, attempt=attempt, trainer="rl", stage=stage,
                                      rank=int(getattr(accelerator, "process_index", 0)),
                                      world_size=int(getattr(accelerator, "num_processes", 1)), **telemetry_kwargs)
    model = getattr(getattr(trainer, "model", None), "name_or_path", None)
    completions = completion_publisher(telemetry, "trl.generate", content, content_limit, token_ids,
                                       model if isinstance(model, str) else None)
    hooks = TrlTelemetry(telemetry, trainer, completions)
    generate = getattr(trainer, "_generate", None)
    if completions is not None and callable(generate):
        # TRL 1.16 returns (prompt_ids, completion_ids, ...): the completion_ids list is the one its reward functions get
        trainer._generate = hooks.generations.timed(generate, lambda out: (out[1], out[0]))  # an instance attribute
    funcs = trainer.reward_funcs
    for i, func in enumerate(list(funcs)):
        if _is_module(func) or not callable(func):
            log.warning("reward function %s is a model, not a function: its scores are not reported "
                        "(its term is missing from the rollouts' terms and rewards)", hooks._name(i))
            continue
        funcs[i] = hooks.wrap(func, i)
    trainer.add_callback(callback(hooks))
    train = trainer.train

    @functools.wraps(train)
    def train_reporting(*args: Any, **kwargs: Any) -> Any:
        hooks.configure(getattr(trainer, "args", None))  # before start: the settings ride the first RUN_START
        hooks.tel.start()
        try:
            result = train(*args, **kwargs)
        except BaseException as exc:
            hooks.close(run_status(type(exc)))
            raise
        hooks.close("finished")
        return result

    trainer.train = train_reporting  # an instance attribute: the trainer's class is left alone
    return hooks
