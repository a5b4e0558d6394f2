"""What a traced LLM or tool span records: OpenTelemetry GenAI attributes, and content under a cap.

Attribute names follow OpenTelemetry's GenAI semantic conventions (``gen_ai.request.model``,
``gen_ai.usage.input_tokens``, ``gen_ai.response.finish_reasons``, ``gen_ai.tool.name``, ...).
Message content (``gen_ai.input.messages``, ``gen_ai.output.messages``, ``gen_ai.tool.definitions``,
``gen_ai.tool.call.arguments`` and ``.result``) is JSON in OpenAI's chat message shape, recorded
only when the tracer's content switch is on, each attribute at most ``limit`` characters. A Responses
API request and response (``responses_request``, ``responses_as_chat``) are read as their chat
equivalents: instructions and input as messages, output text and function calls as the assistant's
message, ``input_tokens`` / ``output_tokens`` as usage, the status as the finish reason.

The cap keeps the JSON valid whenever it can: the longest strings are cut first, each ending in a
marker that says how many characters it lost, and the span counts every character cut in
``rlpulse.content.cut_chars``. Only a structure too large even with every string emptied (thousands
of messages) is cut as text, then no longer JSON (readers fall back to the raw text). Registered
secrets (the API key of a client given to ``trace_client``) are replaced by ``***`` in every string
before anything is measured, so no cut can leave part of one behind.
"""

from __future__ import annotations

import json
import math
import threading
from typing import Any
from collections.abc import Iterable, Mapping

CUT_CHARS = "rlpulse.content.cut_chars"  # characters of content cut on this span by the cap
MARKER = "…[rlpulse: {} characters cut]"
REDACTED = "***"
MIN_SECRET = 8  # shorter strings are not secrets worth a scan (and would redact common words)

_secrets: set[str] = set()
_secrets_lock = threading.Lock()


def register_secret(secret: Any) -> None:
    """Never record ``secret`` (an API key) in content: it is replaced by ``***`` wherever it appears."""
    if isinstance(secret, str) and len(secret) >= MIN_SECRET:
        with _secrets_lock:
            _secrets.add(secret)


def redact(text: str) -> str:
    for secret in tuple(_secrets):
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def plain(value: Any) -> Any:
    """``value`` as JSON-able data: pydantic models (openai's types) as the fields they were given, tuples as
    lists, anything else unknown as its ``str``; secrets redacted in every string."""
    if isinstance(value, str):
        return redact(value)
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {redact(str(k)): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    dump = getattr(value, "model_dump", None)
    if callable(dump):  # pydantic v2 (openai's types): only the fields the value was built with
        try:
            return plain(dump(exclude_unset=True))
        except TypeError:
            return plain(dump())
    return redact(str(value))


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _strings(value: Any, out: list[int]) -> None:
    """The lengths of every string leaf of ``value`` (keys are kept whole: they are structure)."""
    if isinstance(value, str):
        out.append(len(value))
    elif isinstance(value, dict):
        for v in value.values():
            _strings(v, out)
    elif isinstance(value, list):
        for v in value:
            _strings(v, out)


def cut_strings(value: Any, keep: int, counter: list[int]) -> Any:
    """``value`` with each string longer than ``keep`` cut to ``keep`` characters plus the marker."""
    if isinstance(value, str):
        if len(value) <= keep:
            return value
        counter[0] += len(value) - keep
        return value[:keep] + MARKER.format(len(value) - keep)
    if isinstance(value, dict):
        return {k: cut_strings(v, keep, counter) for k, v in value.items()}
    if isinstance(value, list):
        return [cut_strings(v, keep, counter) for v in value]
    return value


def capped_json(value: Any, limit: int) -> tuple[str, int]:
    """``value`` (already ``plain``) as JSON of at most ``limit`` characters, and how many characters were cut."""
    text = _dumps(value)
    if len(text) <= limit:
        return text, 0
    lengths: list[int] = []
    _strings(value, lengths)
    lo, hi = 0, max(lengths, default=0)  # the largest per-string length `keep` that fits
    best: tuple[str, int] | None = None
    while lo <= hi:
        keep = (lo + hi) // 2
        counter = [0]
        candidate = _dumps(cut_strings(value, keep, counter))
        if len(candidate) <= limit:
            best, lo = (candidate, counter[0]), keep + 1
        else:
            hi = keep - 1
    if best is not None:
        return best
    # Too much structure for any string cut to help: cut the text itself (no longer valid JSON).
    marker = MARKER.format(len(text))
    kept = max(limit - len(marker) - 12, 0)
    return text[:kept] + MARKER.format(len(text) - kept), len(text) - kept


class Content:
    """The content attributes of one span, capped; ``cut`` sums the characters cut."""

    def __init__(self, limit: int):
        self.limit = limit
        self.cut = 0

    def put(self, attributes: dict[str, Any], key: str, value: Any) -> None:
        text, cut = capped_json(plain(value), self.limit)
        attributes[key] = text
        if cut:
            self.cut += cut
            attributes[CUT_CHARS] = self.cut


# -- reading OpenAI-shaped requests and responses (dicts or the openai package's objects) ----------

def field(obj: Any, name: str) -> Any:
    """``obj.name`` or ``obj[name]``; None when it has neither."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _number(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


REQUEST_PARAMS = {  # request keyword -> attribute; never headers, extra_* or anything that may carry a credential
    "model": "gen_ai.request.model", "max_tokens": "gen_ai.request.max_tokens",
    "max_completion_tokens": "gen_ai.request.max_tokens", "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p", "seed": "gen_ai.request.seed", "n": "gen_ai.request.choice.count",
    "frequency_penalty": "gen_ai.request.frequency_penalty", "presence_penalty": "gen_ai.request.presence_penalty",
}


def request_attributes(kwargs: Mapping[str, Any], content: Content | None) -> dict[str, Any]:
    """GenAI attributes of a chat request given as ``create``'s keyword arguments."""
    attrs: dict[str, Any] = {"gen_ai.operation.name": "chat"}
    for name, key in REQUEST_PARAMS.items():
        value = kwargs.get(name)
        if isinstance(value, str):
            attrs[key] = redact(value)[:256]
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            attrs[key] = value
    if content is not None:  # lists only: an iterator is the caller's to spend (trace_client turns one into a list)
        if isinstance(kwargs.get("messages"), (list, tuple)):
            content.put(attrs, "gen_ai.input.messages", list(kwargs["messages"]))
        if isinstance(kwargs.get("tools"), (list, tuple)):
            content.put(attrs, "gen_ai.tool.definitions", list(kwargs["tools"]))
    return attrs


def response_attributes(response: Any, content: Content | None) -> tuple[dict[str, Any], int | None, str | None]:
    """GenAI attributes of a chat response (an openai ``ChatCompletion``, its dict, a message or a
    string), its output tokens and its (first choice's) finish reason."""
    if isinstance(response, str):
        response = {"choices": [{"message": {"role": "assistant", "content": response}}]}
    elif field(response, "object") == "response":  # the Responses API's, as a chat completion
        response = responses_as_chat(response)
    elif field(response, "choices") is None and field(response, "role") is not None:  # a message alone
        response = {"choices": [{"message": response}]}
    attrs: dict[str, Any] = {}
    for name, key in (("model", "gen_ai.response.model"), ("id", "gen_ai.response.id")):
        value = field(response, name)
        if isinstance(value, str):
            attrs[key] = redact(value)[:256]
    usage = field(response, "usage")
    tokens_in = _number(field(usage, "prompt_tokens")) if usage is not None else None
    tokens_out = _number(field(usage, "completion_tokens")) if usage is not None else None
    if usage is not None and tokens_in is None:  # the Responses API's and OpenTelemetry's own names
        tokens_in, tokens_out = _number(field(usage, "input_tokens")), _number(field(usage, "output_tokens"))
    if tokens_in is not None:
        attrs["gen_ai.usage.input_tokens"] = tokens_in
    if tokens_out is not None:
        attrs["gen_ai.usage.output_tokens"] = tokens_out
    choices = list(field(response, "choices") or [])
    reasons = [str(r) for r in (field(c, "finish_reason") for c in choices) if r is not None]
    if reasons:
        attrs["gen_ai.response.finish_reasons"] = ",".join(reasons)[:256]
    messages = [field(c, "message") for c in choices]
    calls = [call for m in messages if m is not None for call in (field(m, "tool_calls") or [])]
    if calls:  # which tools the model asked for; their arguments are content
        attrs["rlpulse.tool_calls"] = len(calls)
        attrs["rlpulse.tool_call_names"] = ",".join(str(field(field(c, "function"), "name") or "") for c in calls)[:1024]
    if content is not None and messages:
        content.put(attrs, "gen_ai.output.messages", [m for m in messages if m is not None])
    return attrs, tokens_out, reasons[0] if reasons else None


# -- the Responses API (``client.responses.create``), read as a chat request and response ---------

RESPONSES_PARAMS = {"model": "model", "max_output_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p"}
_INCOMPLETE = {"max_output_tokens": "length", "content_filter": "content_filter"}


def responses_request(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses API request (``instructions``, ``input``, ``max_output_tokens``) as chat keywords, so
    ``request_attributes`` reads it: the instructions as a system message, a string input as a user one."""
    request = {chat: kwargs[name] for name, chat in RESPONSES_PARAMS.items() if name in kwargs}
    messages: list[Any] = []
    if isinstance(kwargs.get("instructions"), str):
        messages.append({"role": "system", "content": kwargs["instructions"]})
    given = kwargs.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, (list, tuple)):
        messages.extend(given)
    if messages:
        request["messages"] = messages
    if isinstance(kwargs.get("tools"), (list, tuple)):
        request["tools"] = kwargs["tools"]
    return request


def responses_as_chat(response: Any) -> dict[str, Any]:
    """A Responses API response as a chat completion: the output text as the assistant's content, its
    function calls as tool calls, and a finish reason from the status (``completed``: ``stop``, or
    ``tool_calls`` when it asked for a tool; ``incomplete`` for ``max_output_tokens``: ``length``)."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in field(response, "output") or []:
        kind = field(item, "type")
        if kind == "message":
            texts.extend(str(field(p, "text")) for p in field(item, "content") or []
                         if field(p, "type") == "output_text" and field(p, "text") is not None)
        elif kind == "function_call":
            calls.append({"id": field(item, "call_id"), "type": "function",
                          "function": {"name": field(item, "name"), "arguments": field(item, "arguments")}})
    status = field(response, "status")
    if status == "completed":
        reason: Any = "tool_calls" if calls else "stop"
    elif status == "incomplete":
        detail = field(field(response, "incomplete_details"), "reason")
        reason = _INCOMPLETE.get(str(detail), detail or status)
    else:
        reason = status
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    return {"id": field(response, "id"), "model": field(response, "model"), "usage": field(response, "usage"),
            "choices": [{"index": 0, "message": message, "finish_reason": reason}]}


def tool_content(content: Content, attrs: dict[str, Any], arguments: Mapping[str, Any], result: Any,
                 failed: bool) -> None:
    content.put(attrs, "gen_ai.tool.call.arguments", dict(arguments))
    if not failed:
        content.put(attrs, "gen_ai.tool.call.result", result)


def call_arguments(names: Iterable[str], values: Mapping[str, Any]) -> dict[str, Any]:
    """A call's bound arguments less ``self`` and ``cls`` (the processor or agent object, not input)."""
    return {name: values[name] for name in names if name in values and name not in ("self", "cls")}
