"""openai.schema_check: request bodies refused in the parsers' words, answers checked against
their models under PAGEDSERVE_CHECK_RESPONSES=1 (set for every test by tests/conftest.py)."""

from __future__ import annotations

import json

import pytest

from services.router.openai.errors import OpenAIError
from services.router.openai.schema_check import (
    ResponseMismatch,
    check_body,
    json_response,
    sse,
)
from services.router.openai.schemas.common import ErrorResponse
from services.router.openai.schemas.completions import (
    ChatCompletionRequest,
    ChatStreamEvent,
    CompletionRequest,
)
from services.router.openai.schemas.misc import DetokenizeRequest


@pytest.mark.parametrize("model, body, param, message", [
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}, "messages",
     "messages[0].content must be a string or a list, got 5"),
    (ChatCompletionRequest, {"messages": 5}, "messages",
     "messages must be a list of {role, content} objects, got 5"),
    (ChatCompletionRequest, {"messages": [], "temperature": "hot"}, "temperature",
     "temperature must be a number, got 'hot'"),
    (ChatCompletionRequest, {"messages": [], "stream": 1}, "stream",
     "stream must be a boolean, got 1"),
    (CompletionRequest, {"prompt": "a", "logit_bias": {"5": "high"}}, "logit_bias",
     "logit_bias[5] must be a number, got 'high'"),
    (CompletionRequest, {"prompt": "a", "n": 2.5}, "n", "n must be an integer, got 2.5"),
    (CompletionRequest, {}, "prompt", "prompt is required: a string"),
    (DetokenizeRequest, {"tokens": "1 2"}, "tokens",
     "tokens must be a list of token ids (ints), got '1 2'"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url"}]}]}, "messages",
     "messages[0].content[1].type must be one of text, got 'image_url' (messages[0].content "
     "must be a string, got [{'type': 'text', 'text': 'a'}, {'type': 'image_url'}])"),
    (ChatCompletionRequest, {"messages": [{"role": "wizard", "content": "x"}]}, "messages",
     "messages[0].role must be one of system, developer, user, assistant, tool, function, "
     "got 'wizard'"),
])
def test_a_wrong_type_is_a_400_naming_path_kind_and_value(model, body, param, message):
    with pytest.raises(OpenAIError) as e:
        check_body(model, body)
    assert (e.value.status, e.value.param) == (400, param)
    assert e.value.message.startswith(message), e.value.message


@pytest.mark.parametrize("field, value, message", [
    ("min_p", 1.0000000000000002, "min_p must be in [0, 1], got 1.0000000000000002"),
    ("temperature", -1e-50, "temperature must be >= 0, got -1e-50"),
    ("top_p", 0, "top_p must be in (0, 1], got 0.0"),
    ("presence_penalty", 2.0000001, "presence_penalty must be in [-2, 2], got 2.0000001"),
])
def test_a_range_is_checked_on_the_json_double_not_its_float32(field, value, message):
    """The proto's float32 would round these onto their bound (found by schemathesis:
    ``min_p: 1.0000000000000002`` was answered 200 while the document says at most 1)."""
    with pytest.raises(OpenAIError) as e:
        check_body(CompletionRequest, {"prompt": "a", field: value})
    assert (e.value.message, e.value.param) == (message, field)


def test_what_the_parsers_accept_passes():
    check_body(CompletionRequest, {"prompt": [1, 2], "n": 2.0, "temperature": 1,
                                   "seed": -5, "extra_field": {"x": 1}, "stop": None})
    check_body(ChatCompletionRequest, {"messages": [], "top_p": 10**400})  # range: parsers'


def test_an_answer_that_does_not_match_is_a_500():
    good = {"error": {"message": "m", "type": "t", "param": None, "code": None}}
    assert json_response(ErrorResponse, good, status=400).status == 400
    bad = json_response(ErrorResponse, {"error": {"message": "m"}}, status=400)
    assert bad.status == 500
    assert json.loads(bad.text)["error"]["code"] == "response_mismatch"


def test_a_stream_event_that_does_not_match_raises():
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    with pytest.raises(ResponseMismatch):
        sse({"id": "x", "object": "chat.completion.chunk", "choices": []}, ChatStreamEvent)


def test_production_skips_the_check(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_CHECK_RESPONSES")
    assert json_response(ErrorResponse, {"error": {}}, status=400).status == 400
