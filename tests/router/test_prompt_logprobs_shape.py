"""vLLM's ``prompt_logprobs`` shape in the OpenAI bodies (``openai.responses.ResponseBuilder``):
one entry per prompt token, null for the first, so a one-token prompt gives ``[None]`` (not
null), on completions (per choice) and chat (top level) alike."""

from __future__ import annotations

import pytest

from services.common.finish_reason import FinishReason
from services.common.pb.pagedserve.v1 import api_pb2
from services.router.openai.responses import OutputOptions, ResponseBuilder


class Tokenizer:
    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join(f"<{i}>" for i in ids)


def _body(chat: bool, prompt_logprobs: list[api_pb2.TokenLogprob], k: int | None) -> dict:
    builder = ResponseBuilder(chat, "m", 1, Tokenizer(), options=OutputOptions(
        prompt_logprobs=k))
    builder.add(api_pb2.GenerateResponse(text="a", token_ids=[1],
                                         prompt_logprobs=prompt_logprobs))
    final = api_pb2.GenerateResponse(text="b", token_ids=[2],
                                     finish_reason=FinishReason.LENGTH.pb)
    builder.add(final)  # a later message carries none: the first one's list stays
    body = builder.response()
    return body if chat else body["choices"][0]


@pytest.mark.parametrize("chat", [False, True])
def test_a_one_token_prompt_has_one_null_entry(chat):
    assert _body(chat, [], 1)["prompt_logprobs"] == [None]


@pytest.mark.parametrize("chat", [False, True])
def test_a_longer_prompt_has_null_then_its_tokens(chat):
    entry = api_pb2.TokenLogprob(token_id=7, logprob=-1.5,
                                 top=[api_pb2.TopLogprob(token_id=3, logprob=-0.5)])
    assert _body(chat, [entry], 1)["prompt_logprobs"] == [
        None, {7: {"logprob": -1.5, "rank": None, "decoded_token": "<7>"},
               3: {"logprob": -0.5, "rank": 1, "decoded_token": "<3>"}}]


@pytest.mark.parametrize("chat", [False, True])
def test_without_the_option_there_is_no_list(chat):
    assert "prompt_logprobs" not in _body(chat, [], None)
