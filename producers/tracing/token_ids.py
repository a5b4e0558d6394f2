"""Token ids and logprobs of a chat response, as span attributes (``Tracer(token_ids=True)``).

vLLM returns them when asked (``extra_body={"return_token_ids": True}``, ``logprobs=True``; the
wrapper asks with ``Tracer(request_token_ids=True)``): the prompt's ids at the top level
(``prompt_token_ids``), the completion's per choice (``choices[].token_ids``) and the logprobs in
OpenAI's shape (``choices[].logprobs.content[].logprob``). They are read from dicts and from the
openai package's objects alike (vLLM's extra fields are attributes there too). Only the first choice
(index 0) is recorded.

Recorded as JSON arrays: ``rlpulse.prompt_token_ids``, ``rlpulse.response_token_ids`` (ints) and
``rlpulse.response_logprobs`` (floats, as the server sent them), with the counts
``rlpulse.prompt_token_count`` / ``rlpulse.response_token_count``. A list longer than
``MAX_TOKEN_IDS`` or whose JSON would pass a span attribute's 64 KiB is not recorded at all (never a
truncated list a reader could take for the whole): ``rlpulse.token_ids_cut`` says so instead, and
the counts still tell the lengths.
"""

from __future__ import annotations

import json
import math
from typing import Any

from rlpulse.producers.sdk import events as v
import rlpulse.producers.tracing.content as tc

MAX_TOKEN_IDS = 8192  # ids (or logprobs) in one attribute; about 57,000 characters of JSON at most for ids
PROMPT_IDS, RESPONSE_IDS, LOGPROBS = "rlpulse.prompt_token_ids", "rlpulse.response_token_ids", "rlpulse.response_logprobs"
PROMPT_COUNT, RESPONSE_COUNT, CUT = "rlpulse.prompt_token_count", "rlpulse.response_token_count", "rlpulse.token_ids_cut"


def _ints(value: Any) -> list[int] | None:
    if not isinstance(value, (list, tuple)):
        return None
    if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return list(value)
    return None


def _logprobs(choice: Any) -> list[float] | None:
    content = tc.field(tc.field(choice, "logprobs"), "content") if tc.field(choice, "logprobs") is not None else None
    if not isinstance(content, (list, tuple)) or not content:
        return None
    values = [tc.field(entry, "logprob") for entry in content]
    if all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in values):
        return [float(x) for x in values]
    return None  # a -inf or missing logprob: JSON has no such number, and a partial list would mislead


def _first_choice(response: Any) -> Any:
    choices = tc.field(response, "choices")
    if not isinstance(choices, (list, tuple)) or not choices:
        return None
    return next((c for c in choices if tc.field(c, "index") == 0), choices[0])


def _put(attrs: dict[str, Any], key: str, values: list[Any]) -> None:
    text = json.dumps(values, separators=(",", ":"))
    if len(values) > MAX_TOKEN_IDS or len(text) > v.MAX_VALUE:
        attrs[CUT] = True
    else:
        attrs[key] = text


def token_id_attributes(response: Any) -> dict[str, Any]:
    """The token-id and logprob attributes of a chat response (empty when it carries none)."""
    attrs: dict[str, Any] = {}
    if response is None:
        return attrs
    prompt = _ints(tc.field(response, "prompt_token_ids"))
    choice = _first_choice(response)
    completion = _ints(tc.field(choice, "token_ids")) if choice is not None else None
    logprobs = _logprobs(choice) if choice is not None else None
    if prompt is not None:
        attrs[PROMPT_COUNT] = len(prompt)
        _put(attrs, PROMPT_IDS, prompt)
    if completion is not None:
        attrs[RESPONSE_COUNT] = len(completion)
        _put(attrs, RESPONSE_IDS, completion)
    if logprobs is not None:
        _put(attrs, LOGPROBS, logprobs)
    return attrs
