"""DashScope's native text-generation API on loopback, for tests of the real ``dashscope`` package.

Point the package at it with ``dashscope.base_http_api_url = fake.base_url``. It answers
``POST /api/v1/services/aigc/text-generation/generation`` as DashScope does (dashscope 2.0.2's
``api_entities.http_request`` reads these shapes): a body ``{"model", "input": {"messages"} or
{"prompt"}, "parameters"}`` in; ``{"output", "usage": {"input_tokens", "output_tokens",
"total_tokens"}, "request_id"}`` out, ``output`` being ``{"choices": [{"message", "finish_reason"}]}``
with ``parameters.result_format == "message"``, else ``{"text", "finish_reason"}``. What it answers
is decided by the request, so a test knows each reply:

* model ``fail-500``: HTTP 500, ``{"code": "InternalError", "message", "request_id"}``; model
  ``bad-400``: HTTP 400, code ``InvalidParameter``; when streaming, the same as one SSE ``error`` event;
* anything else: ``answer: <the last message's content (or the prompt)>``, finish reason ``stop``;
* with the header ``X-DashScope-SSE: enable``: a ``text/event-stream`` of ``CHUNKS`` events
  (``id:``, ``event:result``, ``:HTTP_STATUS/200``, ``data:``), ``CHUNK_DELAY_S`` apart, each with
  the usage so far and finish reason ``"null"`` but the last's ``stop``: only the new text under
  ``parameters.incremental_output``, the text so far otherwise.

Every request (path, headers, body) and every reply (status and body, or the list of event
bodies) are kept in order (``requests``, ``replies``). Usage is deterministic: input tokens from
the messages' lengths, output tokens from the reply's.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PATH = "/api/v1/services/aigc/text-generation/generation"
CHUNKS = 3
CHUNK_DELAY_S = 0.05
ERRORS = {"fail-500": (500, "InternalError", "the engine fell over"),
          "bad-400": (400, "InvalidParameter", "bad request")}


def tokens(text: str) -> int:
    return len(text) // 4 + 1


class FakeDashScope:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []  # {"path", "headers", "body"}
        self.replies: list[tuple[int, Any]] = []  # (HTTP status, body or list of SSE event bodies)
        self._lock = threading.Lock()
        self._count = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                n = outer._record(self.path, dict(self.headers), body)
                streamed = self.headers.get("X-DashScope-SSE") == "enable"
                status, reply = outer._answer(n, self.path, body, streamed)
                if streamed:
                    self._events(status, reply if isinstance(reply, list) else [reply])
                else:
                    self._json(status, reply)

            def _json(self, status: int, reply: Any) -> None:
                with outer._lock:
                    outer.replies.append((status, reply))
                data = json.dumps(reply, ensure_ascii=False).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _events(self, status: int, events: list[dict[str, Any]]) -> None:
                with outer._lock:
                    outer.replies.append((status, events))
                self.send_response(status)  # HTTP/1.0: the body ends when the connection closes
                self.send_header("Content-Type", "text/event-stream;charset=UTF-8")
                self.end_headers()
                for i, event in enumerate(events, 1):
                    kind = "result" if status == 200 else "error"
                    data = json.dumps(event, ensure_ascii=False)
                    self.wfile.write(f"id:{i}\nevent:{kind}\n:HTTP_STATUS/{status}\ndata:{data}\n\n".encode())
                    self.wfile.flush()
                    if i < len(events):
                        time.sleep(CHUNK_DELAY_S)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-dashscope", daemon=True)

    @property
    def base_url(self) -> str:
        """What ``dashscope.base_http_api_url`` is set to."""
        return f"http://127.0.0.1:{self.server.server_address[1]}/api/v1"

    def __enter__(self) -> FakeDashScope:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _record(self, path: str, headers: dict[str, str], body: dict[str, Any]) -> int:
        with self._lock:
            self._count += 1
            self.requests.append({"path": path, "headers": headers, "body": body})
            return self._count

    def _answer(self, n: int, path: str, body: dict[str, Any], streamed: bool) -> tuple[int, Any]:
        request_id = f"req-{n}"
        model = body.get("model", "")
        if path != PATH:
            return 404, {"code": "NotFound", "message": f"no route {path}", "request_id": request_id}
        if model in ERRORS:
            status, code, message = ERRORS[model]
            return status, {"code": code, "message": message, "request_id": request_id}
        inputs, parameters = body.get("input", {}), body.get("parameters", {})
        messages = inputs.get("messages") or [{"role": "user", "content": inputs.get("prompt")}]
        text = f"answer: {messages[-1].get('content')}"
        usage_in = sum(tokens(json.dumps(m.get("content"), ensure_ascii=False)) for m in messages)
        as_message = parameters.get("result_format") == "message"
        if not streamed:  # the SDK asks for a stream with the header alone, not in the body
            return 200, self._reply(request_id, text, "stop", usage_in, tokens(text), as_message)
        size = -(-len(text) // CHUNKS)
        pieces = [text[i * size:(i + 1) * size] for i in range(CHUNKS)]
        events, so_far = [], ""
        for i, piece in enumerate(pieces):
            so_far += piece
            last = i == CHUNKS - 1
            shown = piece if parameters.get("incremental_output") else so_far
            events.append(self._reply(request_id, shown, "stop" if last else "null", usage_in, tokens(so_far), as_message))
        return 200, events

    @staticmethod
    def _reply(request_id: str, text: str, reason: str, usage_in: int, usage_out: int, as_message: bool) -> dict[str, Any]:
        output: dict[str, Any] = ({"choices": [{"finish_reason": reason, "message": {"role": "assistant", "content": text}}]}
                                  if as_message else {"finish_reason": reason, "text": text})
        return {"output": output, "usage": {"input_tokens": usage_in, "output_tokens": usage_out,
                                            "total_tokens": usage_in + usage_out}, "request_id": request_id}
