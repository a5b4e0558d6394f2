"""GenAI attributes as rlpulse's tracer writes them, read from whichever convention an OTLP span follows.

rlpulse's tracer (``rlpulse.producers.tracing.content``) writes OpenTelemetry's GenAI keys, with message
content as JSON arrays of OpenAI chat messages; ``rlpulse export`` and the UI read those. An OTLP span
may follow GenAI (current or older names), OpenInference (``llm.*``, ``input.value``) or OpenLLMetry
(``llm.usage.*``, ``gen_ai.prompt.N.*``): :func:`canonical` gives the tracer's keys from any of them
(``TARGETS``: the first source present fills each key), leaving the span's own attributes as they are.

Messages, the first found: ``gen_ai.input.messages`` / ``gen_ai.output.messages`` (JSON or an array
value; GenAI's ``parts`` become ``content``, ``tool_call`` parts ``tool_calls``, a
``tool_call_response`` a tool message), OpenInference's ``llm.input_messages.N.message.*`` /
``llm.output_messages.N.message.*`` (``contents.M.message_content.text`` and
``tool_calls.M.tool_call.*`` too), OpenLLMetry's ``gen_ai.prompt.N.*`` / ``gen_ai.completion.N.*``,
and last ``input.value`` / ``output.value`` (an OpenAI request's ``messages``, a response's
``choices``, else the text as one user / assistant message). GenAI's ``gen_ai.system_instructions``
becomes a leading system message. ``gen_ai.response.id``, where no key gives it, is the ``id`` of an
LLM span's ``output.value`` (OpenInference records the response id nowhere else).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rlpulse.producers.otlp.identity import OtlpRejected, first, integer

# rlpulse's key <- the attributes that give it, the first present wins (the key itself first).
TARGETS: dict[str, tuple[str, ...]] = {
    "gen_ai.request.model": ("llm.request.model_name", "llm.request.model", "llm.model_name"),
    "gen_ai.response.model": ("llm.response.model_name", "llm.response.model"),
    "gen_ai.usage.input_tokens": ("gen_ai.usage.prompt_tokens", "llm.usage.prompt_tokens", "llm.token_count.prompt"),
    "gen_ai.usage.output_tokens": ("gen_ai.usage.completion_tokens", "llm.usage.completion_tokens",
                                   "llm.token_count.completion"),
    "gen_ai.request.max_tokens": ("llm.request.max_tokens",),
    "gen_ai.response.id": (),
    "gen_ai.tool.name": ("tool.name",),
    "gen_ai.tool.call.id": ("tool_call.id", "tool.id"),
}
TOKEN_KEYS = ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens", "gen_ai.request.max_tokens")
CONTENT_KEYS = ("gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.tool.definitions",
                "gen_ai.tool.call.arguments", "gen_ai.tool.call.result")


def count(value: Any) -> int | None:
    try:
        return integer(value, "a token count")
    except OtlpRejected:
        return None  # not a count: the original attribute is still kept as it came


def canonical(attrs: Mapping[str, Any], llm: bool, tool: bool) -> dict[str, Any]:
    """The keys rlpulse's tracer writes, from whichever convention ``attrs`` follow."""
    out: dict[str, Any] = {}
    for key, sources in TARGETS.items():
        value = first((key, *sources), attrs)
        if value is not None:
            out[key] = count(value) if key in TOKEN_KEYS else value
    params = json_value(attrs.get("llm.invocation_parameters"))  # OpenInference: the request's parameters
    if isinstance(params, dict) and out.get("gen_ai.request.max_tokens") is None:
        out["gen_ai.request.max_tokens"] = count(params.get("max_completion_tokens") or params.get("max_tokens"))
    out = {k: x for k, x in out.items() if x is not None}
    if llm:
        out.setdefault("gen_ai.operation.name", attrs.get("gen_ai.operation.name") or "chat")
        inputs = _messages(attrs, "gen_ai.input.messages", ("llm.input_messages", "gen_ai.prompt"), "input.value", "user")
        outputs = _messages(attrs, "gen_ai.output.messages", ("llm.output_messages", "gen_ai.completion"), "output.value",
                            "assistant")
        system = attrs.get("gen_ai.system_instructions")
        if inputs is not None and system is not None:
            inputs = [{"role": "system", "content": _text_of(json_value(system) or system)}, *inputs]
        out.update({k: m for k, m in (("gen_ai.input.messages", inputs), ("gen_ai.output.messages", outputs)) if m})
        answer = json_value(attrs.get("output.value"))  # OpenInference's response body, folded away: keep its id
        if "gen_ai.response.id" not in out and isinstance(answer, dict) and isinstance(answer.get("id"), str):
            out["gen_ai.response.id"] = answer["id"]
        reasons = _reasons(attrs)
        if reasons:
            out["gen_ai.response.finish_reasons"] = ",".join(reasons)[:256]
        tools = indexed(attrs, "llm.tools")
        if tools and "gen_ai.tool.definitions" not in attrs:
            out["gen_ai.tool.definitions"] = [json_value(t.get("tool.json_schema")) or t for t in tools]
    if tool:
        for key, sources in (("gen_ai.tool.call.arguments", ("input.value", "traceloop.entity.input")),
                             ("gen_ai.tool.call.result", ("output.value", "traceloop.entity.output"))):
            value = first((key, *sources), attrs)
            if value is not None:
                out[key] = _parsed(value)
    return out


def json_value(value: Any) -> Any:
    if isinstance(value, str) and value[:1] in ("{", "["):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, (list, dict)) else None


def _parsed(value: Any) -> Any:
    """A tool's arguments or result: JSON text as what it holds (as the tracer records them), other text as it is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _flat(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, x in value.items():
            _flat(x, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, list):
        for i, x in enumerate(value):
            _flat(x, f"{prefix}.{i}" if prefix else str(i), out)
    else:
        out[prefix] = value


def indexed(attrs: Mapping[str, Any], prefix: str) -> list[dict[str, Any]]:
    """``prefix.N.rest`` keys (or ``prefix`` given as a list) as one flat dict per N, in N's order."""
    items: dict[int, dict[str, Any]] = {}
    flat: dict[str, Any] = {}
    if isinstance(attrs.get(prefix), list):
        _flat(attrs[prefix], prefix, flat)
    for key, value in (*attrs.items(), *flat.items()):
        if key.startswith(prefix + "."):
            index, _, rest = key[len(prefix) + 1:].partition(".")
            if index.isdigit() and rest:
                items.setdefault(int(index), {})[rest] = value
    return [items[i] for i in sorted(items)]


def _text_of(content: Any) -> Any:
    """A content given as parts (GenAI ``parts``, OpenInference ``contents``) as its text."""
    if isinstance(content, list):
        texts = [str(p.get("content") or p.get("text") or "") for p in content if isinstance(p, dict)
                 and p.get("type", "text") == "text"]
        return "".join(texts) if texts else None
    return content


def _message(m: dict[str, Any]) -> dict[str, Any]:
    """A GenAI JSON message (with ``parts``) in OpenAI's chat shape; one already so, as it is."""
    parts = m.get("parts")
    if not isinstance(parts, list) or "content" in m:
        return m
    out: dict[str, Any] = {"role": m.get("role"), "content": _text_of(parts)}
    calls = [{"id": p.get("id"), "type": "function", "function": {"name": p.get("name"), "arguments":
             p["arguments"] if isinstance(p.get("arguments"), str) else json.dumps(p.get("arguments"))}}
             for p in parts if isinstance(p, dict) and p.get("type") == "tool_call"]
    if calls:
        out["tool_calls"] = calls
    answers = [p for p in parts if isinstance(p, dict) and p.get("type") == "tool_call_response"]
    if answers:
        out.update(role="tool", tool_call_id=answers[0].get("id"), content=_plain_text(answers[0].get("response")))
    return out


def _plain_text(value: Any) -> Any:
    return value if isinstance(value, str) or value is None else json.dumps(value, ensure_ascii=False)


def _flat_message(f: dict[str, Any]) -> dict[str, Any]:
    """An OpenInference (``message.role``...) or OpenLLMetry (``role``...) flattened message as a chat message."""
    g = {k.removeprefix("message."): x for k, x in f.items()}
    content = g.get("content")
    if content is None:
        content = _text_of([{"type": x.get("message_content.type", "text"), "text": x.get("message_content.text")}
                            for x in indexed(g, "contents")])
    out: dict[str, Any] = {"role": g.get("role"), "content": content}
    for key in ("name", "tool_call_id"):
        if g.get(key) is not None:
            out[key] = g[key]
    calls = [{"id": c.get("tool_call.id", c.get("id")), "type": "function",
              "function": {"name": c.get("tool_call.function.name", c.get("name")),
                           "arguments": c.get("tool_call.function.arguments", c.get("arguments"))}}
             for c in indexed(g, "tool_calls")]
    if calls:
        out["tool_calls"] = calls
    return out


def _messages(attrs: Mapping[str, Any], key: str, prefixes: tuple[str, ...], raw: str, role: str) -> list[Any] | None:
    given = json_value(attrs.get(key))
    if isinstance(given, list):
        return [_message(m) if isinstance(m, dict) else m for m in given]
    for prefix in prefixes:
        found = indexed(attrs, prefix)
        if found:
            return [_flat_message(f) for f in found]
    value = attrs.get(raw)
    if value is None:
        return None
    parsed = json_value(value)
    if isinstance(parsed, dict) and isinstance(parsed.get("messages"), list):  # an OpenAI request
        return parsed["messages"]
    if isinstance(parsed, dict) and isinstance(parsed.get("choices"), list):  # an OpenAI response
        return [c.get("message") for c in parsed["choices"] if isinstance(c, dict) and c.get("message") is not None]
    return [{"role": role, "content": _plain_text(value)}]


def _reasons(attrs: Mapping[str, Any]) -> list[str]:
    given = first(("gen_ai.response.finish_reasons", "llm.finish_reason"), attrs)
    if isinstance(given, list):
        return [str(r) for r in given]
    if given is not None:
        return [str(given)]
    found = [c.get("finish_reason") for c in indexed(attrs, "gen_ai.completion")]
    found += [m.get("finish_reason") for m in json_value(attrs.get("gen_ai.output.messages")) or [] if isinstance(m, dict)]
    return [str(r) for r in found if r is not None]
