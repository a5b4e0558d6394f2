"""Traced LLM and tool calls without hand-written spans (seed 000): decorators and a wrapped client.

::

    from rlpulse.producers.tracing import Tracer, observe_processor, observe_tool, trace_client, set_reward, rollout_metrics

    client = trace_client(openai.OpenAI(base_url=..., api_key=...))   # every chat.completions.create is an LLM span

    @observe_tool(name="calculator")
    def calculator(expression: str) -> str: ...

    @observe_processor                       # the ENTRY span: ROLLOUT here (REWARD when named so, or kind=)
    def rollout(task, *, step: int, rollout_id: str, sample_id: str | None = None): ...
        reply = client.chat.completions.create(model="policy", messages=[...], tools=[...])
        rollout_metrics({"turns": 2.0})      # flat floats, at most 10 names per run (the seed's advice)
        set_reward(1.0)

    with TrainingTelemetry(project="p", run_id="r1") as tel, Tracer(tel, content=True):
        rollout(task, step=3, rollout_id="r-17")

The tree is ENTRY -> LLM / TOOL / nested, as the seed draws it. A ROLLOUT entry *is* the rollout's
ROLLOUT span (the ids ``tel.rollout`` would give it, so ``tel.grader`` spans nest under it too): its
reward (``set_reward``, or a nested REWARD entry's) makes the streams count it; ``completion_tokens``
and ``finish_reason`` default to the sum of its LLM calls' output tokens and its last call's reason.
Do not also call ``tel.rollout`` for the same rollout. A REWARD entry nests under its rollout's span
(the open entry, or the rollout's span by id when it runs elsewhere); a number it returns is its reward.

The entry takes ``step``, ``rollout_id``, ``sample_id`` and ``policy_version`` from the call's
arguments of those names, else from an argument object or mapping carrying them (the seed's
``RolloutInput``), else from the enclosing entry or ``bind_rollout(...)``; a rollout id found
nowhere is generated (attribute ``rlpulse.rollout_id_generated``). LLM and TOOL spans made outside
any entry nest under ``bind_rollout``'s rollout, or, with none, are published as roots.

Spans go through the telemetry's ``publish_span`` (so they carry the run's identity and ``sequence_id``)
when they end: a child before its entry. The current span is a context variable: asyncio tasks
inherit it, a thread pool's threads do not (use ``asyncio.to_thread`` or ``contextvars.copy_context``).
An exception marks the span ERROR with the exception's type only (its message may quote anything)
and is re-raised. Content is recorded only when turned on (``content=True`` or ``RLPULSE_TRACE_CONTENT=1``),
capped per attribute (``rlpulse.producers.tracing.content``). A span the Span schema refuses is counted in
``Tracer.refused`` and logged at most every 10 s; it never raises into the traced call.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, TypeVar
from collections.abc import Callable, Mapping

from rlpulse.producers.sdk import events as v
import rlpulse.producers.tracing.content as tc
from rlpulse.producers.tracing.outputs import read_result
from rlpulse.producers.tracing.spans import (CURRENT, DEFAULT_CONTENT_LIMIT, MAX_METRIC_NAME, MAX_METRIC_NAMES, Tracer, OpenSpan,
                                             bind_rollout, content_from_env, current_tracer, finish_llm, start_llm)
from rlpulse.schemas.enums import SPAN_KINDS

__all__ = ["DEFAULT_CONTENT_LIMIT", "MAX_METRIC_NAMES", "Tracer", "bind_rollout", "content_from_env", "observe_llm",
           "observe_processor", "observe_tool", "emit_reward", "reward_metrics", "rollout_metrics", "set_reward", "trace_client"]

F = TypeVar("F", bound=Callable[..., Any])
ENTRY_KINDS = SPAN_KINDS[:2]  # ROLLOUT and REWARD, the kinds of an entry span (symbols are only ever appended)
IDENTITY = ("step", "rollout_id", "sample_id", "policy_version")


def _identity(signature: inspect.Signature | None, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """step, rollout_id, sample_id, policy_version from a call: arguments of those names first, then
    the attributes or keys of an argument object carrying them (the seed's RolloutInput)."""
    try:
        bound = dict(signature.bind_partial(*args, **kwargs).arguments) if signature is not None else dict(kwargs)
    except TypeError:  # the call itself is wrong: the function will say so
        bound = dict(kwargs)
    found = {k: bound[k] for k in IDENTITY if bound.get(k) is not None}
    for name, value in bound.items():
        if name in ("self", "cls") or isinstance(value, (str, bytes, int, float, bool)) or value is None:
            continue
        for key in IDENTITY:
            if key not in found and tc.field(value, key) is not None:
                found[key] = tc.field(value, key)
    return found


def _infer_kind(fn: Callable[..., Any], args: tuple) -> str:
    """REWARD when the function or its object's class names a reward (seed 000 infers it from the
    processor's base class); else ROLLOUT."""
    names = [fn.__qualname__]
    if args and not isinstance(args[0], (str, bytes, int, float, bool, dict, list, tuple)):
        names += [cls.__name__ for cls in type(args[0]).__mro__]
    return "REWARD" if any("reward" in n.lower() for n in names) else "ROLLOUT"


def wrap_traced(fn: F, start: Callable[[tuple, dict], OpenSpan | None],
          finish: Callable[[OpenSpan, tuple, dict, Any, BaseException | None], None]) -> F:
    """``fn`` (sync or async) with a span opened by ``start`` around each call and closed by ``finish``.

    ``start`` may raise (a rollout id the Span schema refuses: the call's own mistake); ``finish``
    never reaches the caller: whatever it meets (an odd response object) drops that span, counted."""
    def close(span: OpenSpan, args: tuple, kwargs: dict, result: Any, error: BaseException | None) -> None:
        try:
            finish(span, args, kwargs, result, error)
        except Exception as exc:  # noqa: BLE001 - tracing must not change what the traced call does
            span.tracer.refuse(span.name, exc)

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def traced_async(*args: Any, **kwargs: Any) -> Any:
            span = start(args, kwargs)
            if span is None:
                return await fn(*args, **kwargs)
            token = CURRENT.set(span)
            try:
                result = await fn(*args, **kwargs)
            except BaseException as exc:
                CURRENT.reset(token)
                close(span, args, kwargs, None, exc)
                raise
            CURRENT.reset(token)
            close(span, args, kwargs, result, None)
            return result
        return traced_async  # type: ignore[return-value]

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        span = start(args, kwargs)
        if span is None:
            return fn(*args, **kwargs)
        token = CURRENT.set(span)
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            CURRENT.reset(token)
            close(span, args, kwargs, None, exc)
            raise
        CURRENT.reset(token)
        close(span, args, kwargs, result, None)
        return result
    return traced  # type: ignore[return-value]


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _decorator(make: Callable[[F], F], fn: F | None) -> Any:
    """Usable bare (``@observe_tool``) or with options (``@observe_tool(name="x")``)."""
    return make(fn) if fn is not None else make


def observe_processor(fn: F | None = None, *, kind: str | None = None, name: str | None = None) -> Any:
    """The ENTRY span of a rollout or reward processor (``kind`` ROLLOUT or REWARD; default inferred)."""
    if kind is not None and kind not in ENTRY_KINDS:
        raise ValueError(f"kind must be one of {', '.join(ENTRY_KINDS)}; got {kind!r}")

    def make(f: F) -> F:
        signature = _signature(f)

        def start(args: tuple, kwargs: dict) -> OpenSpan | None:
            tracer = current_tracer()
            if tracer is None:
                return None
            return tracer.open_entry(kind or _infer_kind(f, args), name or f.__qualname__, _identity(signature, args, kwargs))

        def finish(span: OpenSpan, args: tuple, kwargs: dict, result: Any, error: BaseException | None) -> None:
            if error is None:  # a score, metrics or a failed status in what it returned (seed 000's shapes)
                read_result(span, result)
            span.tracer.finish(span, error)
        return wrap_traced(f, start, finish)
    return _decorator(make, fn)


def observe_llm(fn: F | None = None, *, name: str | None = None) -> Any:
    """An LLM span around a function that calls a model: ``model`` and ``messages`` from its keyword
    arguments, usage, finish reason and tool calls from what it returns (an OpenAI-shaped response,
    its dict, a message or a string)."""
    def make(f: F) -> F:
        def start(args: tuple, kwargs: dict) -> OpenSpan | None:
            tracer = current_tracer()
            return None if tracer is None else start_llm(tracer, name or f.__name__, kwargs)
        return wrap_traced(f, start, lambda span, args, kwargs, result, error: finish_llm(span, result, error))
    return _decorator(make, fn)


def observe_tool(fn: F | None = None, *, name: str | None = None) -> Any:
    """A TOOL span around a tool function; with content on, its arguments and result."""
    def make(f: F) -> F:
        signature = _signature(f)
        tool = name or f.__name__

        def start(args: tuple, kwargs: dict) -> OpenSpan | None:
            tracer = current_tracer()
            current = CURRENT.get()
            if tracer is None or (current is not None and current.kind == "TOOL" and current.name == tool[:v.MAX_NAME]):
                return None  # already inside this tool's span (trace_tool around a function decorated here): one span
            span = tracer.open_child("TOOL", tool)
            span.attributes.update({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": tool[:v.MAX_NAME]})
            return span

        def finish(span: OpenSpan, args: tuple, kwargs: dict, result: Any, error: BaseException | None) -> None:
            if span.content is not None:
                try:
                    bound = dict(signature.bind(*args, **kwargs).arguments) if signature is not None else dict(kwargs)
                except TypeError:
                    bound = {"args": list(args), **kwargs}
                tc.tool_content(span.content, span.attributes, tc.call_arguments(bound, bound), result, error is not None)
            span.tracer.finish(span, error)
        return wrap_traced(f, start, finish)
    return _decorator(make, fn)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _entry_of(kind: str | None, what: str) -> OpenSpan:
    current = CURRENT.get()
    entry = current.entry if current is not None else None
    while entry is not None and kind is not None and entry.kind != kind:
        entry = entry.outer
    if entry is None:
        where = f"a {kind} entry" if kind else "an entry"
        raise ValueError(f"{what} must be called inside {where} (a function decorated with @observe_processor)")
    return entry


def set_reward(reward: float) -> None:
    """The reward of the innermost entry (a REWARD entry's passes on to its ROLLOUT entry)."""
    _entry_of(None, "set_reward").fields["reward"] = v.require_finite("reward", reward)


REWARD_SPAN = "rlpulse.reward"  # the name of an emitted reward's span (seed 003's reward annotations)
REWARD_FINAL, REWARD_NAME = "rlpulse.reward.final", "rlpulse.reward.name"


def emit_reward(value: float, *, name: str | None = None, final: bool = False) -> None:
    """A reward of the current rollout at this point of it (seed 003's ``emit_reward``): a
    ANNOTATION span named ``rlpulse.reward`` with the typed ``reward``, ``rlpulse.reward.final`` and
    ``rlpulse.reward.name``, whose ``sequence_id`` places it among the rollout's calls, so an export can
    give an intermediate reward to the call before it (``rlpulse export --reward-to last-call``).

    ``final=True``: the trajectory's reward; inside an entry it is also the entry's (as ``set_reward``),
    so the streams count it. Call it inside an entry, or where ``bind_rollout`` / ``continue_trace``
    names the rollout; elsewhere it raises, since a reward of no rollout trains nothing."""
    reward = v.require_finite("reward", value)
    if type(final) is not bool:
        raise ValueError(f"emit_reward's final must be True or False, got {final!r}")
    if name is not None:
        v.require_name("emit_reward's name", name, limit=MAX_METRIC_NAME)
    tracer = current_tracer()
    if tracer is None:
        return  # current_tracer said once that nothing is traced without a Tracer
    span = tracer.open_child("ANNOTATION", REWARD_SPAN)
    if not span.rollout_id:
        raise ValueError("emit_reward must be called inside a rollout: a function decorated with @observe_processor, "
                         "or a block of bind_rollout(rollout_id=...) or continue_trace(...)")
    span.fields["reward"] = reward
    span.attributes.update({REWARD_FINAL: final, REWARD_NAME: name or ("final" if final else "reward")})
    if final and span.entry is not None:
        span.entry.fields["reward"] = reward
    tracer.finish(span, None)


def _metrics(field_name: str, kind: str, values: Mapping[str, Any]) -> None:
    entry = _entry_of(kind, field_name)
    if not isinstance(values, Mapping):
        raise ValueError(f"{field_name} must be a flat mapping of names to floats, got {type(values).__name__}")
    if len(values) > MAX_METRIC_NAMES:
        raise ValueError(f"{field_name} has {len(values)} keys; at most {MAX_METRIC_NAMES} are allowed "
                         "(seed 000: keep key metrics <= 10)")
    checked: dict[str, float] = {}
    for key, value in values.items():
        v.require_name(f"{field_name} key", key, limit=MAX_METRIC_NAME)
        if field_name == "reward_metrics" and key in ("reward", "reward_score"):
            raise ValueError(f"reward_metrics[{key!r}]: the main score goes to set_reward (or the REWARD entry's "
                             "return value) alone, not into reward_metrics (seed 000)")
        if not _is_number(value):
            raise ValueError(f"{field_name}[{key!r}] must be a float (a flat dict; non-float data does not go into "
                             f"metrics), got {type(value).__name__}")
        checked[key] = v.require_finite(f"{field_name}[{key!r}]", value)
    entry.tracer.register_metrics(field_name, list(checked))
    entry.metrics.update(checked)


def rollout_metrics(values: Mapping[str, float]) -> None:
    """Custom per-rollout metrics on the enclosing ROLLOUT entry (merged with earlier calls)."""
    _metrics("rollout_metrics", "ROLLOUT", values)


def reward_metrics(values: Mapping[str, float]) -> None:
    """Custom per-reward metrics (score dimensions) on the enclosing REWARD entry; the main score goes to set_reward."""
    _metrics("reward_metrics", "REWARD", values)


def trace_client(client: Any) -> Any:
    """``rlpulse.producers.tracing.openai_client.trace_client``, here beside the decorators."""
    from rlpulse.producers.tracing.openai_client import trace_client as wrap

    return wrap(client)
