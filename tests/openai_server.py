"""An OpenAI-compatible chat completions server on loopback, for tests of the real ``openai`` client.

``POST /v1/chat/completions`` answers as OpenAI does (``chat.completion`` objects with ``usage``);
what it answers is decided by the request, so a test knows each reply:

* model ``fail-500``: HTTP 500 with an OpenAI error body; model ``bad-400``: HTTP 400;
* a request offering ``tools`` whose last message is not a tool result: one tool call of the first
  tool (``finish_reason`` ``tool_calls``, no content), arguments from ``TOOL_ARGUMENTS``;
* anything else: ``answer: <the last message's content>`` (``finish_reason`` ``stop``);
* a last message containing ``ECHO_KEY``: the reply quotes the request's bearer token (a server
  that echoes the API key, to prove the tracer never records it).

Every request body, its bearer token and every reply body are kept (``requests``, ``tokens``,
``replies``) in order, so a test compares what was sent and received with what was exported.
Usage counts are deterministic: prompt tokens from the messages' lengths, completion tokens
from the reply's.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TOOL_ARGUMENTS = '{"expression": "6*7"}'
ECHO_KEY = "please echo the key"


def _tokens(text: str) -> int:
    return len(text) // 4 + 1


class FakeOpenAI:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.replies: list[tuple[int, dict[str, Any]]] = []  # (HTTP status, body)
        self.tokens: list[str] = []
        self._lock = threading.Lock()
        self._count = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                status, reply = outer._answer(self.path, body, token)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

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

    def _answer(self, path: str, body: dict[str, Any], token: str) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self._count += 1
            n = self._count
            self.requests.append(body)
            self.tokens.append(token)
        model = body.get("model", "")
        if path != "/v1/chat/completions":
            status, reply = 404, {"error": {"message": f"no route {path}", "type": "invalid_request_error"}}
        elif model == "fail-500":
            status, reply = 500, {"error": {"message": "the engine fell over", "type": "server_error", "code": None}}
        elif model == "bad-400":
            status, reply = 400, {"error": {"message": "bad request", "type": "invalid_request_error", "code": None}}
        else:
            status, reply = 200, self._completion(n, body, token)
        with self._lock:
            self.replies.append((status, reply))
        return status, reply

    def _completion(self, n: int, body: dict[str, Any], token: str) -> dict[str, Any]:
        messages = body.get("messages", [])
        last = messages[-1] if messages else {}
        prompt = sum(_tokens(json.dumps(m.get("content"))) for m in messages)
        if body.get("tools") and last.get("role") != "tool":
            name = body["tools"][0]["function"]["name"]
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": TOOL_ARGUMENTS}}]}
            reason, completion = "tool_calls", _tokens(TOOL_ARGUMENTS) + 5
        else:
            text = f"answer: {last.get('content')}"
            if ECHO_KEY in str(last.get("content")):
                text += f" (your key is {token})"
            message, reason, completion = {"role": "assistant", "content": text}, "stop", _tokens(text)
        return {"id": f"chatcmpl-{n}", "object": "chat.completion", "created": 1_700_000_000 + n,
                "model": f"{body.get('model')}-served", "system_fingerprint": "fp_test",
                "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
