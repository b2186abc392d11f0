"""Beam search's refusals at the router, each naming its field: gRPC ``validate_sampling`` and
the OpenAI request parsing (``openai.requests``, then ``prepare`` as the routes run it), and the
engine parameters a beam search is submitted with."""

from __future__ import annotations

import math

import grpc
import pytest

from services.common.lora import LoRARequest
from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2
from services.common.sampling_params import EngineSamplingParams
from services.router.generation import engine_refusal, prepare
from services.router.openai.errors import OpenAIError
from services.router.openai.requests import from_error, parse_chat, parse_completion
from services.router.validation import RequestError, validate_sampling
from tests.router import SMOLLM2_VOCAB_SIZE, smollm2_tokenizer

INFO = engine_pb2.GetEngineInfoResponse(model="smol", max_model_len=256,
                                        vocab_size=SMOLLM2_VOCAB_SIZE, eos_token_ids=[2])
WEATHER_TOOLS = [{"type": "function", "function": {"name": "weather"}}]


# ---- gRPC: validate_sampling -------------------------------------------------------------
def check(**fields) -> EngineSamplingParams:
    return validate_sampling(api_pb2.SamplingParams(**fields), vocab_size=SMOLLM2_VOCAB_SIZE)[0]


def refusal(**fields) -> str:
    with pytest.raises(RequestError) as e:
        check(**fields)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return e.value.message


def test_beam_search_is_submitted_greedy_with_only_what_it_uses():
    assert check(use_beam_search=True, n=3) == EngineSamplingParams(
        temperature=0.0, beam_width=3, length_penalty=1.0, early_stopping="false")
    # the sampling options at their "off" values are accepted; the seed is ignored
    got = check(use_beam_search=True, n=2, beam_width=5, length_penalty=0.5,
                early_stopping="never", max_tokens=9, stop_token_ids=[7], ignore_eos=True,
                seed=11, temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0,
                repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                min_tokens=0, skip_special_tokens=False, include_stop_str_in_output=True)
    assert got == EngineSamplingParams(
        temperature=0.0, max_tokens=9, stop_token_ids=(7,), ignore_eos=True, beam_width=5,
        length_penalty=0.5, early_stopping="never")
    assert check(use_beam_search=True, top_k=SMOLLM2_VOCAB_SIZE).beam_width == 1  # top_k off
    assert check(use_beam_search=True, early_stopping="true").early_stopping == "true"


def test_sampling_requests_keep_beam_width_0():
    assert check(n=4).beam_width == 0 and check(n=4) == EngineSamplingParams()
    # the beam fields at their defaults are accepted without beam search (clients that send
    # every field), and change nothing
    assert check(length_penalty=1.0, early_stopping="false") == EngineSamplingParams()


@pytest.mark.parametrize("fields, message", [
    ({"temperature": 0.7}, "temperature must be 0 with use_beam_search, got 0.7"),
    ({"top_p": 0.9}, "top_p must be 1 with use_beam_search, got 0.9"),
    ({"top_k": 40}, "top_k must be off (0 or -1) with use_beam_search, got 40"),
    ({"min_p": 0.1}, "min_p must be 0 with use_beam_search, got 0.1"),
    ({"repetition_penalty": 1.2}, "repetition_penalty must be 1 with use_beam_search, got 1.2"),
    ({"presence_penalty": 0.5}, "presence_penalty must be 0 with use_beam_search, got 0.5"),
    ({"frequency_penalty": -1.0},
     "frequency_penalty must be 0 with use_beam_search, got -1.0"),
    ({"logit_bias": {5: -100.0}}, "logit_bias must be empty with use_beam_search"),
    ({"min_tokens": 2}, "min_tokens must be 0 with use_beam_search, got 2"),
    ({"logprobs": 0}, "logprobs is not supported with use_beam_search"),
    ({"prompt_logprobs": 1}, "prompt_logprobs is not supported with use_beam_search"),
    ({"structured_outputs": api_pb2.StructuredOutputs(regex="a+")},
     "structured_outputs is not supported with use_beam_search"),
    ({"stop": ["\n"]}, "stop (stop strings) is not supported with use_beam_search: beams are "
                       "ranked on tokens, not text; use stop_token_ids"),
    ({"n": 4, "beam_width": 3}, "beam_width must be in [n, 64] (n is 4), got 3"),
    ({"beam_width": 65}, "beam_width must be in [n, 64] (n is 1), got 65"),
    ({"beam_width": 0}, "beam_width must be in [n, 64] (n is 1), got 0"),
    ({"beam_width": -1}, "beam_width must be in [n, 64] (n is 1), got -1"),
    ({"n": 65}, "n must be in [1, 64], got 65"),
    ({"length_penalty": math.inf}, "length_penalty must be a finite number, got inf"),
    ({"length_penalty": math.nan}, "length_penalty must be a finite number, got nan"),
    ({"early_stopping": "maybe"},
     'early_stopping must be one of "true", "false", "never", got \'maybe\''),
    ({"early_stopping": ""}, 'early_stopping must be one of "true", "false", "never", got \'\''),
    ({"early_stopping": "True"},
     'early_stopping must be one of "true", "false", "never", got \'True\''),
])
def test_beam_search_refusals_name_the_field(fields, message):
    assert refusal(use_beam_search=True, **fields) == message


def test_the_ordinary_ranges_are_checked_first():
    assert refusal(use_beam_search=True, temperature=-1.0) == (
        "temperature must be >= 0, got -1.0")
    assert refusal(use_beam_search=True, top_p=0.0) == "top_p must be in (0, 1], got 0.0"


@pytest.mark.parametrize("fields", [{"beam_width": 4}, {"beam_width": 0},
                                    {"length_penalty": 2.0}, {"early_stopping": "never"},
                                    {"early_stopping": "true"}])
def test_beam_fields_without_use_beam_search_are_refused(fields):
    (name,) = fields
    assert refusal(**fields) == f"{name} requires use_beam_search to be true"


# ---- HTTP: the request bodies ------------------------------------------------------------
USER = [{"role": "user", "content": "The capital of France?"}]


def http(body: dict, chat: bool = True, tool_parser: str | None = None):
    """Parse ``body`` as the route does and prepare it: the PreparedRequest and the parse."""
    if chat:
        parsed = parse_chat({"messages": USER, **body}, tool_parser)
        request, param = parsed.request, parsed.prompt_param
    else:
        completion = parse_completion({"prompt": "The capital of France is", **body})
        (request,), param = completion.requests, "prompt"
        parsed = completion
    try:
        return prepare(request, smollm2_tokenizer(), INFO), parsed
    except RequestError as e:  # as openai.http answers it
        raise from_error(e, param) from None


def http_refusal(body: dict, chat: bool = True) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        http(body, chat)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("chat", [True, False])
def test_http_fields_map_onto_the_engine_params(chat):
    prepared, _ = http({"use_beam_search": True, "n": 2, "beam_width": 4,
                        "length_penalty": 0.25, "early_stopping": "never", "max_tokens": 8,
                        "temperature": 0, "seed": -3, "stop_token_ids": [5]}, chat)
    assert prepared.n == 2 and prepared.params == EngineSamplingParams(
        temperature=0.0, max_tokens=8, stop_token_ids=(5,), beam_width=4, length_penalty=0.25,
        early_stopping="never")
    for value, wire in ((True, "true"), (False, "false"), (None, "false")):
        prepared, _ = http({"use_beam_search": True, "early_stopping": value}, chat)
        assert prepared.params.early_stopping == wire and prepared.params.beam_width == 1
    prepared, _ = http({"use_beam_search": False, "n": 2}, chat)
    assert prepared.params.beam_width == 0 and prepared.params.temperature == 1.0


@pytest.mark.parametrize("body, param", [
    ({"use_beam_search": "yes"}, "use_beam_search"),
    ({"use_beam_search": 1}, "use_beam_search"),
    ({"use_beam_search": True, "beam_width": "4"}, "beam_width"),
    ({"use_beam_search": True, "beam_width": 2.5}, "beam_width"),
    ({"use_beam_search": True, "beam_width": 2**40}, "beam_width"),
    ({"use_beam_search": True, "length_penalty": "1"}, "length_penalty"),
    ({"use_beam_search": True, "early_stopping": "true"}, "early_stopping"),
    ({"use_beam_search": True, "early_stopping": 1}, "early_stopping"),
])
@pytest.mark.parametrize("chat", [True, False])
def test_http_wrong_types_name_the_field(body, param, chat):
    e = http_refusal(body, chat)
    assert e.param == param and e.message.startswith(param)


@pytest.mark.parametrize("body, param", [
    ({"temperature": 0.5}, "temperature"), ({"top_p": 0.5}, "top_p"), ({"top_k": 5}, "top_k"),
    ({"min_p": 0.1}, "min_p"), ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"), ({"logit_bias": {"3": 1}}, "logit_bias"),
    ({"min_tokens": 2}, "min_tokens"), ({"stop": "\n"}, "stop"), ({"stop": ["a"]}, "stop"),
    ({"n": 3, "beam_width": 2}, "beam_width"), ({"beam_width": 65}, "beam_width"),
    ({"length_penalty": math.inf}, "length_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
])
@pytest.mark.parametrize("chat", [True, False])
def test_http_refusals_name_the_field(body, param, chat):
    e = http_refusal({"use_beam_search": True, **body}, chat)
    assert e.param == param and e.message.startswith(param), e.message
    assert "use_beam_search" in e.message or param in ("beam_width", "length_penalty")


def test_http_route_specific_refusals():
    e = http_refusal({"use_beam_search": True, "logprobs": 2}, chat=False)
    assert (e.param, e.message) == ("logprobs", "logprobs is not supported with use_beam_search")
    for body in ({"logprobs": True}, {"logprobs": True, "top_logprobs": 3}):
        e = http_refusal({"use_beam_search": True, **body})
        assert e.param == "logprobs" and "use_beam_search" in e.message
    e = http_refusal({"use_beam_search": True, "n": 2, "best_of": 3}, chat=False)
    assert e.param == "best_of" and "use_beam_search" in e.message
    prepared, parsed = http({"use_beam_search": True, "n": 2, "best_of": 2}, chat=False)
    assert parsed.best_of == 2 and prepared.params.beam_width == 2
    for choice in ("required", {"type": "function", "function": {"name": "weather"}}):
        e = http_refusal({"use_beam_search": True, "tools": WEATHER_TOOLS, "tool_choice": choice})
        assert e.param == "tool_choice" and "use_beam_search" in e.message


def test_http_tool_choice_auto_and_none_give_plain_content():
    for choice in ("auto", "none"):
        prepared, parsed = http({"use_beam_search": True, "tools": WEATHER_TOOLS,
                                 "tool_choice": choice}, tool_parser="hermes")
        assert parsed.tool_calls is None and prepared.params.beam_width == 1
    _, sampled = http({"tools": WEATHER_TOOLS, "tool_choice": "auto"}, tool_parser="hermes")
    assert sampled.tool_calls is not None  # without beam search the text is parsed


@pytest.mark.parametrize("beam, lora, code, message, status, param", [
    (True, False, grpc.StatusCode.INVALID_ARGUMENT, "request cmpl-1-0: beam_width 8 with 90 new "
     "tokens may need 80 KV blocks but the cache has 48; lower beam_width or max_tokens", 400,
     "beam_width"),
    (True, False, grpc.StatusCode.INVALID_ARGUMENT, "request 7: beam_width 9 is more than "
     "max_num_seqs=8 (every beam is a running sequence)", 400, "beam_width"),
    (False, True, grpc.StatusCode.INVALID_ARGUMENT, "model 'a' is a LoRA adapter but the "
     "workers run no adapters", 400, "model"),
    (True, True, grpc.StatusCode.INVALID_ARGUMENT, "either", 400, None),  # adapter or beams?
    (True, False, grpc.StatusCode.RESOURCE_EXHAUSTED, "engine queue is full", 429, None),
    (False, False, grpc.StatusCode.INVALID_ARGUMENT, "requested things", 400, None),
])
def test_engine_refusals_name_what_only_the_engine_checks(beam, lora, code, message, status,
                                                         param):
    """The scheduler's own rules (max_num_seqs, the KV cache's size) are beam_width's; the
    workers' refusal of an adapter is the model's."""
    prepared, _ = http({"use_beam_search": True, "n": 2} if beam else {})
    if lora:
        prepared.lora = LoRARequest(1, "a", "/adapters/a")
    e = from_error(engine_refusal(prepared, code.value[0], message), prompt_param="messages")
    assert (e.status, e.param, e.message) == (status, param, message)
