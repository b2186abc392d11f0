"""Edge cases of the HTTP API through the whole tiny stack (a tester's findings on issue 34):
vLLM's ``prompt_logprobs`` of a one-token prompt, a ``model`` that is not a string, numbers
that are not JSON in ``chat_template_kwargs``, and errors that name the request's own fields
(not the gRPC API's). Each bad request is a 400 and the server keeps serving."""

from __future__ import annotations

import json

import openai
import pytest
import requests

ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model(tiny_stack):
    return tiny_stack.info().model


def _post(stack, path: str, body: str) -> tuple[int, dict]:
    """POST a raw JSON text (it may hold NaN, which a JSON encoder refuses to write)."""
    r = requests.post(f"{stack.http_url}{path}", data=body,
                      headers={"Content-Type": "application/json"}, timeout=60)
    return r.status_code, r.json()


def _still_serving(oai, model) -> None:
    assert oai.completions.create(model=model, prompt=[5, 6], max_tokens=1).usage


def test_prompt_logprobs_of_a_one_token_prompt_is_a_list_of_one_null(oai, model):
    """vLLM's shape: one entry per prompt token, null for the first, also when it is the
    only one; in a batch each prompt has its own list."""
    r = oai.completions.create(model=model, prompt=[5], max_tokens=1,
                               extra_body={"prompt_logprobs": 1})
    assert r.choices[0].model_extra["prompt_logprobs"] == [None]
    batch = oai.completions.create(model=model, prompt=[[5], [5, 6]], max_tokens=1,
                                   extra_body={"prompt_logprobs": 1})
    first, second = (c.model_extra["prompt_logprobs"] for c in batch.choices)
    assert first == [None] and second[0] is None and "6" in second[1]
    plain = oai.completions.create(model=model, prompt=[5], max_tokens=1)
    assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": 1}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
    ("/tokenize", {"prompt": "hi"}),
])
@pytest.mark.parametrize("value", [5, ["m"], True])
def test_a_model_that_is_not_a_string_is_a_400(tiny, oai, model, path, body, value):
    status, answer = _post(tiny, path, json.dumps({**body, "model": value}))
    assert status == 400, answer
    assert answer["error"]["param"] == "model"
    assert answer["error"]["message"].startswith("model must be a string")
    _still_serving(oai, model)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                             '"max_tokens": 1, "chat_template_kwargs": {"x": %s}}'),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 1, '
                      '"chat_template_kwargs": {"x": [1, %s]}}'),
    ("/tokenize", '{"messages": [{"role": "user", "content": "hi"}], '
                  '"chat_template_kwargs": {"x": {"y": %s}}}'),
])
@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_numbers_that_are_not_json_in_chat_template_kwargs_are_400s(tiny, oai, model, path,
                                                                    body, number):
    status, answer = _post(tiny, path, body % number)
    assert status == 400, answer
    assert answer["error"]["param"] == "chat_template_kwargs"
    assert "NaN and infinite numbers" in answer["error"]["message"]
    _still_serving(oai, model)


@pytest.mark.parametrize("body, words", [
    ({"prompt": ""}, "prompt is empty: send a non-empty prompt, or messages"),
    ({"messages": []}, "messages is empty"),
])
def test_tokenize_errors_name_the_http_fields(tiny, oai, model, body, words):
    status, answer = _post(tiny, "/tokenize", json.dumps(body))
    assert status == 400, answer
    message = answer["error"]["message"]
    assert message.startswith(words) and "chat" not in message
    assert answer["error"]["param"] == next(iter(body))
    _still_serving(oai, model)


def test_a_text_part_without_text_is_named(oai, model):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=model, max_output_tokens=1,
                             input=[{"role": "user", "content": [{"type": "input_text"}]}])
    assert e.value.body["param"] == "input"
    assert e.value.body["message"].startswith("input[0].content[0].text is required")
    _still_serving(oai, model)
