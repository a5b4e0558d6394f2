"""DashScope's ``Generation`` (and ``AioGeneration``) class: every ``call`` becomes one LLM span.

Seed 000: ``trace_client(Generation)`` takes the class itself, not an instance; ``call`` is a
classmethod, so the class's ``call`` is replaced (once: a traced class is not wrapped twice). The
``dashscope`` package is never imported here; the SDK recognises the class by its module.

Each call is a span named ``chat <model>`` under the current span, with ``gen_ai.provider.name``
``dashscope``, ``server.address`` / ``server.port`` of ``dashscope.base_http_api_url`` (or the
call's ``base_address``), the request's model and sampling parameters, DashScope's usage
(``usage.input_tokens`` / ``output_tokens``), its ``request_id`` as ``gen_ai.response.id``, the finish
reason and, with content on, the messages in and out (``output.choices[].message`` with
``result_format='message'``, else ``output.text``). DashScope returns a failed call as a response
with ``status_code`` != 200 rather than raising: that is an ERROR span (``DashScopeError``) with
``http.response.status_code`` and DashScope's error code in ``dashscope.error.code``; an exception
(a refused connection) is an ERROR span too, and is re-raised.

A streamed call (``stream=True``) returns a generator of responses: its span ends when the
generator is exhausted, closed or fails, with the last response's usage and the whole output
(chunks concatenated under ``incremental_output=True``, the last chunk otherwise, as DashScope's
chunks are then cumulative). The call's ``api_key`` (and ``dashscope.api_key``) is registered as a
secret. Headers from ``spans.outgoing_headers`` go out with the request (``headers=``), under the
caller's own.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, TypeVar
from collections.abc import AsyncIterator, Iterator, Mapping
from urllib.parse import urlsplit

import rlpulse.producers.tracing.content as tc
from rlpulse.base.errors import Error
from rlpulse.base.urls import url_problem
import rlpulse.producers.tracing.spans as tracing

__all__ = ["DashScopeError", "is_dashscope_class", "trace_generation"]

T = TypeVar("T")
_MARK = "_rlpulse_traced"
_OK = 200
_EXTRA_PARAMS = {"top_k": "gen_ai.request.top_k"}  # beyond content.REQUEST_PARAMS, which OpenAI does not have


class DashScopeError(Error):
    """A DashScope response with a status code other than 200 (DashScope returns it, never raises)."""

    def __init__(self, status_code: int, code: str | None):
        super().__init__(status_code)
        self.status_code = status_code
        self.code = code


def is_dashscope_class(obj: Any) -> bool:
    """A class of the ``dashscope`` package with a ``call`` classmethod (``Generation``, ``AioGeneration``)."""
    return isinstance(obj, type) and (obj.__module__ or "").split(".")[0] == "dashscope" \
        and isinstance(inspect.getattr_static(obj, "call", None), classmethod)


def trace_generation(cls: T) -> T:
    """Trace every ``cls.call(...)`` (``Generation`` or ``AioGeneration``); returns ``cls``."""
    if not is_dashscope_class(cls):
        raise ValueError(f"trace_generation takes DashScope's Generation or AioGeneration class itself (not an "
                         f"instance); got {cls!r}")
    _register_default_key()
    if cls.__dict__.get(_MARK):  # type: ignore[attr-defined]
        return cls
    original = inspect.getattr_static(cls, "call").__func__
    signature = inspect.signature(original)
    if inspect.iscoroutinefunction(original):
        async def call_async(klass: Any, *args: Any, **kwargs: Any) -> Any:
            span = _start(signature, klass, args, kwargs)
            if span is None:
                return await original(klass, *args, **kwargs)
            try:
                result = await original(klass, *args, **kwargs)
            except BaseException as exc:
                tracing.finish_llm(span, None, exc)
                raise
            if hasattr(result, "__aiter__") and not isinstance(result, Mapping):
                return _astream(span, result, _incremental(signature, args, kwargs))
            _finish(span, _one(result))
            return result
        wrapper: Any = call_async
    else:
        def call(klass: Any, *args: Any, **kwargs: Any) -> Any:
            span = _start(signature, klass, args, kwargs)
            if span is None:
                return original(klass, *args, **kwargs)
            try:
                result = original(klass, *args, **kwargs)
            except BaseException as exc:
                tracing.finish_llm(span, None, exc)
                raise
            if inspect.isgenerator(result) or (hasattr(result, "__next__") and not isinstance(result, Mapping)):
                return _stream(span, result, _incremental(signature, args, kwargs))
            _finish(span, _one(result))
            return result
        wrapper = call
    wrapper.__name__, wrapper.__qualname__, wrapper.__doc__ = original.__name__, original.__qualname__, original.__doc__
    wrapper.__wrapped__ = original
    type.__setattr__(cls, "call", classmethod(wrapper))  # type: ignore[arg-type]
    type.__setattr__(cls, _MARK, True)  # type: ignore[arg-type]
    return cls


def _one(response: Any) -> _Collected:
    collected = _Collected(False)
    collected.add(response)
    return collected


def _dashscope_module() -> Any:
    return sys.modules.get("dashscope")


def _register_default_key() -> None:
    tc.register_secret(getattr(_dashscope_module(), "api_key", None))


def _arguments(signature: inspect.Signature, klass: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    try:
        bound = signature.bind_partial(klass, *args, **kwargs).arguments
    except TypeError:  # the call itself is wrong: DashScope will say so
        return dict(kwargs)
    named = {k: val for k, val in bound.items() if k not in ("cls", "kwargs")}
    named.update(bound.get("kwargs") or {})
    return named


def _incremental(signature: inspect.Signature, args: tuple, kwargs: dict) -> bool:
    return _arguments(signature, None, args, kwargs).get("incremental_output") is True


def _server(call: Mapping[str, Any]) -> dict[str, Any]:
    """server.address / server.port of the URL the call goes to: host and port only."""
    url = call.get("base_address") or getattr(_dashscope_module(), "base_http_api_url", None)
    if not isinstance(url, str) or url_problem(url) is not None:
        return {}  # an '@' after the host: a password with '/' in it may be what urlsplit reads as the host
    try:
        parts = urlsplit(url)
        port = parts.port or {"https": 443, "http": 80}.get(parts.scheme)
    except ValueError:
        return {}
    out: dict[str, Any] = {}
    if parts.hostname:
        out["server.address"] = parts.hostname[:256]
    if port is not None:
        out["server.port"] = port
    return out


def _start(signature: inspect.Signature, klass: Any, args: tuple, kwargs: dict) -> tracing.OpenSpan | None:
    tracer = tracing.current_tracer()
    if tracer is None:
        return None
    call = _arguments(signature, klass, args, kwargs)
    tc.register_secret(call.get("api_key"))
    _register_default_key()
    request = {k: val for k, val in call.items() if k in tc.REQUEST_PARAMS or k == "tools"}
    messages = list(call["messages"]) if isinstance(call.get("messages"), (list, tuple)) else []
    if isinstance(call.get("prompt"), str) and call["prompt"]:  # DashScope sends a prompt as the last user message
        messages.append({"role": "user", "content": call["prompt"]})
    request["messages"] = messages
    model = call.get("model")
    span = tracing.start_llm(tracer, f"chat {model}" if isinstance(model, str) else "chat", request)
    span.attributes.update({"gen_ai.provider.name": "dashscope", **_server(call)})
    for name, key in _EXTRA_PARAMS.items():
        if isinstance(call.get(name), (int, float)) and not isinstance(call[name], bool):
            span.attributes[key] = call[name]
    if call.get("stream") is True:
        span.attributes["gen_ai.request.stream"] = True
    headers = tracing.outgoing_headers(span)
    if headers:  # the caller's own headers win; their dict is not changed (dashscope pops from it)
        caller = kwargs.get("headers")
        kwargs["headers"] = {**headers, **(caller if isinstance(caller, Mapping) else {})}
    return span


class _Collected:
    """What a call returned: the one response, or a stream's chunks merged as they come (the last
    chunk alone when they are cumulative), and the first failed one."""

    def __init__(self, incremental: bool):
        self.incremental = incremental
        self.last: Any = None
        self.failed: Any = None
        self.choices: dict[int, dict[str, Any]] = {}
        self.broken: Exception | None = None

    def add(self, response: Any) -> None:
        try:
            self._add(response)
        except Exception as exc:  # noqa: BLE001 - an odd response drops the span (counted), never the call
            self.broken = exc

    def _add(self, response: Any) -> None:
        if self.failed is None and _status(response) != _OK:
            self.failed = response
        self.last = response
        if not self.incremental:
            self.choices = {}
        output = tc.field(response, "output") or {}
        listed = tc.field(output, "choices")
        if not listed and tc.field(output, "text") is not None:  # result_format='text'
            listed = [{"message": {"role": "assistant", "content": tc.field(output, "text")},
                       "finish_reason": tc.field(output, "finish_reason")}]
        for position, choice in enumerate(listed or []):
            index = tc.field(choice, "index")
            _merge(self.choices.setdefault(index if isinstance(index, int) else position, {}), choice)

    def openai_shaped(self) -> dict[str, Any]:
        """The call's response as ``content.response_attributes`` reads it (OpenAI's chat shape)."""
        return {"id": tc.field(self.last, "request_id"), "usage": tc.field(self.last, "usage"),
                "choices": [self.choices[i] for i in sorted(self.choices)]}


def _finish(span: tracing.OpenSpan, collected: _Collected, error: BaseException | None = None) -> None:
    """Close ``span``; whatever an odd response makes this meet drops the span (counted), never the call."""
    try:
        if collected.broken is not None:
            raise collected.broken
        if error is None and collected.failed is not None:
            failed = collected.failed
            code = tc.field(failed, "code")
            if isinstance(code, str) and code:
                span.attributes["dashscope.error.code"] = code[:256]
            request_id = tc.field(failed, "request_id")
            if isinstance(request_id, str) and request_id:
                span.attributes["gen_ai.response.id"] = request_id[:256]
            error = DashScopeError(_status(failed), code if isinstance(code, str) else None)
        shaped = collected.openai_shaped() if error is None and collected.last is not None else None
    except Exception as exc:  # noqa: BLE001 - tracing must not change what the traced call does
        span.tracer.refuse(span.name, exc)
        return
    tracing.finish_llm(span, shaped, error)


def _status(response: Any) -> int:
    status = tc.field(response, "status_code")
    return int(status) if isinstance(status, int) else _OK


def _merge(into: dict[str, Any], choice: Any) -> None:
    """Add one chunk's choice to ``into``: strings concatenated, tool calls merged by index (DashScope's
    incremental chunks carry only what is new)."""
    reason = tc.field(choice, "finish_reason")
    if isinstance(reason, str) and reason and reason != "null":  # "null": DashScope's chunk before the last
        into["finish_reason"] = reason
    message = tc.field(choice, "message")
    if not isinstance(message, Mapping):
        return
    merged = into.setdefault("message", {})
    for key, value in message.items():
        if key == "tool_calls" and isinstance(value, list):
            calls = merged.setdefault("tool_calls", [])
            for position, call in enumerate(value):
                index = tc.field(call, "index")
                index = index if isinstance(index, int) else position
                while len(calls) <= index:
                    calls.append({})
                _merge_call(calls[index], call)
        elif isinstance(value, str) and isinstance(merged.get(key), str) and key != "role":
            merged[key] += value
        elif value is not None and value != "":
            merged[key] = value
        else:
            merged.setdefault(key, value)


def _merge_call(into: dict[str, Any], call: Any) -> None:
    for key, value in (call.items() if isinstance(call, Mapping) else []):
        if key == "function" and isinstance(value, Mapping):
            function = into.setdefault("function", {})
            for name, part in value.items():
                if name == "arguments" and isinstance(part, str):
                    function["arguments"] = function.get("arguments", "") + part
                elif part:
                    function[name] = part
        elif value not in (None, ""):
            into[key] = value


def _stream(span: tracing.OpenSpan, stream: Iterator[Any], incremental: bool) -> Iterator[Any]:
    """``stream`` as it was, the span ending with it: exhausted, closed early, or failing."""
    collected = _Collected(incremental)
    try:
        for response in stream:
            collected.add(response)
            yield response
    except GeneratorExit:  # the caller stopped reading: the span covers what it read
        _finish(span, collected)
        raise
    except BaseException as exc:
        _finish(span, collected, exc)
        raise
    _finish(span, collected)


async def _astream(span: tracing.OpenSpan, stream: AsyncIterator[Any], incremental: bool) -> AsyncIterator[Any]:
    collected = _Collected(incremental)
    try:
        async for response in stream:
            collected.add(response)
            yield response
    except GeneratorExit:
        _finish(span, collected)
        raise
    except BaseException as exc:
        _finish(span, collected, exc)
        raise
    _finish(span, collected)
