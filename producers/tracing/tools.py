"""``trace_tool``: every call of a tool becomes one TOOL span (seed 000's ``trace_tool()``).

Takes, and returns, what it was given, traced in place where it can be:

* a LangChain ``BaseTool`` (provider ``langchain``): ``run`` and ``arun`` are the one seam every call
  goes through (``invoke`` calls ``run``, ``ainvoke`` calls ``arun`` or, for a tool without a
  coroutine, ``invoke`` in an executor; LangGraph's ``ToolNode`` calls ``invoke`` / ``ainvoke``);
  a tool built by ``langchain-mcp-adapters`` gets provider ``mcp``;
* a list, tuple or dict of tools: each is traced (a plain function's wrapper replaces it in a list or
  dict; a tuple holding one comes back as a new tuple); a LangGraph ``ToolNode``: each of ``tools_by_name``;
* an MCP ``ClientSession`` (or ``Client``): its ``call_tool``, a span named after the tool, provider
  ``mcp``; a ``CallToolResult`` with ``isError`` set is an ERROR span (``ToolCallError``);
* any other callable (sync or async): a traced wrapper is returned, as ``observe_tool`` does
  (provider ``function``, or ``provider=``).

The SDK never imports langchain, langgraph or mcp: their objects are recognised by shape and by
their class's module. Each span carries ``gen_ai.operation.name`` ``execute_tool``,
``gen_ai.tool.name``, ``rlpulse.tool.provider``, LangChain's ``gen_ai.tool.call.id``, and with
content on the call's arguments and result; it is the current span while the tool runs, so an LLM
call made by the tool nests under it. Tracing twice never makes two spans of one call.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, TypeVar
from collections.abc import Callable, Mapping, MutableMapping

import rlpulse.producers.tracing.content as tc
from rlpulse.base.errors import Error
from rlpulse.producers.sdk import events as v
from rlpulse.producers.tracing.decorators import wrap_traced
from rlpulse.producers.tracing.spans import CURRENT, OpenSpan, current_tracer

__all__ = ["PROVIDER", "ToolCallError", "trace_tool"]

T = TypeVar("T")
PROVIDER = "rlpulse.tool.provider"
_MARK = "_rlpulse_tool_provider"  # on a traced tool object or wrapper: its provider
_PATCHED = "_rlpulse_tool_patched"  # on a patched run/arun function
ACCEPTS = ("a LangChain BaseTool, a list, tuple or dict of tools, a LangGraph ToolNode, an MCP ClientSession, "
           "or a callable (with provider= for a custom tool)")


class ToolCallError(Error):
    """A tool call that reported failure in its result instead of raising (an MCP ``CallToolResult``
    with ``isError``, a LangChain ``ToolMessage`` with status ``error``): the span's error type."""


def trace_tool(target: T, provider: str | None = None) -> T:
    """Trace every call of ``target``'s tools (see the module's docstring); returns ``target``, or
    for a plain callable its traced wrapper. Raises ValueError for anything else."""
    if provider is not None:
        v.require_name("provider", provider)
    if isinstance(target, list):  # a plain function's wrapper takes its place; tools are traced in place
        target[:] = [trace_tool(item, provider) for item in target]
        return target  # type: ignore[return-value]
    if isinstance(target, tuple):  # immutable: the same tuple when every item was traced in place, else a new one
        traced = tuple(trace_tool(item, provider) for item in target)
        return target if all(a is b for a, b in zip(traced, target)) else traced  # type: ignore[return-value]
    if isinstance(target, MutableMapping):
        for key, item in list(target.items()):
            target[key] = trace_tool(item, provider)
        return target  # type: ignore[return-value]
    if isinstance(target, Mapping):
        for item in target.values():
            trace_tool(item, provider)
        return target
    if _is_tool_node(target):
        for item in target.tools_by_name.values():  # type: ignore[attr-defined]
            trace_tool(item, provider)
        return target
    if _is_langchain_tool(target):
        _trace_langchain(target, provider or _langchain_provider(target))
        return target
    if _from_module(target, "mcp") and callable(getattr(target, "call_tool", None)):
        _trace_mcp(target, provider or "mcp")
        return target
    if callable(target) and not isinstance(target, type):
        return _trace_callable(target, provider or "function")  # type: ignore[return-value]
    raise ValueError(f"trace_tool takes {ACCEPTS}; got {type(target).__module__}.{type(target).__qualname__}")


# -- recognising what was given ----------------------------------------------------------------

def _from_module(obj: Any, package: str) -> bool:
    module = type(obj).__module__ or ""
    return module == package or module.startswith(package + ".")


def _is_langchain_tool(obj: Any) -> bool:
    """BaseTool's shape: ``name``, ``args_schema``, ``run``/``arun`` and ``invoke``/``ainvoke``."""
    return (isinstance(getattr(obj, "name", None), str) and hasattr(obj, "args_schema")
            and all(callable(getattr(obj, m, None)) for m in ("run", "arun", "invoke", "ainvoke", "_run")))


def _is_tool_node(obj: Any) -> bool:
    return isinstance(getattr(obj, "tools_by_name", None), Mapping) and callable(getattr(obj, "invoke", None))


def _langchain_provider(tool: Any) -> str:
    """``mcp`` for a tool ``langchain-mcp-adapters`` made (its coroutine calls the MCP session)."""
    for fn in (getattr(tool, "coroutine", None), getattr(tool, "func", None)):
        if (getattr(fn, "__module__", None) or "").startswith("langchain_mcp_adapters"):
            return "mcp"
    return "langchain"


# -- spans ---------------------------------------------------------------------------------------

def _open(name: str, provider: str) -> OpenSpan | None:
    """A TOOL span, current while the tool runs; None when untraced or when the current span is
    already this tool's (a tool traced twice, or a traced function inside a traced tool of its name)."""
    tracer = current_tracer()
    if tracer is None:
        return None
    current = CURRENT.get()
    if current is not None and current.kind == "TOOL" and current.attributes.get("gen_ai.tool.name") == name[:v.MAX_NAME]:
        return None
    span = tracer.open_child("TOOL", name)
    span.attributes.update({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name[:v.MAX_NAME],
                            PROVIDER: provider[:v.MAX_NAME]})
    return span


def _close(span: OpenSpan, arguments: Mapping[str, Any] | None, result: Any, error: BaseException | None,
           reported_failure: bool = False) -> None:
    """Publish ``span``: content (when on), and ERROR for an exception or a failure the result reports."""
    if span.content is not None:
        tc.tool_content(span.content, span.attributes, arguments or {}, result, error is not None)
    if error is None and reported_failure:
        error = ToolCallError()
    span.tracer.finish(span, error)


# -- LangChain -------------------------------------------------------------------------------------

def _trace_langchain(tool: Any, provider: str) -> None:
    """Mark the tool with its provider and patch its class's ``run`` / ``arun`` once.

    The class, not the instance: pydantic refuses unknown attributes, and a function put in the
    instance's ``__dict__`` would stay bound to this instance in every ``model_copy``. The patched
    methods trace only marked instances; the mark lives in ``__dict__`` (``object.__setattr__``, as
    pydantic's own ``__setattr__`` refuses it), so a copy of a traced tool is traced too."""
    try:
        object.__setattr__(tool, _MARK, provider)
    except (AttributeError, TypeError) as exc:
        raise ValueError(f"trace_tool cannot mark {type(tool).__qualname__} as traced: {exc}") from None
    cls = type(tool)
    for method in ("run", "arun"):
        original = getattr(cls, method)
        if not getattr(original, _PATCHED, False):  # a traced base class's patch is inherited
            patched = wrap_traced(original, _langchain_start, _langchain_finish)
            setattr(patched, _PATCHED, True)
            setattr(cls, method, patched)


def _langchain_start(args: tuple, kwargs: dict) -> OpenSpan | None:
    tool = args[0]
    provider = getattr(tool, "__dict__", {}).get(_MARK)
    if provider is None:
        return None  # an untraced instance of a patched class
    span = _open(tool.name, provider)
    call_id = kwargs.get("tool_call_id")
    if span is not None and isinstance(call_id, str) and call_id:
        span.attributes["gen_ai.tool.call.id"] = call_id[:v.MAX_NAME]
    return span


def _langchain_arguments(tool: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    tool_input = args[1] if len(args) > 1 else kwargs.get("tool_input")
    if not isinstance(tool_input, dict):
        return {"input": tool_input}
    try:  # without what LangGraph injects (state, store, runtime): not the model's arguments
        return dict(tool._filter_injected_args(tool_input))
    except Exception:  # noqa: BLE001 - an older langchain-core without it
        return dict(tool_input)


def _langchain_finish(span: OpenSpan, args: tuple, kwargs: dict, result: Any, error: BaseException | None) -> None:
    failed = False
    if error is None and getattr(result, "tool_call_id", None) is not None and hasattr(result, "content"):
        failed = getattr(result, "status", None) == "error"  # a ToolException the tool's handle_tool_error caught
        result = result.content  # the ToolMessage's content is the tool's result
    arguments = _langchain_arguments(args[0], args, kwargs) if span.content is not None else None
    _close(span, arguments, result, error, failed)


# -- MCP -------------------------------------------------------------------------------------------

def _trace_mcp(session: Any, provider: str) -> None:
    """Wrap the session's ``call_tool`` in place (an ordinary object: an instance attribute)."""
    if getattr(session, "__dict__", {}).get(_MARK) is not None:
        return
    original = session.call_tool

    def start(args: tuple, kwargs: dict) -> OpenSpan | None:
        name = args[0] if args else kwargs.get("name")
        return _open(name if isinstance(name, str) else "call_tool", provider)

    def finish(span: OpenSpan, args: tuple, kwargs: dict, result: Any, error: BaseException | None) -> None:
        arguments = args[1] if len(args) > 1 else kwargs.get("arguments")
        is_error = tc.field(result, "is_error")
        if is_error is None:  # mcp 1.x's camelCase field
            is_error = tc.field(result, "isError")
        _close(span, arguments if isinstance(arguments, Mapping) else {}, result, error, is_error is True)

    session.call_tool = wrap_traced(original, start, finish)
    session.__dict__[_MARK] = provider


# -- plain callables -------------------------------------------------------------------------------

def _trace_callable(fn: Callable[..., Any], provider: str) -> Callable[..., Any]:
    if getattr(fn, _MARK, None) is not None:
        return fn  # already trace_tool's wrapper
    name = getattr(fn, "__name__", None) or type(fn).__name__
    try:
        signature: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None

    def finish(span: OpenSpan, args: tuple, kwargs: dict, result: Any, error: BaseException | None) -> None:
        arguments = None
        if span.content is not None:
            try:
                bound = dict(signature.bind(*args, **kwargs).arguments) if signature is not None else dict(kwargs)
            except TypeError:
                bound = {"args": list(args), **kwargs}
            arguments = tc.call_arguments(bound, bound)
        _close(span, arguments, result, error)

    target = fn
    if not inspect.isfunction(fn) and not inspect.ismethod(fn) and inspect.iscoroutinefunction(type(fn).__call__):
        async def call(*args: Any, **kwargs: Any) -> Any:  # an async __call__: wrap_traced needs a coroutine function
            return await fn(*args, **kwargs)
        target = functools.wraps(fn)(call)
    traced = wrap_traced(target, lambda args, kwargs: _open(name, provider), finish)
    setattr(traced, _MARK, provider)
    return traced
