"""``trace_client``: every ``chat.completions.create`` of an ``openai`` client becomes an LLM span.

Takes ``openai.OpenAI`` or ``AsyncOpenAI``, a ``chat.completions`` resource itself, or an object holding
such resources as ``.client`` / ``.async_client`` (LangChain's ``ChatOpenAI`` does), wraps the
resource's ``create`` in place and returns what it was given. The ``openai`` package is never
imported here: the SDK does not depend on it (it is in the ``dev`` extra, for the tests).

Each call is a span named ``chat <model>`` under the current entry (``rlpulse.producers.tracing``), with
``gen_ai.provider.name``, ``server.address`` / ``server.port`` (host and port only), the request's
model and sampling parameters, the response's model, id, finish reasons and token usage
(``gen_ai.usage.input_tokens`` / ``output_tokens``), the tools it asked for, and its latency (the
span's duration). An exception (openai's ``APIStatusError`` for an HTTP error, a timeout, a refused
connection) marks it ERROR with the error's type and HTTP status, and is re-raised. Headers,
``extra_*`` arguments and the client's API key are never recorded: the key is also registered as
a secret, replaced by ``***`` wherever it would appear in recorded content.

A streamed call (``stream=True``) is a span up to the return of the stream, without usage or
output content (attribute ``gen_ai.request.stream``); ``with_raw_response`` calls are not traced.
"""

from __future__ import annotations

import inspect
from typing import Any, TypeVar

import rlpulse.producers.tracing.spans as tracing
import rlpulse.producers.tracing.content as tc
T = TypeVar("T")
_MARK = "_rlpulse_traced"


def trace_client(client: T) -> T:
    """Trace ``client``'s chat completions (idempotent: a wrapped resource is not wrapped twice)."""
    resources = _resources(client)
    if not resources:
        raise ValueError(f"trace_client takes an openai OpenAI or AsyncOpenAI client, its chat.completions resource, "
                         f"or an object with such resources as .client / .async_client; got {type(client).__name__}")
    tc.register_secret(getattr(client, "api_key", None))
    for resource in resources:
        if not getattr(resource, _MARK, False):
            _wrap(resource)
    return client


def _resources(client: Any) -> list[Any]:
    chat = getattr(client, "chat", None)
    if chat is not None and callable(getattr(getattr(chat, "completions", None), "create", None)):
        return [chat.completions]
    if callable(getattr(client, "create", None)) and hasattr(client, "_client"):  # the resource itself
        return [client]
    return [r for r in (getattr(client, "client", None), getattr(client, "async_client", None))
            if r is not None and not isinstance(r, type) and callable(getattr(r, "create", None))]


def _server(resource: Any) -> dict[str, Any]:
    """server.address and server.port of the resource's client: never the URL's user information or path."""
    owner = getattr(resource, "_client", None)
    tc.register_secret(getattr(owner, "api_key", None))
    url = getattr(owner, "base_url", None)
    host, port = getattr(url, "host", None), getattr(url, "port", None)
    out: dict[str, Any] = {}
    if isinstance(host, str) and host:
        out["server.address"] = host[:256]
    if type(port) is int:
        out["server.port"] = port
    return out


def _wrap(resource: Any) -> None:
    original = resource.create
    fixed = {"gen_ai.provider.name": "openai", **_server(resource)}

    def create(*args: Any, **kwargs: Any) -> Any:
        tracer = tracing.current_tracer()
        if tracer is None:
            return original(*args, **kwargs)
        for name in ("messages", "tools"):  # an iterator would be spent by the recording: the client gets a list
            if kwargs.get(name) is not None and not isinstance(kwargs[name], (list, tuple)):
                kwargs[name] = list(kwargs[name])
        model = kwargs.get("model")
        span = tracing.start_llm(tracer, f"chat {model}" if isinstance(model, str) else "chat", kwargs)
        span.attributes.update(fixed)
        streamed = kwargs.get("stream") is True
        if streamed:
            span.attributes["gen_ai.request.stream"] = True
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:
            tracing.finish_llm(span, None, exc)
            raise
        if inspect.isawaitable(result):  # AsyncOpenAI: the span ends when the response has come
            return _finish_async(span, result, streamed)
        tracing.finish_llm(span, None if streamed else result, None)
        return result

    resource.create = create
    setattr(resource, _MARK, True)


async def _finish_async(span: Any, pending: Any, streamed: bool) -> Any:
    try:
        response = await pending
    except BaseException as exc:
        tracing.finish_llm(span, None, exc)
        raise
    tracing.finish_llm(span, None if streamed else response, None)
    return response
