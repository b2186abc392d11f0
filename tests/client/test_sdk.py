"""The SDK's request building: vLLM-style arguments, errors that name the field."""

from __future__ import annotations

import pytest
from pagedserve_client import build_request


def test_stop_accepts_one_string_like_vllm():
    req = build_request("hi", stop="Paris", max_tokens=3)
    assert list(req.sampling_params.stop) == ["Paris"]


def test_exactly_one_prompt_form():
    with pytest.raises(ValueError, match="exactly one"):
        build_request("hi", prompt_token_ids=[1])
    with pytest.raises(ValueError, match="exactly one"):
        build_request()


@pytest.mark.parametrize("kwargs, field", [
    (dict(seed=-1), "seed"), (dict(max_tokens=2**31), "max_tokens"),
    (dict(stop_token_ids=[2**40]), "stop_token_ids"), (dict(top_k=2**40), "top_k")])
def test_out_of_range_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        build_request("hi", **kwargs)


def test_unknown_parameter_and_bad_messages():
    with pytest.raises(ValueError, match="temprature"):
        build_request("hi", temprature=0.5)
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        build_request(messages=[{"content": "x"}])


def test_prompt_forms():
    assert build_request("text").prompt == "text"
    chat = build_request(messages=[{"role": "user", "content": "hi"}]).chat.messages
    assert [(m.role, m.content) for m in chat] == [("user", "hi")]
    assert list(build_request(prompt_token_ids=[1, 2]).prompt_token_ids.ids) == [1, 2]
