"""The SDK's chat / tokenize / detokenize / list_models request building and result types,
without a server."""

from __future__ import annotations

import pytest
from pagedserve_client import ModelInfo, TokenizeResult, build_request
from pagedserve_client.pb.pagedserve.v1 import api_pb2
from pagedserve_client.text_types import (chat_request, detokenize_request, models_from_pb,
                                          tokenize_request, tokenize_result)

MESSAGES = [{"role": "user", "content": "hi"}]


def test_chat_request_carries_messages_sampling_id_and_priority():
    req = chat_request(build_request(messages=MESSAGES, request_id="r", priority=-2,
                                     max_tokens=5, stop="x", n=2))
    assert [(m.role, m.content) for m in req.messages] == [("user", "hi")]
    assert (req.request_id, req.priority) == ("r", -2)
    assert (req.sampling_params.max_tokens, list(req.sampling_params.stop),
            req.sampling_params.n) == (5, ["x"], 2)


def test_tokenize_request_forms_and_unset_options():
    req = tokenize_request("text", None, None, None)
    assert req.prompt == "text"
    assert not req.HasField("add_special_tokens") and not req.HasField("add_generation_prompt")
    req = tokenize_request(None, MESSAGES, False, False)
    assert req.WhichOneof("input") == "chat" and len(req.chat.messages) == 1
    assert req.HasField("add_special_tokens") and not req.add_special_tokens
    assert req.HasField("add_generation_prompt") and not req.add_generation_prompt
    # an empty conversation is still the chat input, so the server names chat.messages
    assert tokenize_request(None, [], None, None).WhichOneof("input") == "chat"


def test_tokenize_request_errors():
    with pytest.raises(ValueError, match="exactly one"):
        tokenize_request("a", MESSAGES, None, None)
    with pytest.raises(ValueError, match="exactly one"):
        tokenize_request(None, None, None, None)
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tokenize_request(None, [{"content": "x"}], None, None)


def test_detokenize_request():
    req = detokenize_request([1, 2], None)
    assert list(req.token_ids) == [1, 2] and not req.HasField("skip_special_tokens")
    assert detokenize_request([], False).HasField("skip_special_tokens")
    with pytest.raises(ValueError, match="token_ids"):
        detokenize_request([2**40], None)
    with pytest.raises(TypeError, match="token_ids"):
        detokenize_request(["a"], None)


def test_results_from_pb():
    assert tokenize_result(api_pb2.TokenizeResponse(token_ids=[4, 5], count=2,
                                                    max_model_len=9)) == TokenizeResult([4, 5],
                                                                                        2, 9)
    msg = api_pb2.ListModelsResponse(models=[api_pb2.ModelInfo(
        id="m", max_model_len=8, vocab_size=10, dtype="bfloat16", eos_token_ids=[2])])
    assert models_from_pb(msg) == [ModelInfo("m", 8, 10, "bfloat16", [2])]
