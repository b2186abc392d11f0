"""The OpenAI HTTP layer without a stack: JSON -> GenerateRequest, error mapping, and the
server's answers while it has no engine."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest

from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2
from services.common.sampling_params import EngineSamplingParams
from services.router.generation import EngineError, PreparedRequest
from services.router.openai.errors import OpenAIError
from services.router.openai.http import OpenAIServer
from services.router.openai.requests import from_error, parse_chat, parse_completion
from services.router.validation import RequestError, TextOptions


def test_completion_fields_map_onto_the_grpc_request():
    p = parse_completion({
        "model": "m", "prompt": [[1, 2, 3]], "max_tokens": 7, "temperature": 0, "top_p": 0.5,
        "n": 2, "stop": "x", "seed": -1, "top_k": 4, "min_p": 0.1, "repetition_penalty": 1.2,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "min_tokens": 2,
        "ignore_eos": True, "stop_token_ids": [9], "include_stop_str_in_output": True,
        "skip_special_tokens": False, "priority": -3, "stream": True,
        "stream_options": {"include_usage": True}, "user": "ignored", "logprobs": None})
    r, sp = p.requests[0], p.requests[0].sampling_params
    assert list(r.prompt_token_ids.ids) == [1, 2, 3] and r.priority == -3
    assert (sp.max_tokens, sp.temperature, sp.n, list(sp.stop), sp.seed) == (7, 0, 2, ["x"],
                                                                             2**64 - 1)
    assert sp.top_k == 4 and sp.min_tokens == 2 and list(sp.stop_token_ids) == [9]
    assert sp.min_p == pytest.approx(0.1) and sp.repetition_penalty == pytest.approx(1.2)
    assert sp.presence_penalty == 0.5 and sp.frequency_penalty == -0.5
    assert sp.ignore_eos and sp.include_stop_str_in_output and not sp.skip_special_tokens
    assert p.stream and p.include_usage and len(p.requests) == 1
    assert not parse_completion({"prompt": "hi"}).requests[0].sampling_params.HasField("top_p")


def test_chat_fields_map_onto_the_grpc_request():
    p = parse_chat({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
        "max_tokens": 3, "max_completion_tokens": 5, "logprobs": False})
    assert [(m.role, m.content) for m in p.request.chat.messages] == [
        ("system", "be brief"), ("user", "ab"), ("assistant", "")]
    assert p.request.chat.messages[2].tool_calls[0] == api_pb2.ToolCall(id="c1", name="f",
                                                                        arguments="{}")
    with pytest.raises(OpenAIError) as err:  # null content without tool calls (OpenAI's rule)
        parse_chat({"messages": [{"role": "assistant", "content": None}]})
    assert err.value.param == "messages" and "messages[0].content" in err.value.message
    assert p.request.sampling_params.max_tokens == 5 and not p.stream
    assert not p.request.sampling_params.HasField("logprobs")
    lp = parse_chat({"messages": [], "logprobs": True}).request.sampling_params
    assert lp.HasField("logprobs") and lp.logprobs == 0
    lp = parse_chat({"messages": [], "logprobs": True, "top_logprobs": 4}).request
    assert lp.sampling_params.logprobs == 4
    (req,) = parse_completion({"prompt": "a", "logprobs": 3}).requests
    assert req.sampling_params.logprobs == 3


def test_completion_batch_echo_best_of_and_logit_bias_map_onto_the_grpc_requests():
    p = parse_completion({"prompt": ["a", "b", "c"], "n": 2, "best_of": 3, "seed": 5,
                          "logit_bias": {"7": -100, "-1": 2.5}})
    assert [r.prompt for r in p.requests] == ["a", "b", "c"]
    assert (p.n, p.best_of, p.echo, p.score_only, p.logprobs) == (2, 3, False, False, None)
    for r in p.requests:  # best_of > n ranks by logprob: the engine is asked for them
        sp = r.sampling_params
        assert sp.logprobs == 0 and not sp.HasField("prompt_logprobs") and sp.seed == 5
        assert dict(sp.logit_bias) == {7: -100.0, -1: 2.5}  # ranges are validation's
    ids = parse_completion({"prompt": [[1, 2], [3]]}).requests
    assert [list(r.prompt_token_ids.ids) for r in ids] == [[1, 2], [3]]
    assert len(parse_completion({"prompt": [1, 2]}).requests) == 1  # a list of ints: 1 prompt
    p = parse_completion({"prompt": "a", "echo": True, "logprobs": 2})
    sp = p.requests[0].sampling_params
    assert p.echo and p.logprobs and (sp.logprobs, sp.prompt_logprobs) == (2, 2)
    assert p.best_of == p.n == 1 and not sp.HasField("max_tokens")
    p = parse_completion({"prompt": "a", "echo": True, "max_tokens": 0})
    assert p.score_only and p.requests[0].sampling_params.max_tokens == 1
    p = parse_completion({"prompt": "a", "best_of": 2, "n": 2, "stream": True})
    assert p.best_of == 2 and not p.requests[0].sampling_params.HasField("logprobs")


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "echo": 1}, "echo"),
    ({"prompt": "a", "best_of": 0}, "best_of"),
    ({"prompt": "a", "best_of": 65}, "best_of"),
    ({"prompt": "a", "n": 3, "best_of": 2}, "best_of"),
    ({"prompt": "a", "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": "a", "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ({"prompt": "a", "logit_bias": [1]}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"1.0": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"99999999999": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"1": "5"}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"1": True}}, "logit_bias"),
    ({"prompt": ["a", 5]}, "prompt"),
    ({"prompt": ["a"] * 1025}, "prompt"),
    ({"prompt": "a", "suffix": "b"}, "suffix"),
    ({"prompt": "a", "logprobs": 1.5}, "logprobs"),
    ({"prompt": "a", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "a", "prompt_logprobs": "1"}, "prompt_logprobs"),
    ({"prompt": "a", "n": 1.5}, "n"),
    ({"prompt": "a", "max_tokens": 2**40}, "max_tokens"),
    ({"prompt": "a", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "a", "stop": [1]}, "stop"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({}, "prompt"),
])
def test_completion_refusals_name_the_field(body, param):
    with pytest.raises(OpenAIError) as err:
        parse_completion(body)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("body, param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": [], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [], "logprobs": 1}, "logprobs"),
    ({"messages": [], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [], "logit_bias": {"a": 1}}, "logit_bias"),
    ({"messages": [], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [], "structured_outputs": {"regex": 1}}, "structured_outputs"),
    ({"messages": [], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"messages": [], "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options"),
])
def test_chat_refusals_name_the_field(body, param):
    with pytest.raises(OpenAIError) as err:
        parse_chat(body)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("code, message, field, status, param", [
    (grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0, got -1.0", "temperature", 400,
     "temperature"),
    (grpc.StatusCode.INVALID_ARGUMENT, "stop[2] must have 1 to 256 characters", "stop", 400,
     "stop"),
    (grpc.StatusCode.INVALID_ARGUMENT, "chat.messages is empty", "messages", 400, "messages"),
    (grpc.StatusCode.INVALID_ARGUMENT, "prompt has 9 tokens but max_model_len is 8", "prompt",
     400, "messages"),
    (grpc.StatusCode.INVALID_ARGUMENT, "structured_outputs.regex is empty",
     "structured_outputs", 400, "response_format"),
    (grpc.StatusCode.INVALID_ARGUMENT, "request_id must have at most 128 characters",
     "request_id", 400, None),  # the X-Request-Id header, not a body field
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", None, 429, None),
    (grpc.StatusCode.UNAVAILABLE, "scheduler gone", None, 503, None),
    (grpc.StatusCode.INTERNAL, "boom", None, 500, None),
])
def test_grpc_status_to_http(code, message, field, status, param):
    e = from_error(RequestError(code, message, field), prompt_param="messages",
                   structured_param="response_format")
    assert (e.status, e.param) == (status, param)
    assert e.body()["error"]["message"] == message


class _NoEngine:
    """An engine client that never connected."""
    info = None
    serving = asyncio.Event()


def test_server_without_engine_answers_503_and_404():
    async def main():
        server = OpenAIServer(_NoEngine(), tokenizer=None)
        port = await server.start("127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{url}/health") as r:
                    assert r.status == 503
                async with s.post(f"{url}/v1/completions", json={"prompt": "a"}) as r:
                    assert r.status == 503 and (await r.json())["error"]["type"] == "server_error"
                async with s.get(f"{url}/v1/models") as r:
                    assert r.status == 503
                async with s.post(f"{url}/v1/chat/completions", data=b"{") as r:
                    assert r.status == 400 and "JSON" in (await r.json())["error"]["message"]
                async with s.get(f"{url}/v1/completions") as r:
                    assert r.status == 405 and "error" in await r.json()
                async with s.post(f"{url}/v2/x", data=b"{") as r:
                    assert r.status == 404 and "/v2/x" in (await r.json())["error"]["message"]
        finally:
            await server.stop()
    asyncio.run(main())


class _FakeEngine:
    """Connected, serving model "m"; the generation itself is faked below."""

    def __init__(self):
        self.info = engine_pb2.GetEngineInfoResponse(model="m", max_model_len=64)
        self.serving = asyncio.Event()
        self.serving.set()


def _fake_generation(monkeypatch, fail_after: int, closed: list):
    """``stream_responses`` yields ``fail_after`` one-token messages, then raises 429's
    RESOURCE_EXHAUSTED; ``closed`` records that the generator was closed (/v1/completions,
    whose calls ``openai.completions`` runs)."""
    from services.router.openai import completions as openai_completions

    async def stream_responses(engine, tokenizer, prepared, **options):
        try:
            for i in range(fail_after):
                yield api_pb2.GenerateResponse(token_ids=[1], text=f"t{i}")
            raise EngineError(grpc.StatusCode.RESOURCE_EXHAUSTED, "engine queue is full")
        finally:
            closed.append(True)

    monkeypatch.setattr(openai_completions, "prepare", lambda req, tok, info, **kw: PreparedRequest(
        "r", [1, 2], EngineSamplingParams(), TextOptions()))
    monkeypatch.setattr(openai_completions, "stream_responses", stream_responses)


async def _post(body: dict) -> tuple[int, str]:
    server = OpenAIServer(_FakeEngine(), tokenizer=None)
    port = await server.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                return r.status, await r.text()
    finally:
        await server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_engine_refusal_before_any_token_is_429(monkeypatch, stream):
    closed = []
    _fake_generation(monkeypatch, fail_after=0, closed=closed)
    status, text = asyncio.run(_post({"prompt": "a", "stream": stream}))
    assert status == 429 and '"rate_limit_error"' in text and "queue is full" in text
    assert closed


def test_engine_error_mid_stream_is_an_error_event(monkeypatch):
    closed = []
    _fake_generation(monkeypatch, fail_after=2, closed=closed)
    status, text = asyncio.run(_post({"prompt": "a", "stream": True, "model": "m"}))
    events = [e.removeprefix("data: ") for e in text.strip().split("\n\n")]
    assert status == 200 and len(events) == 4 and events[-1] == "[DONE]"
    assert json.loads(events[1])["choices"][0]["text"] == "t1"
    assert json.loads(events[2])["error"]["code"] == "resource_exhausted"
    assert closed


def test_chat_with_an_unknown_role_is_400_naming_the_message():
    """Through the real HTTP server and the real ``prepare`` (the same rule as gRPC Chat)."""
    from tests.router import tiny_bos_tokenizer

    async def main():
        engine = _FakeEngine()
        engine.info.vocab_size = 16
        server = OpenAIServer(engine, tokenizer=tiny_bos_tokenizer())
        port = await server.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={
                        "model": "m", "messages": [{"role": "user", "content": "hi"},
                                                   {"role": "wizard", "content": "abracadabra"}]
                }) as r:
                    return r.status, await r.json()
        finally:
            await server.stop()

    status, body = asyncio.run(main())
    assert status == 400
    assert body["error"]["param"] == "messages"
    assert body["error"]["message"] == ("messages[1].role must be one of system, developer, "
                                        "user, assistant, tool, function, got 'wizard'")


def test_a_failing_prompt_of_a_batch_closes_the_others(monkeypatch):
    """Prompt 1 fails after its first message while prompt 0 is still generating: the call
    ends with the error, and prompt 0's generator is closed (which aborts its engine
    requests)."""
    from services.router.openai import completions as openai_completions

    closed = []

    async def stream_responses(engine, tokenizer, prepared, **options):
        try:
            yield api_pb2.GenerateResponse(token_ids=[1], text=prepared.request_id)
            if prepared.request_id.endswith("-0"):
                await asyncio.Event().wait()  # never ends by itself
            raise EngineError(grpc.StatusCode.RESOURCE_EXHAUSTED, "engine queue is full")
        finally:
            closed.append(prepared.request_id)

    monkeypatch.setattr(openai_completions, "prepare", lambda req, tok, info, **kw: PreparedRequest(
        "r", [1, 2], EngineSamplingParams(), TextOptions()))
    monkeypatch.setattr(openai_completions, "stream_responses", stream_responses)
    status, text = asyncio.run(_post({"prompt": ["a", "b"], "model": "m"}))
    assert status == 429 and "queue is full" in text
    assert sorted(rid[-2:] for rid in closed) == ["-0", "-1"]
