"""Streamed LLM calls: a proxy of the ``openai`` ``Stream`` / ``AsyncStream`` that closes the call's span.

``trace_client`` returns ``TracedStream`` (sync) or ``TracedAsyncStream`` in place of the stream a
``create(stream=True)`` returned. The proxy hands every chunk to the caller unchanged, keeps the
stream's own API (``with`` / ``async with``, iteration, ``close()``, ``aclose()``, ``.response`` and
any other attribute through ``__getattr__``) and feeds each chunk to an assembler:

* ``ChatAssembler`` (``chat.completions``) rebuilds a ``ChatCompletion``-shaped dict: text deltas
  joined, tool-call deltas merged by index (id, name, arguments concatenated), role, finish reason,
  response id and model, ``usage`` from the final chunk, and vLLM's token ids and logprobs.
* ``ResponsesAssembler`` (the Responses API) keeps the ``response`` of the terminal event
  (``response.completed`` / ``incomplete`` / ``failed``), which carries the whole response.

The span is closed exactly once (``spans.finish_llm``), when the stream is exhausted, closed
(``close()``, ``__exit__``, ``aclose()``, ``__aexit__``) or garbage-collected (``weakref.finalize``):
its end is that moment, so its duration covers the stream. A collected stream therefore ends at
collection (promptly in CPython once the last reference goes). An exception raised by the
iteration (a connection cut mid-stream, a cancelled ``__anext__``) closes it ERROR with that
exception's type and is re-raised. A stream closed before its end is recorded with what arrived,
marked ``rlpulse.stream.closed_early``. A stream that ended without usage is marked
``rlpulse.usage_missing``.

When the wrapper itself asked for usage (``stream_options.include_usage`` injected), the extra
usage-only chunk (``choices == []``) is read and swallowed, so the caller sees the stream it asked for.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import rlpulse.producers.tracing.spans as tracing
import rlpulse.producers.tracing.content as tc
import rlpulse.producers.tracing.token_ids as tid

log = logging.getLogger(__name__)
USAGE_MISSING = "rlpulse.usage_missing"
CLOSED_EARLY = "rlpulse.stream.closed_early"


def _plain_items(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else []


TEXT_CAP = 1 << 20  # characters of a stream's text kept for its content attribute (which the content cap cuts far below)


class ChatAssembler:
    """Chat completion chunks -> one ``ChatCompletion``-shaped dict (``result``).

    What it keeps is bounded by what will be recorded: text and tool-call arguments only when content
    is on (``keep_text``; at most ``TEXT_CAP`` characters), token ids and logprob values only when
    token ids are (``keep_ids``; the float of each logprob, never the whole object); the rest (usage,
    finish reason, ids, tool names) is a few fields however long the stream."""

    def __init__(self, swallow_usage: bool, keep_text: bool = True, keep_ids: bool = True):
        self.swallow_usage = swallow_usage
        self.keep_text, self.keep_ids = keep_text, keep_ids
        self.text_kept = 0
        self.top: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: Any = None
        self.prompt_token_ids: list[Any] | None = None

    def add(self, chunk: Any) -> bool:
        """Take one chunk; False when the caller must not see it (the usage chunk the wrapper asked for)."""
        for name in ("id", "model", "created", "system_fingerprint"):
            value = tc.field(chunk, name)
            if value is not None and name not in self.top:
                self.top[name] = value
        usage = tc.field(chunk, "usage")
        if usage is not None:
            self.usage = usage
        prompt_ids = tc.field(chunk, "prompt_token_ids") if self.keep_ids else None
        if prompt_ids is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = _plain_items(prompt_ids)
        choices = tc.field(chunk, "choices")
        for choice in _plain_items(choices):
            self._choice(choice)
        return not (self.swallow_usage and usage is not None and not choices)

    def _choice(self, choice: Any) -> None:
        index = tc.field(choice, "index")
        index = index if isinstance(index, int) else 0
        slot = self.choices.setdefault(index, {"index": index, "role": None, "text": [], "tools": {},
                                               "finish_reason": None, "token_ids": [], "logprobs": []})
        delta = tc.field(choice, "delta")
        if delta is not None:
            slot["role"] = slot["role"] or tc.field(delta, "role")
            text = tc.field(delta, "content")
            if isinstance(text, str) and self.keep_text and self.text_kept < TEXT_CAP:
                slot["text"].append(text[:TEXT_CAP - self.text_kept])
                self.text_kept += len(slot["text"][-1])
            for call in _plain_items(tc.field(delta, "tool_calls")):
                self._tool_call(slot["tools"], call, self.keep_text)
            if self.keep_ids:
                slot["token_ids"].extend(_plain_items(tc.field(delta, "token_ids")))  # vLLM, delta-level
        if not self.keep_ids:
            reason = tc.field(choice, "finish_reason")
            if reason is not None:
                slot["finish_reason"] = reason
            return
        slot["token_ids"].extend(_plain_items(tc.field(choice, "token_ids")))  # vLLM, choice-level
        logprobs = tc.field(choice, "logprobs")
        if logprobs is not None:  # the value only: an entry's object (with its top_logprobs) is many times larger
            slot["logprobs"].extend({"logprob": tc.field(item, "logprob")}
                                    for item in _plain_items(tc.field(logprobs, "content")))
        reason = tc.field(choice, "finish_reason")
        if reason is not None:
            slot["finish_reason"] = reason

    @staticmethod
    def _tool_call(tools: dict[int, dict[str, Any]], call: Any, keep_arguments: bool) -> None:
        index = tc.field(call, "index")
        index = index if isinstance(index, int) else len(tools)
        slot = tools.setdefault(index, {"id": None, "type": "function", "function": {"name": [], "arguments": []}})
        for name in ("id", "type"):
            if isinstance(tc.field(call, name), str):
                slot[name] = tc.field(call, name)
        function = tc.field(call, "function")
        if function is not None:
            for name in ("name", "arguments"):  # the name comes whole in one chunk; arguments in pieces (joined once)
                piece = tc.field(function, name)
                if isinstance(piece, str) and (name == "name" or keep_arguments):
                    slot["function"][name].append(piece)

    def result(self) -> dict[str, Any]:
        choices = []
        for index in sorted(self.choices):
            slot = self.choices[index]
            message: dict[str, Any] = {"role": slot["role"] or "assistant",
                                       "content": "".join(slot["text"]) if slot["text"] else None}
            if slot["tools"]:
                message["tool_calls"] = [{**call, "function": {k: "".join(pieces) for k, pieces in call["function"].items()}}
                                         for call in (slot["tools"][i] for i in sorted(slot["tools"]))]
            choice: dict[str, Any] = {"index": index, "message": message, "finish_reason": slot["finish_reason"]}
            if slot["token_ids"]:
                choice["token_ids"] = slot["token_ids"]
            if slot["logprobs"]:
                choice["logprobs"] = {"content": slot["logprobs"]}
            choices.append(choice)
        out: dict[str, Any] = {**self.top, "object": "chat.completion", "choices": choices}
        if self.usage is not None:
            out["usage"] = self.usage
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = self.prompt_token_ids
        return out


class ResponsesAssembler:
    """Responses API events -> the final response (``response.completed`` carries it whole) as chat."""

    TERMINAL = ("response.completed", "response.incomplete", "response.failed")

    def __init__(self) -> None:
        self.response: Any = None
        self.partial: dict[str, Any] = {}

    def add(self, event: Any) -> bool:
        kind = tc.field(event, "type")
        if kind in self.TERMINAL or (kind == "response.created" and self.response is None):
            self.response = tc.field(event, "response")
        return True

    def result(self) -> dict[str, Any]:
        return tc.responses_as_chat(self.response) if self.response is not None else {"choices": []}


class _Closer:
    """The once-only end of a streamed call's span; holds no reference to the proxy (so GC can run)."""

    def __init__(self, span: Any, assembler: ChatAssembler | ResponsesAssembler, token_ids: bool):
        self.span, self.assembler, self.token_ids = span, assembler, token_ids
        self.lock = threading.Lock()
        self.done = False

    def finish(self, error: BaseException | None, early: bool = False) -> None:
        with self.lock:
            if self.done:
                return
            self.done = True
        response = None
        if error is None:
            try:
                response = self.assembler.result()
                if early:
                    self.span.attributes[CLOSED_EARLY] = True
                if tc.field(response, "usage") is None:
                    self.span.attributes[USAGE_MISSING] = True
                if self.token_ids:
                    self.span.attributes.update(tid.token_id_attributes(response))
            except Exception:  # tracing never breaks the traced call
                log.debug("could not assemble a streamed response", exc_info=True)
        tracing.finish_llm(self.span, response, error)


class _Proxy:
    """What both proxies share: the closer, attribute passthrough and finishing on collection."""

    def __init__(self, stream: Any, span: Any, assembler: ChatAssembler | ResponsesAssembler, token_ids: bool):
        self._stream = stream
        self._assembler = assembler
        self._closer = _Closer(span, assembler, token_ids)
        self._finalizer = weakref.finalize(self, self._closer.finish, None, True)
        self._finalizer.atexit = False  # nothing is published while the interpreter shuts down
        self._ended = False

    def __getattr__(self, name: str) -> Any:  # .response, ._iterator, ... of the openai stream
        if name.startswith("__") or name in ("_stream", "_closer", "_assembler", "_finalizer", "_ended"):
            raise AttributeError(name)
        return getattr(self._stream, name)

    def _fail(self, error: BaseException) -> None:
        self._finalizer.detach()
        self._closer.finish(error)

    def _end(self, early: bool) -> None:
        self._finalizer.detach()
        self._closer.finish(None, early and not self._ended)


class TracedStream(_Proxy):
    """A sync ``Stream`` whose span ends with it."""

    def __iter__(self) -> TracedStream:
        return self

    def __next__(self) -> Any:
        while True:
            try:
                chunk = next(self._stream)
            except StopIteration:
                self._ended = True
                self._end(early=False)
                raise
            except BaseException as exc:
                self._fail(exc)
                raise
            if self._assembler.add(chunk):
                return chunk

    def __enter__(self) -> TracedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._stream.close()
        finally:
            self._end(early=True)


class TracedAsyncStream(_Proxy):
    """An ``AsyncStream`` whose span ends with it."""

    def __aiter__(self) -> TracedAsyncStream:
        return self

    async def __anext__(self) -> Any:
        while True:
            try:
                chunk = await self._stream.__anext__()
            except StopAsyncIteration:
                self._ended = True
                self._end(early=False)
                raise
            except BaseException as exc:  # CancelledError too: the stream is abandoned mid-way
                self._fail(exc)
                raise
            if self._assembler.add(chunk):
                return chunk

    async def __aenter__(self) -> TracedAsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        try:
            await self._stream.close()
        finally:
            self._end(early=True)

    async def aclose(self) -> None:
        await self.close()


def wrap_stream(stream: Any, span: Any, assembler: ChatAssembler | ResponsesAssembler,
                token_ids: bool) -> TracedStream | TracedAsyncStream:
    """The proxy for ``stream``: async when it is an async iterator."""
    if hasattr(stream, "__anext__"):
        return TracedAsyncStream(stream, span, assembler, token_ids)
    return TracedStream(stream, span, assembler, token_ids)
