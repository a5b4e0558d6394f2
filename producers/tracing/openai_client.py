"""``trace_client``: every ``chat.completions.create`` and ``responses.create`` of an ``openai`` client
becomes an LLM span.

Takes ``openai.OpenAI`` or ``AsyncOpenAI``, a ``chat.completions`` (or ``responses``) resource itself,
or an object holding such resources as ``.client`` / ``.async_client`` and clients as ``.root_client``
/ ``.root_async_client`` (LangChain's ``ChatOpenAI`` does: ``trace_client(llm)`` traces its
``invoke``, ``ainvoke``, ``stream``, ``astream`` and ``batch``), wraps the resources' ``create`` in place
and returns what it was given. The ``openai`` package is never imported here: the SDK does not
depend on it (it is in the ``dev`` extra, for the tests).

Each HTTP call is a span named ``chat <model>`` under the current entry (``rlpulse.producers.tracing``),
with ``gen_ai.provider.name``, ``server.address`` / ``server.port`` (host and port only), the request's
model and sampling parameters, the response's model, id, finish reasons and token usage
(``gen_ai.usage.input_tokens`` / ``output_tokens``), the tools it asked for, and its latency (the
span's duration). An exception (openai's ``APIStatusError`` for an HTTP error such as 429 or 500, a
timeout, a refused connection, a stream cut mid-way) marks it ERROR with the error's type and HTTP
status, and is re-raised unchanged. Headers, ``extra_*`` arguments and the client's API key are
never recorded: the key is also registered as a secret, replaced by ``***`` wherever it would appear
in recorded content. Every traced request carries ``spans.outgoing_headers(span)`` merged into its
``extra_headers`` (the caller's own headers win a clash), so a server can join the trace.

* **Streamed calls** (``stream=True``) return a proxy of the stream (``streams.py``) whose span ends
  when the stream does, with usage, content, finish reason and response id assembled from the
  chunks. Without ``stream_options`` from the caller (and ``Tracer(stream_usage=True)``, the default)
  the request asks for ``stream_options={"include_usage": True}`` and the proxy swallows the extra
  usage-only chunk; a caller's own ``stream_options`` is respected and every chunk passed on.
* **Raw responses** (``with_raw_response.create``, as LangChain calls it): the ``LegacyAPIResponse``
  is parsed for the span (``parse()`` caches, so the caller's own ``parse()`` gets the same object);
  a streamed one's cached stream is replaced by the proxy. ``with_raw_response`` wrappers cached
  before ``trace_client`` ran are rebuilt in place around the traced ``create``.
* **``with_streaming_response``**: the body is the caller's to read, never read here, so the span
  ends when the response headers arrive and carries no response data (no usage, content or reason).
* **The Responses API** (``responses.create``, streamed or not): the same span, its request read as
  chat (instructions and input as messages) and its response as a chat completion (output text,
  function calls as tool calls, ``input_tokens`` / ``output_tokens``, status as the finish reason:
  ``completed`` -> ``stop`` / ``tool_calls``, ``incomplete`` for ``max_output_tokens`` -> ``length``).
  Streamed, the terminal ``response.completed`` event carries it whole.
* **Token ids** (``Tracer(token_ids=True)``): vLLM's prompt and completion ids and the logprobs, capped
  (``token_ids.py``); ``Tracer(request_token_ids=True)`` asks for them (``extra_body`` gains
  ``return_token_ids: true`` under the caller's own keys, and ``logprobs=True`` unless the caller set it).

Not traced: ``chat.completions.parse`` / ``.stream`` and ``responses.parse`` / ``.stream`` (helpers that
do not go through ``create``), and raw wrappers a caller took before ``trace_client`` and that were
not cached on the resource or client.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, TypeVar

import rlpulse.producers.tracing.spans as tracing
import rlpulse.producers.tracing.dashscope_client as dashscope_client
import rlpulse.producers.tracing.content as tc
import rlpulse.producers.tracing.streams as st
import rlpulse.producers.tracing.token_ids as tid
from rlpulse.base.urls import url_problem

log = logging.getLogger(__name__)
T = TypeVar("T")
_MARK = "_rlpulse_traced"
RAW_HEADER = "x-stainless-raw-response"  # openai's with_raw_response ("true") / with_streaming_response ("stream")
_WRAPPERS = ("with_raw_response", "with_streaming_response")


def trace_client(client: T) -> T:
    """Trace ``client``'s chat completions and responses (idempotent: a wrapped resource is not wrapped twice);
    DashScope's ``Generation`` / ``AioGeneration`` class (the class itself, as seed 000 says) goes to
    ``rlpulse.producers.tracing.dashscope_client``."""
    if dashscope_client.is_dashscope_class(client):
        return dashscope_client.trace_generation(client)
    resources = _resources(client)
    if not resources:
        raise ValueError(f"trace_client takes an openai OpenAI or AsyncOpenAI client, its chat.completions resource, "
                         f"an object with such resources as .client / .async_client (LangChain's ChatOpenAI), or "
                         f"DashScope's Generation class; got {type(client).__name__}")
    tc.register_secret(getattr(client, "api_key", None))
    for resource, api in resources:
        if not getattr(resource, _MARK, False):
            _wrap(resource, api)
    owners = [client, getattr(client, "root_client", None), getattr(client, "root_async_client", None)]
    owners += [x for resource, _ in resources for x in (resource, getattr(resource, "_client", None))]
    for owner in owners:
        if owner is not None:
            _refresh_cached_wrappers(owner)
    return client


def _is_resource(obj: Any) -> bool:
    return obj is not None and not isinstance(obj, type) and callable(getattr(obj, "create", None))


def _client_resources(client: Any) -> list[tuple[Any, str]]:
    found = []
    completions = getattr(getattr(client, "chat", None), "completions", None)
    if _is_resource(completions):
        found.append((completions, "chat"))
    responses = getattr(client, "responses", None)
    if _is_resource(responses) and hasattr(responses, "_client"):
        found.append((responses, "responses"))
    return found


def _resources(client: Any) -> list[tuple[Any, str]]:
    """(resource, "chat" | "responses") pairs to wrap."""
    found = _client_resources(client)
    if found:
        return found
    if _is_resource(client) and hasattr(client, "_client"):  # a resource itself
        return [(client, "responses" if type(client).__name__.endswith("Responses") else "chat")]
    found = [(r, "chat") for r in (getattr(client, "client", None), getattr(client, "async_client", None)) if _is_resource(r)]
    for root in (getattr(client, "root_client", None), getattr(client, "root_async_client", None)):
        found += [(r, api) for r, api in _client_resources(root) if all(r is not f for f, _ in found)]
    return found


def _refresh_cached_wrappers(owner: Any, depth: int = 0) -> None:
    """Rebuild, in place, the ``with_raw_response`` / ``with_streaming_response`` wrappers cached (openai's
    ``cached_property``) on a resource or client before ``create`` was wrapped: each captured the bound
    ``create`` it was built with. A wrapper is rebuilt by constructing its class again around the traced
    resource it holds, so a reference the caller already took sees the traced ``create`` too. From a
    client the path is ``with_raw_response`` -> ``chat`` -> ``completions`` (or -> ``responses``)."""
    names = (_WRAPPERS, ("chat", "responses"), ("completions",))[depth]
    for name in names:
        cached = vars(owner).get(name) if hasattr(owner, "__dict__") else None
        if cached is None or not hasattr(cached, "__dict__"):
            continue
        target = next((x for x in vars(cached).values() if _is_resource(x) and getattr(x, _MARK, False)), None)
        if target is not None:
            try:
                vars(cached).update(vars(type(cached)(target)))
            except Exception:  # not openai's shape: leave it as it was
                log.debug("could not rebuild %s", type(cached).__name__, exc_info=True)
        elif depth < 2:
            _refresh_cached_wrappers(cached, depth + 1)


def _server(resource: Any) -> dict[str, Any]:
    """server.address and server.port of the resource's client: never the URL's user information or path."""
    owner = getattr(resource, "_client", None)
    tc.register_secret(getattr(owner, "api_key", None))
    url = getattr(owner, "base_url", None)
    host, port = getattr(url, "host", None), getattr(url, "port", None)
    if url is None or url_problem(str(url)) is not None:
        return {}  # an '@' after the host: a password with '/' in it may be what was read as the host
    out: dict[str, Any] = {}
    if isinstance(host, str) and host:
        out["server.address"] = host[:256]
    if type(port) is int:
        out["server.port"] = port
    return out


def _given(value: Any) -> bool:
    """Whether the caller set an argument (openai's NotGiven / Omit sentinels are not set)."""
    return value is not None and type(value).__name__ not in ("NotGiven", "Omit")


def _raw_mode(kwargs: dict[str, Any]) -> str | None:
    headers = kwargs.get("extra_headers")
    if not isinstance(headers, dict):
        return None
    return next((str(x) for k, x in headers.items() if isinstance(k, str) and k.lower() == RAW_HEADER), None)


def _prepare(tracer: Any, span: Any, kwargs: dict[str, Any], api: str, raw: str | None) -> bool:
    """Adjust the request: usage for streams, token ids, trace headers. True when the proxy must
    swallow the usage chunk it asked for."""
    swallow = False
    if api == "chat" and kwargs.get("stream") is True and raw != "stream" and getattr(tracer, "stream_usage", True) \
            and not _given(kwargs.get("stream_options")):
        kwargs["stream_options"] = {"include_usage": True}
        swallow = True
    if api == "chat" and getattr(tracer, "request_token_ids", False):
        body = kwargs.get("extra_body")
        kwargs["extra_body"] = {"return_token_ids": True, **(body if isinstance(body, dict) else {})}
        if not _given(kwargs.get("logprobs")):
            kwargs["logprobs"] = True
    headers = tracing.outgoing_headers(span)
    if headers:
        own = kwargs.get("extra_headers")
        kwargs["extra_headers"] = {**headers, **(own if isinstance(own, dict) else {})}
    return swallow


def _wrap(resource: Any, api: str) -> None:
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
        request = kwargs if api == "chat" else tc.responses_request(kwargs)
        span = tracing.start_llm(tracer, f"chat {model}" if isinstance(model, str) else "chat", request)
        span.attributes.update(fixed)
        streamed = kwargs.get("stream") is True
        if streamed:
            span.attributes["gen_ai.request.stream"] = True
        raw = _raw_mode(kwargs)
        try:
            swallow = _prepare(tracer, span, kwargs, api, raw)
        except Exception:  # never the traced call's failure
            log.debug("could not prepare the traced request", exc_info=True)
            swallow = False
        settle = _Settle(span, api, streamed, raw, swallow, bool(getattr(tracer, "token_ids", False)))
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:
            tracing.finish_llm(span, None, exc)
            raise
        if inspect.isawaitable(result):  # AsyncOpenAI: the span ends when the response has come
            return settle.later(result)
        return settle(result)

    resource.create = create
    setattr(resource, _MARK, True)


class _Settle:
    """What happens to a call's result: a stream becomes a proxy, anything else closes the span."""

    def __init__(self, span: Any, api: str, streamed: bool, raw: str | None, swallow: bool, token_ids: bool):
        self.span, self.api, self.streamed, self.raw = span, api, streamed, raw
        self.swallow, self.token_ids = swallow, token_ids

    async def later(self, pending: Any) -> Any:
        try:
            result = await pending
        except BaseException as exc:
            tracing.finish_llm(self.span, None, exc)
            raise
        return self(result)

    def _proxy(self, stream: Any) -> Any:
        assembler = (st.ChatAssembler(self.swallow, keep_text=self.span.content is not None, keep_ids=self.token_ids)
                     if self.api == "chat" else st.ResponsesAssembler())
        return st.wrap_stream(stream, self.span, assembler, self.token_ids)

    def _finish(self, response: Any) -> None:
        if self.token_ids and self.api == "chat":
            try:
                self.span.attributes.update(tid.token_id_attributes(response))
            except Exception:
                log.debug("could not read token ids", exc_info=True)
        tracing.finish_llm(self.span, response, None)

    def __call__(self, result: Any) -> Any:
        if self.raw == "stream":  # with_streaming_response: the body is the caller's to read
            tracing.finish_llm(self.span, None, None)
            return result
        if self.raw is not None and callable(getattr(result, "parse", None)):
            return self._raw(result)
        if self.streamed:
            return self._proxy(result)
        self._finish(result)
        return result

    def _raw(self, result: Any) -> Any:
        """A LegacyAPIResponse: parse it now (cached for the caller); a stream's cache gets the proxy."""
        try:
            parsed = result.parse()
        except Exception as exc:  # the caller's own parse() raises it again
            tracing.finish_llm(self.span, None, exc)
            return result
        if not self.streamed:
            self._finish(parsed)
            return result
        proxy = self._proxy(parsed)
        cache = getattr(result, "_parsed_by_type", None)
        if isinstance(cache, dict):
            for key, value in list(cache.items()):
                if value is parsed:
                    cache[key] = proxy
        return result
