"""An OpenAI-compatible chat completions server on loopback, for tests of the real ``openai`` client.

``POST /v1/chat/completions`` answers as OpenAI does (``chat.completion`` objects with ``usage``);
what it answers is decided by the request, so a test knows each reply:

* model ``fail-500``: HTTP 500 with an OpenAI error body; ``bad-400``: HTTP 400; ``fail-429``: HTTP 429
  (a rate limit); ``slow``: answers after ``slow_s`` seconds (longer than a test's client timeout);
* a request offering ``tools`` whose last message is not a tool result: one tool call of the first
  tool (``finish_reason`` ``tool_calls``, no content), arguments from ``TOOL_ARGUMENTS``;
* anything else: ``answer: <the last message's content>`` (``finish_reason`` ``stop``), cut to
  ``max_tokens`` (or ``max_completion_tokens``) tokens when longer (``finish_reason`` ``length``);
* a last message containing ``ECHO_KEY``: the reply quotes the request's bearer token (a server
  that echoes the API key, to prove the tracer never records it).

``stream: true`` answers the same reply as server-sent events, ``chunk_delay_s`` (20 ms) apart: a
first chunk with the role, the text (or the tool call's arguments) in ``PIECES`` chunks, a chunk with
the finish reason, then, only when ``stream_options.include_usage`` is set (as OpenAI does), a last
chunk with ``choices: []`` and the usage; then ``data: [DONE]``. Model ``break-stream`` sends
``BREAK_AFTER`` chunks, then closes the connection mid-body (a chunked body never terminated).

vLLM's extras: ``return_token_ids: true`` adds the top-level ``prompt_token_ids`` (one id per
character of the messages' contents, ``ord``) and ``choices[].token_ids`` (one per character of the
reply's text or tool arguments), and the usage counts become those lists' lengths, as vLLM's are
(model ``ids-mismatch``: one prompt token more than ids, as a server that re-tokenized would say);
``logprobs: true`` adds ``choices[].logprobs.content`` (a logprob
per character, ``-(i % 8) / 8``, exact in binary). Streamed, the prompt ids come on the first chunk
and each chunk carries its piece's ids and logprobs at the choice level.

``POST /v1/responses`` answers the Responses API the same way (``output_text`` ``answer: <input>``,
``input_tokens`` / ``output_tokens``; streamed: ``response.created``, ``response.output_text.delta``
events and ``response.completed`` with the whole response).

Every request body, its bearer token, its headers and every reply body are kept (``requests``,
``tokens``, ``headers``, ``replies``) in order, so a test compares what was sent and received with
what was exported; a streamed reply is kept as the completion its chunks add up to, and its chunks
in ``chunks`` (None for a request not streamed). Usage counts are deterministic: prompt tokens from
the messages' lengths, completion tokens from the reply's.
"""

from __future__ import annotations

import copy
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TOOL_ARGUMENTS = '{"expression": "6*7"}'
ECHO_KEY = "please echo the key"
PIECES = 3  # content (or arguments) chunks of a streamed reply
BREAK_AFTER = 2  # chunks break-stream sends before it cuts the connection
ERRORS = {"fail-500": (500, "server_error", "the engine fell over"), "bad-400": (400, "invalid_request_error", "bad request"),
          "fail-429": (429, "rate_limit_exceeded", "rate limited")}


def _tokens(text: str) -> int:
    return len(text) // 4 + 1


def _logprob(i: int) -> float:
    return -(i % 8) / 8


def _split(text: str, parts: int) -> list[str]:
    size = max(1, -(-len(text) // parts))
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


class FakeOpenAI:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.replies: list[tuple[int, dict[str, Any]]] = []  # (HTTP status, body)
        self.tokens: list[str] = []
        self.headers: list[dict[str, str]] = []  # each request's headers (names lower-cased)
        self.chunks: list[list[dict[str, Any]] | None] = []  # a streamed request's chunks as sent
        self.chunk_delay_s = 0.02
        self.slow_s = 1.0
        self._lock = threading.Lock()
        self._count = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # chunked bodies for streams, so a cut one is an error

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                headers = {k.lower(): x for k, x in self.headers.items()}
                try:
                    outer._serve(self, self.path, body, token, headers)
                except OSError:
                    pass  # the client went away (a timeout): nothing to answer to
                self.close_connection = True

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-openai", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> FakeOpenAI:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- answering -------------------------------------------------------------------------------
    def _serve(self, handler: BaseHTTPRequestHandler, path: str, body: dict[str, Any], token: str,
               headers: dict[str, str]) -> None:
        with self._lock:
            self._count += 1
            n = self._count
            self.requests.append(body)
            self.tokens.append(token)
            self.headers.append(headers)
            self.chunks.append(None)
            self.replies.append((0, {}))  # filled in below, at the request's index: a slow reply keeps its place
            index = len(self.requests) - 1
        model = body.get("model", "")
        if model == "slow":
            time.sleep(self.slow_s)
        status, reply = self._answer(n, path, body, token)
        streamed = status == 200 and body.get("stream") is True
        with self._lock:
            self.replies[index] = (status, reply)
            if streamed:
                self.chunks[index] = []
        if not streamed:
            data = json.dumps(reply).encode()
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(data)))
            handler.send_header("Connection", "close")
            handler.end_headers()
            handler.wfile.write(data)
            return
        events = (self._response_events(reply) if path == "/v1/responses"
                  else [(None, c) for c in self._chat_chunks(reply, body)])
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.send_header("Connection", "close")
        handler.end_headers()
        for i, (event, chunk) in enumerate(events):
            if i:
                time.sleep(self.chunk_delay_s)
            if model == "break-stream" and i == BREAK_AFTER:
                handler.wfile.flush()
                handler.connection.shutdown(socket.SHUT_RDWR)  # mid-body: no terminating chunk
                return
            self._send_chunk(handler, (f"event: {event}\n" if event else "") + f"data: {json.dumps(chunk)}\n\n")
            with self._lock:
                self.chunks[index].append(chunk)  # type: ignore[union-attr]
        self._send_chunk(handler, "data: [DONE]\n\n")
        handler.wfile.write(b"0\r\n\r\n")
        handler.wfile.flush()

    @staticmethod
    def _send_chunk(handler: BaseHTTPRequestHandler, text: str) -> None:
        data = text.encode()
        handler.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        handler.wfile.flush()

    def _answer(self, n: int, path: str, body: dict[str, Any], token: str) -> tuple[int, dict[str, Any]]:
        model = body.get("model", "")
        if path not in ("/v1/chat/completions", "/v1/responses"):
            return 404, {"error": {"message": f"no route {path}", "type": "invalid_request_error"}}
        if model in ERRORS:
            status, kind, message = ERRORS[model]
            return status, {"error": {"message": message, "type": kind, "code": None}}
        if path == "/v1/responses":
            return 200, self._response(n, body)
        return 200, self._completion(n, body, token)

    def _completion(self, n: int, body: dict[str, Any], token: str) -> dict[str, Any]:
        messages, model = body.get("messages", []), body.get("model", "")
        last = messages[-1] if messages else {}
        prompt = sum(_tokens(json.dumps(m.get("content"))) for m in messages)
        if body.get("tools") and last.get("role") != "tool":
            name = body["tools"][0]["function"]["name"]
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": TOOL_ARGUMENTS}}]}
            reason, completion, said = "tool_calls", _tokens(TOOL_ARGUMENTS) + 5, TOOL_ARGUMENTS
        else:
            text = f"answer: {last.get('content')}"
            if ECHO_KEY in str(last.get("content")):
                text += f" (your key is {token})"
            reason, limit = "stop", body.get("max_completion_tokens") or body.get("max_tokens")
            if type(limit) is int and _tokens(text) > limit:  # cut at the limit, as a server does: clipped
                text, reason = text[:max(limit - 1, 0) * 4], "length"
            message, completion, said = {"role": "assistant", "content": text}, _tokens(text), text
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
        reply: dict[str, Any] = {
            "id": f"chatcmpl-{n}", "object": "chat.completion", "created": 1_700_000_000 + n,
            "model": f"{body.get('model')}-served", "system_fingerprint": "fp_test", "choices": [choice],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
        if body.get("return_token_ids") is True:  # as vLLM: the usage counts are the ids' lengths
            reply["prompt_token_ids"] = [ord(c) for m in messages for c in str(m.get("content") or "")]
            choice["token_ids"] = [ord(c) for c in said]
            prompt, completion = len(reply["prompt_token_ids"]), len(choice["token_ids"])
            if model == "ids-mismatch":  # a server whose usage disagrees with its ids (a proxy that re-tokenized)
                prompt += 1
            reply["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if body.get("logprobs") is True:
            choice["logprobs"] = {"content": [{"token": c, "logprob": _logprob(i), "bytes": list(c.encode()),
                                               "top_logprobs": []} for i, c in enumerate(said)]}
        return reply

    def _chat_chunks(self, reply: dict[str, Any], body: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks a streamed ``reply`` is sent as (see the module docstring)."""
        usage_asked = (body.get("stream_options") or {}).get("include_usage") is True
        base = {"id": reply["id"], "object": "chat.completion.chunk", "created": reply["created"], "model": reply["model"],
                "system_fingerprint": reply["system_fingerprint"]}
        if usage_asked:
            base["usage"] = None  # OpenAI's: null on every chunk but the last
        choice, message = reply["choices"][0], reply["choices"][0]["message"]
        calls = message.get("tool_calls")
        said = calls[0]["function"]["arguments"] if calls else message["content"]
        first: dict[str, Any] = {"role": "assistant", "content": None if calls else ""}
        if calls:
            first["tool_calls"] = [{"index": 0, "id": calls[0]["id"], "type": "function",
                                    "function": {"name": calls[0]["function"]["name"], "arguments": ""}}]
        deltas, offset, extras = [first], 0, [{}]
        for piece in _split(said, PIECES):
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} if calls else {"content": piece})
            extra: dict[str, Any] = {}
            if "token_ids" in choice:
                extra["token_ids"] = choice["token_ids"][offset:offset + len(piece)]
            if choice["logprobs"] is not None:
                extra["logprobs"] = {"content": choice["logprobs"]["content"][offset:offset + len(piece)]}
            extras.append(extra)
            offset += len(piece)
        chunks = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None, "logprobs": None, **x}]}
                  for d, x in zip(deltas, extras)]
        if "prompt_token_ids" in reply:
            chunks[0]["prompt_token_ids"] = reply["prompt_token_ids"]
        chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"],
                                            "logprobs": None}]})
        if usage_asked:
            chunks.append({**base, "choices": [], "usage": reply["usage"]})
        return chunks

    def _response(self, n: int, body: dict[str, Any]) -> dict[str, Any]:
        given = body.get("input")
        text = f"answer: {given if isinstance(given, str) else json.dumps(given)}"
        prompt = _tokens(json.dumps(given)) + _tokens(str(body.get("instructions") or ""))
        return {"id": f"resp_{n}", "object": "response", "created_at": 1_700_000_000 + n, "status": "completed",
                "model": f"{body.get('model')}-served", "output": [
                    {"type": "message", "id": f"msg_{n}", "status": "completed", "role": "assistant",
                     "content": [{"type": "output_text", "text": text, "annotations": []}]}],
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "incomplete_details": None,
                "usage": {"input_tokens": prompt, "output_tokens": _tokens(text), "total_tokens": prompt + _tokens(text),
                          "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}

    @staticmethod
    def _response_events(reply: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        created = copy.deepcopy(reply)
        created.update(status="in_progress", output=[], usage=None)
        events: list[tuple[str, dict[str, Any]]] = [("response.created", {"type": "response.created", "response": created})]
        item = reply["output"][0]
        for piece in _split(item["content"][0]["text"], PIECES):
            events.append(("response.output_text.delta", {"type": "response.output_text.delta", "item_id": item["id"],
                                                          "output_index": 0, "content_index": 0, "delta": piece, "logprobs": []}))
        events.append(("response.completed", {"type": "response.completed", "response": reply}))
        return [(name, {**event, "sequence_number": i}) for i, (name, event) in enumerate(events)]
