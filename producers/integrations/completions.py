"""Each rollout's prompt and completion, as the trainer integrations publish them: one LLM span under its ROLLOUT span.

A traced agent's LLM calls are spans of the rollout (``rlpulse.producers.tracing``); a trainer's rollouts
are generated in batches, outside any traced call, so its integration hands this module each rollout's
text once the trainer has it (TRL: the batch its reward functions score; verl: its rollout-data dump;
OpenRLHF: the experiences its ``generated_samples`` is drawn from). Each rollout gets one span of kind
``LLM``, child of the ROLLOUT span ``TrainingTelemetry.rollout`` gives that rollout id (same trace and
parent ids), so ``rlpulse export`` and the trajectory page read it as a traced call:

* ``gen_ai.input.messages``: the prompt as OpenAI chat messages, a plain-text prompt as one user message;
* ``gen_ai.output.messages``: the completion as one assistant message (a conversational one as given);
* ``gen_ai.usage.input_tokens`` / ``output_tokens``, ``gen_ai.request.model``,
  ``gen_ai.response.finish_reasons``: when the trainer knows them;
* with ``token_ids``: ``rlpulse.prompt_token_ids`` / ``rlpulse.response_token_ids`` and their counts,
  capped as ``rlpulse.producers.tracing.token_ids`` caps a traced call's.

Content goes out only when the content switch is on (``content=True``, or ``RLPULSE_TRACE_CONTENT=1``
when None), each attribute capped at ``content_limit`` characters by the tracing's own ``Content``
(valid JSON kept, cut characters counted in ``rlpulse.content.cut_chars``, registered secrets masked).
Nothing here raises into the trainer: a span the SDK refuses is counted and logged.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterable, Mapping, Sequence

from rlpulse.producers.sdk import events as v
from rlpulse.producers.sdk.records import random_span_id, span_id, trace_id
import rlpulse.producers.tracing.content as tc
from rlpulse.producers.tracing.spans import DEFAULT_CONTENT_LIMIT, MIN_CONTENT_LIMIT, content_from_env
from rlpulse.producers.tracing.token_ids import token_id_attributes
from rlpulse.base.env import TRACE_CONTENT

log = logging.getLogger(__name__)

__all__ = ["Completion", "CompletionPublisher", "DEFAULT_CONTENT_LIMIT", "Generations", "completion_publisher", "finite",
           "input_messages", "output_messages", "scalars"]

REFUSED_LOG_INTERVAL_S = 10.0


@dataclass
class Completion:
    """One rollout's text. ``prompt``: a string or chat messages (``[{"role": ..., "content": ...}]``);
    ``completion``: a string, an assistant message or messages. Counts and ids where the trainer has them."""

    rollout_id: str
    prompt: Any
    completion: Any
    input_tokens: int | None = None
    output_tokens: int | None = None
    prompt_ids: Sequence[int] | None = None
    response_ids: Sequence[int] | None = None
    finish_reason: str | None = None


def input_messages(prompt: Any) -> list[Any]:
    """The prompt as chat messages: a string (or anything not a message) is the user's; messages stay as they are."""
    if isinstance(prompt, Mapping):
        return [prompt]
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, Mapping) for m in prompt):
        return list(prompt)
    return [{"role": "user", "content": prompt}]


def output_messages(completion: Any) -> list[Any]:
    """The completion as chat messages: a string is the assistant's; a message or messages stay as they are."""
    if isinstance(completion, Mapping):
        return [completion]
    if isinstance(completion, (list, tuple)) and all(isinstance(m, Mapping) for m in completion):
        return list(completion)
    return [{"role": "assistant", "content": completion}]


def scalars(value: Any) -> list[Any]:
    """A framework's per-sample column (a list, a numpy array, a torch tensor, of shape (B,) or (B, 1)) as a list
    of Python values, one per sample; no framework is imported (``tolist`` is how both arrays say it)."""
    if value is None:
        return []
    items = value.tolist() if hasattr(value, "tolist") else list(value)
    if not isinstance(items, list):  # a 0-d array or tensor: one value
        return [items]
    return [x[0] if isinstance(x, list) and len(x) == 1 else x for x in items]


def _count(value: Any) -> int | None:
    try:
        number = operator.index(value)  # numpy's and torch's integers too; never a float or a bool-free guess
    except TypeError:
        return None
    return number if number >= 0 and not isinstance(value, bool) else None


def _ids(values: Sequence[Any] | None) -> list[int] | None:
    if values is None:
        return None
    try:
        return [operator.index(x) for x in (values.tolist() if hasattr(values, "tolist") else values)]
    except TypeError:
        return None


class CompletionPublisher:
    """Publishes rollouts' prompts and completions through ``telemetry`` as LLM spans named ``name``.

    ``content_limit``: the most characters of one content attribute (256 to 65,536), as ``Tracer``'s;
    ``token_ids``: also record the ids a ``Completion`` carries; ``model``: ``gen_ai.request.model``.
    Counters: ``published`` (spans handed to the telemetry; a full buffer counts in its ``dropped``),
    ``refused`` (spans or rollouts the SDK refused: logged, never raised), ``content_cut`` (spans the cap cut).
    """

    def __init__(self, telemetry: Any, name: str, content_limit: int = DEFAULT_CONTENT_LIMIT, token_ids: bool = False,
                 model: str | None = None):
        if type(content_limit) is not int or not MIN_CONTENT_LIMIT <= content_limit <= v.MAX_VALUE:
            raise ValueError(f"content_limit must be an integer from {MIN_CONTENT_LIMIT} to {v.MAX_VALUE} "
                             f"(characters of one attribute), got {content_limit!r}")
        self.telemetry = getattr(telemetry, "sync", telemetry)  # an AsyncTrainingTelemetry's sync face
        self.name = v.require_name("name", name)
        self.content_limit, self.token_ids = content_limit, bool(token_ids)
        self.model = tc.redact(model)[:v.MAX_NAME] if isinstance(model, str) and model else None
        self.published = self.refused = self.content_cut = 0
        self._lock = threading.Lock()
        self._last_log = -REFUSED_LOG_INTERVAL_S

    def attributes(self, completion: Completion) -> dict[str, Any]:
        """The span's attributes: GenAI names, content under the cap, token ids when asked for."""
        conversational = not isinstance(completion.prompt, str)
        attrs: dict[str, Any] = {"gen_ai.operation.name": "chat" if conversational else "text_completion"}
        if self.model is not None:
            attrs["gen_ai.request.model"] = self.model
        for key, value in (("gen_ai.usage.input_tokens", completion.input_tokens),
                           ("gen_ai.usage.output_tokens", completion.output_tokens)):
            if _count(value) is not None:
                attrs[key] = _count(value)
        if isinstance(completion.finish_reason, str) and completion.finish_reason:
            attrs["gen_ai.response.finish_reasons"] = completion.finish_reason[:v.MAX_NAME]
        content = tc.Content(self.content_limit)
        content.put(attrs, "gen_ai.input.messages", input_messages(completion.prompt))
        content.put(attrs, "gen_ai.output.messages", output_messages(completion.completion))
        if self.token_ids:
            prompt, response = _ids(completion.prompt_ids), _ids(completion.response_ids)
            shaped: dict[str, Any] = {"choices": [{"index": 0, "token_ids": response}]}  # a vLLM response's shape
            if prompt is not None:
                shaped["prompt_token_ids"] = prompt
            attrs.update(token_id_attributes(shaped))
        return attrs

    def record(self, step: int | None, completion: Completion, start_ns: int, end_ns: int) -> dict[str, Any]:
        """The Span record fields of one rollout's LLM span (``publish_span``'s argument)."""
        telemetry = self.telemetry
        ids = f"{telemetry.run_id}/{telemetry.attempt}/{completion.rollout_id}"
        return {"time_ns": end_ns, "trace_id": trace_id(ids), "span_id": random_span_id(),
                "parent_span_id": span_id(f"{ids}/rollout"), "name": self.name, "kind": "LLM",
                "start_time_ns": min(start_ns, end_ns), "end_time_ns": end_ns, "status": "OK",
                "rollout_id": completion.rollout_id, "step": step, "attributes": self.attributes(completion)}

    def publish(self, step: int | None, completions: Iterable[Completion], start_ns: int | None = None,
                end_ns: int | None = None) -> int:
        """One LLM span per completion, generated from ``start_ns`` to ``end_ns`` (default: now); returns how many."""
        end = time.time_ns() if end_ns is None else end_ns
        start = end if start_ns is None else start_ns
        return sum(self._one(step, c, start, end) for c in completions)

    def publish_with_rollouts(self, step: int, rollouts: Iterable[tuple[Completion, Mapping[str, Any]]],
                              start_ns: int | None = None, end_ns: int | None = None) -> int:
        """For a trainer that publishes no rollouts of its own: each rollout's ROLLOUT span
        (``TrainingTelemetry.rollout(step, rollout_id, **fields)``, ``fields`` holding at least ``reward``), then
        its LLM span. A rollout the SDK refuses (a NaN reward) is counted and logged, and gets no LLM span."""
        end = time.time_ns() if end_ns is None else end_ns
        start = end if start_ns is None else start_ns
        sent = 0
        for completion, fields in rollouts:
            try:
                self.telemetry.rollout(step, completion.rollout_id, **fields)
            except (TypeError, ValueError) as exc:
                self._refuse(completion.rollout_id, exc)
                continue
            sent += self._one(step, completion, start, end)
        return sent

    def _one(self, step: int | None, completion: Completion, start: int, end: int) -> int:
        try:
            record = self.record(step, completion, start, end)
            self.telemetry.publish_span(record)
        except Exception as exc:  # a value the Span schema refuses: this span only, never the training step
            self._refuse(completion.rollout_id, exc)
            return 0
        with self._lock:
            self.published += 1
            if tc.CUT_CHARS in record["attributes"]:
                self.content_cut += 1
        return 1

    def _refuse(self, rollout_id: Any, exc: Exception) -> None:
        with self._lock:
            self.refused += 1
            now, due = time.monotonic(), False
            if now - self._last_log >= REFUSED_LOG_INTERVAL_S:
                self._last_log, due = now, True
        if due:
            log.warning("rlpulse: the %s span of rollout %.80r not published: %s (%d refused so far)", self.name,
                        rollout_id, exc, self.refused)


class Generations:
    """A trainer's last few generation calls, timed: ``timed(generate, pick)`` wraps the call, ``pick(result)``
    names its outputs object and its prompt ids; ``of(outputs)`` finds them again by identity (the very list
    the trainer hands on), with the call's start and end."""

    def __init__(self, keep: int = 8):
        self._calls: deque[tuple[Any, Any, int, int]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def timed(self, generate: Callable[..., Any], pick: Callable[[Any], tuple[Any, Any]]) -> Callable[..., Any]:
        @functools.wraps(generate)
        def generate_timed(*args: Any, **kwargs: Any) -> Any:
            start = time.time_ns()
            result = generate(*args, **kwargs)
            end = time.time_ns()
            try:
                outputs, prompt_ids = pick(result)
            except Exception:  # another version's shape: the spans go out untimed, training goes on
                log.debug("rlpulse: a generation's result of an unknown shape is not timed", exc_info=True)
                return result
            with self._lock:
                self._calls.append((outputs, prompt_ids, start, end))
            return result
        return generate_timed

    def of(self, outputs: Any) -> tuple[Sequence[Any] | None, int | None, int | None]:
        """(prompt ids, one per output, or None; start; end) of the call that returned ``outputs``; Nones if none did."""
        with self._lock:
            for given, prompt_ids, start, end in reversed(self._calls):
                if given is outputs and outputs is not None:
                    fits = isinstance(prompt_ids, (list, tuple)) and len(prompt_ids) == len(outputs)
                    return (prompt_ids if fits else None), start, end
        return None, None, None


def completion_publisher(telemetry: Any, name: str, content: bool | None = None,
                         content_limit: int = DEFAULT_CONTENT_LIMIT, token_ids: bool = False,
                         model: str | None = None) -> CompletionPublisher | None:
    """A ``CompletionPublisher`` when the content switch is on (``content``; None: ``RLPULSE_TRACE_CONTENT``),
    else None: with content off an integration publishes no text at all. ValueError for a bad switch or limit."""
    if content is not None and type(content) is not bool:
        raise ValueError(f"content must be True, False or None ({TRACE_CONTENT}), got {content!r}")
    if not (content_from_env() if content is None else content):
        return None
    return CompletionPublisher(telemetry, name, content_limit=content_limit, token_ids=token_ids, model=model)


def finite(value: Any) -> float | None:
    """``value`` as a finite float (numpy's and torch's scalars too), else None."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError, RuntimeError):
        return None
    return number if math.isfinite(number) else None
