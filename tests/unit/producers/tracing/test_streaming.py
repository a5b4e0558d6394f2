"""Traced calls beyond a plain ``create``: streams (sync and async, with and without usage, tool-call
deltas, cut mid-way, closed early, collected), HTTP errors and timeouts, raw responses, the Responses
API, vLLM's token ids and their caps, and the trace headers a request carries. The real ``openai``
client against ``tests.openai_server.FakeOpenAI``, through the SDK into an ``InMemoryTransport``;
every value is compared with what the server sent."""

from __future__ import annotations

import asyncio
import gc
import json
from typing import Any
from collections.abc import Callable

import pytest

from rlpulse.producers import InMemoryTransport, TrainingTelemetry
from rlpulse.producers.tracing import Tracer, bind_rollout, trace_client
from rlpulse.producers.tracing import spans as tracing_spans
from rlpulse.producers.tracing import streams, token_ids
from tests.openai_server import BREAK_AFTER, TOOL_ARGUMENTS, FakeOpenAI
from tests.traced_agent import API_KEY, TOOLS

pytestmark = pytest.mark.full  # 17 s of real HTTP streams: make test-all (make test stays within its 6 minutes)

openai = pytest.importorskip("openai")
USER = [{"role": "user", "content": "what is 6*7?"}]


def llm_spans(fn: Callable[[], Any], content: bool = True, **options: Any) -> list[dict[str, Any]]:
    """Runs ``fn()`` under a Tracer; the LLM spans it published, in start order."""
    transport = InMemoryTransport()
    with TrainingTelemetry(project="p", run_id="run", transport=transport) as tel, Tracer(tel, content=content, **options):
        with bind_rollout(rollout_id="r", step=1):
            fn()
    return sorted((r for r in transport.records("spans") if r["kind"] == "LLM"), key=lambda r: r["start_time_ns"])


def client(fake: FakeOpenAI, aio: bool = False, **kwargs: Any) -> Any:
    kind = openai.AsyncOpenAI if aio else openai.OpenAI
    return trace_client(kind(base_url=fake.base_url, api_key=API_KEY, max_retries=0, **kwargs))


def assert_reply(span: dict[str, Any], reply: dict[str, Any]) -> None:
    """The span's usage, finish reason, ids and output content are exactly the server's reply."""
    a = span["attributes"]
    assert (span["status"], a["gen_ai.response.id"], a["gen_ai.response.model"]) == ("OK", reply["id"], reply["model"])
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
        reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"])
    assert a["gen_ai.response.finish_reasons"] == reply["choices"][0]["finish_reason"]
    assert json.loads(a["gen_ai.output.messages"]) == [reply["choices"][0]["message"]]


def stream_time_ns(fake: FakeOpenAI, index: int) -> int:
    return int((len(fake.chunks[index] or []) - 1) * fake.chunk_delay_s * 1e9)


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_a_stream_without_stream_options_gets_usage_and_the_caller_sees_its_own_stream(aio: bool) -> None:
    got: list[Any] = []

    async def consume_async(c: Any) -> None:
        async with await c.chat.completions.create(model="m", messages=USER, stream=True) as stream:
            got.extend([chunk async for chunk in stream])

    def run() -> None:
        c = client(fake, aio)
        if aio:
            asyncio.run(consume_async(c))
        else:
            with c.chat.completions.create(model="m", messages=USER, stream=True) as stream:
                got.extend(stream)

    with FakeOpenAI() as fake:
        [span] = llm_spans(run)
    assert fake.requests[0]["stream_options"] == {"include_usage": True}  # asked for by the wrapper...
    sent = fake.chunks[0] or []
    assert sent[-1]["choices"] == [] and [c.model_dump(exclude_unset=True) for c in got] == sent[:-1]  # ...and swallowed
    assert_reply(span, fake.replies[0][1])
    assert span["attributes"]["gen_ai.request.stream"] is True and "rlpulse.usage_missing" not in span["attributes"]
    assert span["end_time_ns"] - span["start_time_ns"] >= stream_time_ns(fake, 0)


def test_a_callers_own_stream_options_are_respected_and_every_chunk_passes() -> None:
    seen: dict[str, list[Any]] = {}

    def run() -> None:
        c = client(fake)
        for name, options in (("usage", {"include_usage": True}), ("none", {"include_usage": False})):
            seen[name] = list(c.chat.completions.create(model="m", messages=USER, stream=True, stream_options=options))

    with FakeOpenAI() as fake:
        with_usage, without = llm_spans(run)
    assert [r["stream_options"] for r in fake.requests] == [{"include_usage": True}, {"include_usage": False}]
    assert [len(seen["usage"]), len(seen["none"])] == [len(fake.chunks[0] or []), len(fake.chunks[1] or [])]
    assert seen["usage"][-1].usage.prompt_tokens == fake.replies[0][1]["usage"]["prompt_tokens"]
    assert_reply(with_usage, fake.replies[0][1])
    a = without["attributes"]
    assert a["rlpulse.usage_missing"] is True and "gen_ai.usage.input_tokens" not in a
    assert json.loads(a["gen_ai.output.messages"]) == [fake.replies[1][1]["choices"][0]["message"]]


def test_stream_usage_off_asks_for_nothing() -> None:
    with FakeOpenAI() as fake:
        [span] = llm_spans(lambda: list(client(fake).chat.completions.create(model="m", messages=USER, stream=True)),
                           stream_usage=False)
    assert "stream_options" not in fake.requests[0] and span["attributes"]["rlpulse.usage_missing"] is True


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_tool_call_deltas_are_assembled_by_index(aio: bool) -> None:
    async def consume_async() -> list[Any]:
        stream = await client(fake, True).chat.completions.create(model="m", messages=USER, tools=TOOLS, stream=True)
        return [chunk async for chunk in stream]

    def run() -> None:
        if aio:
            asyncio.run(consume_async())
        else:
            list(client(fake).chat.completions.create(model="m", messages=USER, tools=TOOLS, stream=True))

    with FakeOpenAI() as fake:
        [span] = llm_spans(run)
    reply = fake.replies[0][1]
    argument_chunks = [c for c in fake.chunks[0] or [] if c["choices"] and "tool_calls" in c["choices"][0]["delta"]]
    assert len(argument_chunks) > 2  # the arguments really came in pieces
    assert_reply(span, reply)
    assert json.loads(span["attributes"]["gen_ai.output.messages"])[0]["tool_calls"][0]["function"] == {
        "name": "calculator", "arguments": TOOL_ARGUMENTS}
    assert (span["attributes"]["rlpulse.tool_calls"], span["attributes"]["rlpulse.tool_call_names"]) == (1, "calculator")


@pytest.mark.parametrize("model, error, status", [("fail-429", "RateLimitError", 429), ("fail-500", "InternalServerError", 500),
                                                  ("slow", "APITimeoutError", None)])
@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_http_errors_and_timeouts_are_one_error_span_and_reach_the_caller(model: str, error: str, status: int | None,
                                                                          aio: bool) -> None:
    raised: list[BaseException] = []

    def run() -> None:
        c = client(fake, aio, timeout=0.3)
        for streamed in (False, True):
            try:
                call = c.chat.completions.create(model=model, messages=USER, stream=streamed)
                if aio:
                    asyncio.run(call)
            except openai.APIError as exc:
                raised.append(exc)

    with FakeOpenAI() as fake:
        spans = llm_spans(run)
    assert [type(e).__name__ for e in raised] == [error, error]
    assert len(spans) == len(fake.requests) == 2
    for span in spans:
        a = span["attributes"]
        assert (span["status"], span["status_message"], a["error.type"]) == ("ERROR", error, f"openai.{error}")
        assert a.get("http.response.status_code") == status


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_a_stream_cut_mid_way_is_an_error_span_and_the_error_reaches_the_caller(aio: bool) -> None:
    got: list[Any] = []

    async def consume_async() -> None:
        async for chunk in await client(fake, True).chat.completions.create(model="break-stream", messages=USER, stream=True):
            got.append(chunk)

    def run() -> None:
        with pytest.raises(openai.APIConnectionError):
            if aio:
                asyncio.run(consume_async())
            else:
                got.extend(client(fake).chat.completions.create(model="break-stream", messages=USER, stream=True))

    with FakeOpenAI() as fake:
        [span] = llm_spans(run)
    assert len(got) == BREAK_AFTER == len(fake.chunks[0] or [])
    assert (span["status"], span["attributes"]["error.type"]) == ("ERROR", "openai.APIConnectionError")
    assert "gen_ai.usage.input_tokens" not in span["attributes"]


def test_a_stream_closed_early_or_collected_ends_its_span_once() -> None:
    def run() -> None:
        c = client(fake)
        stream = c.chat.completions.create(model="m", messages=USER, stream=True)
        next(stream)
        stream.close()
        stream.close()  # again: still one span
        with c.chat.completions.create(model="m", messages=USER, stream=True) as stream:
            next(stream)
        abandoned = c.chat.completions.create(model="m", messages=USER, stream=True)
        next(abandoned)
        del abandoned
        gc.collect()
        done = c.chat.completions.create(model="m", messages=USER, stream=True)
        list(done)
        done.close()  # after the end: nothing more

    with FakeOpenAI() as fake:
        spans = llm_spans(run)
    assert len(spans) == len(fake.requests) == 4
    for span in spans[:3]:
        a = span["attributes"]
        assert (span["status"], a["rlpulse.stream.closed_early"], a["rlpulse.usage_missing"]) == ("OK", True, True)
        assert a["gen_ai.response.id"] == fake.replies[spans.index(span)][1]["id"]
    assert_reply(spans[3], fake.replies[3][1])


def test_the_proxy_keeps_the_streams_api() -> None:
    def run() -> None:
        stream = client(fake).chat.completions.create(model="m", messages=USER, stream=True)
        assert stream.response.status_code == 200 and stream.response.headers["content-type"] == "text/event-stream"
        assert iter(stream) is stream and isinstance(stream, streams.TracedStream)
        stream.close()

    with FakeOpenAI() as fake:
        assert len(llm_spans(run)) == 1


def test_raw_responses_are_traced_and_parse_gives_the_callers_object() -> None:
    def run() -> None:
        c = openai.OpenAI(base_url=fake.base_url, api_key=API_KEY, max_retries=0)
        early = c.chat.completions.with_raw_response  # cached before trace_client: rebuilt in place
        trace_client(c)
        raw = early.create(model="m", messages=USER)
        assert raw.parse() is raw.parse() and raw.parse().id == fake.replies[0][1]["id"]
        raw = c.with_raw_response.chat.completions.create(model="m", messages=USER, stream=True)
        stream = raw.parse()
        assert isinstance(stream, streams.TracedStream) and len(list(stream)) == len(fake.chunks[1] or []) - 1
        with c.chat.completions.with_streaming_response.create(model="m", messages=USER) as response:
            assert json.loads(response.read())["id"] == fake.replies[2][1]["id"]

    with FakeOpenAI() as fake:
        plain, streamed, unread = llm_spans(run)
    assert_reply(plain, fake.replies[0][1])
    assert_reply(streamed, fake.replies[1][1])
    assert unread["status"] == "OK" and "gen_ai.response.id" not in unread["attributes"]  # the body is the caller's


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_the_responses_api_streamed_and_not(aio: bool) -> None:
    async def calls_async() -> None:
        c = client(fake, True)
        await c.responses.create(model="m", input="hello", instructions="be brief")
        async for _ in await c.responses.create(model="m", input="hello", stream=True):
            pass

    def run() -> None:
        if aio:
            asyncio.run(calls_async())
            return
        c = client(fake)
        assert c.responses.create(model="m", input="hello", instructions="be brief").output_text == "answer: hello"
        assert [e.type for e in c.responses.create(model="m", input="hello", stream=True)][-1] == "response.completed"

    with FakeOpenAI() as fake:
        spans = llm_spans(run)
    assert len(spans) == len(fake.requests) == 2
    for span, (_, reply) in zip(spans, fake.replies):
        a = span["attributes"]
        assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
            reply["usage"]["input_tokens"], reply["usage"]["output_tokens"])
        assert (a["gen_ai.response.id"], a["gen_ai.response.finish_reasons"]) == (reply["id"], "stop")
        assert json.loads(a["gen_ai.output.messages"]) == [{"role": "assistant", "content": "answer: hello"}]
    assert json.loads(spans[0]["attributes"]["gen_ai.input.messages"]) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def expected_ids(fake: FakeOpenAI, index: int) -> tuple[list[int], list[int], list[float]]:
    reply = fake.replies[index][1]
    choice = reply["choices"][0]
    return reply["prompt_token_ids"], choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_token_ids_and_logprobs_when_asked_for(streamed: bool) -> None:
    def run() -> None:
        reply = client(fake).chat.completions.create(model="m", messages=USER, stream=streamed, extra_body={"mine": 1})
        if streamed:
            list(reply)

    with FakeOpenAI() as fake:
        [span] = llm_spans(run, token_ids=True, request_token_ids=True)
    sent = fake.requests[0]
    assert (sent["return_token_ids"], sent["logprobs"], sent["mine"]) == (True, True, 1)
    prompt, completion, logprobs = expected_ids(fake, 0)
    a = span["attributes"]
    assert json.loads(a[token_ids.PROMPT_IDS]) == prompt == [ord(c) for c in USER[0]["content"]]
    assert (json.loads(a[token_ids.RESPONSE_IDS]), json.loads(a[token_ids.LOGPROBS])) == (completion, logprobs)
    assert (a[token_ids.PROMPT_COUNT], a[token_ids.RESPONSE_COUNT]) == (len(prompt), len(completion))
    assert token_ids.CUT not in a


def test_token_ids_are_off_unless_turned_on_and_over_the_cap_only_counted() -> None:
    long = [{"role": "user", "content": "x" * (token_ids.MAX_TOKEN_IDS + 10)}]

    def run() -> None:
        c = client(fake)
        c.chat.completions.create(model="m", messages=USER, logprobs=False, extra_body={"return_token_ids": True})
        c.chat.completions.create(model="m", messages=long, logprobs=True, extra_body={"return_token_ids": True})

    with FakeOpenAI() as fake:
        off = llm_spans(run, token_ids=False)
    with FakeOpenAI() as fake:
        small, big = llm_spans(run, token_ids=True)
    assert not any(k.startswith(("rlpulse.prompt_token", "rlpulse.response_")) for s in off for k in s["attributes"])
    assert fake.requests[0]["logprobs"] is False  # the caller's own choice stands
    a = big["attributes"]
    assert (a[token_ids.CUT], a[token_ids.PROMPT_COUNT], a[token_ids.RESPONSE_COUNT]) == (
        True, len(long[0]["content"]), len("answer: ") + len(long[0]["content"]))
    assert not {token_ids.PROMPT_IDS, token_ids.RESPONSE_IDS, token_ids.LOGPROBS} & set(a)
    assert json.loads(small["attributes"][token_ids.RESPONSE_IDS]) == fake.replies[0][1]["choices"][0]["token_ids"]
    assert token_ids.LOGPROBS not in small["attributes"]  # logprobs=False: the server sent none


def test_token_ids_at_the_delta_level_and_logprobs_too_long_for_an_attribute() -> None:
    assembler = streams.ChatAssembler(swallow_usage=False)
    for ids in ([1, 2], [3]):
        assembler.add({"id": "c", "choices": [{"index": 0, "delta": {"content": "ab", "token_ids": ids}}]})
    assert token_ids.token_id_attributes(assembler.result()) == {token_ids.RESPONSE_COUNT: 3, token_ids.RESPONSE_IDS: "[1,2,3]"}
    wide = {"choices": [{"index": 0, "logprobs": {"content": [{"logprob": -0.123456789012345}] * 5000}}]}
    assert token_ids.token_id_attributes(wide) == {token_ids.CUT: True}  # 5,000 ids fit; 90,000 characters do not


def test_trace_headers_go_out_with_every_call_and_the_callers_own_win(monkeypatch) -> None:
    monkeypatch.setattr(tracing_spans, "outgoing_headers", lambda span: {"x-rollout-id": span.rollout_id, "x-clash": "ours"})

    def run() -> None:
        c = client(fake)
        c.chat.completions.create(model="m", messages=USER, extra_headers={"x-clash": "theirs"})
        list(c.chat.completions.create(model="m", messages=USER, stream=True))
        c.responses.create(model="m", input="hi")

    with FakeOpenAI() as fake:
        assert len(llm_spans(run)) == 3
    assert [(h["x-rollout-id"], h["x-clash"]) for h in fake.headers] == [("r", "theirs"), ("r", "ours"), ("r", "ours")]
