"""EmbeddingCall's validation (services/router/openai/embeddings.py) apart from the stack:
the server's runner, the input shapes and the response's shape."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from services.common.pb.pagedserve.v1 import engine_pb2
from services.router.openai.embeddings import EmbeddingCall
from services.router.openai.errors import OpenAIError

POOLING = engine_pb2.GetEngineInfoResponse(model="m", max_model_len=8, vocab_size=100,
                                           runner="pooling", embedding_size=4,
                                           is_matryoshka=True)


def test_a_generate_server_refuses_embeddings_naming_the_runner():
    for runner in ("generate", ""):  # ("": a scheduler from before runners)
        info = engine_pb2.GetEngineInfoResponse(model="m", max_model_len=8, vocab_size=100,
                                                runner=runner)
        with pytest.raises(OpenAIError) as err:
            EmbeddingCall.parse({"input": [1, 2]}, "id", None, info)
        assert err.value.status == 400
        assert "does not support Embeddings API" in err.value.message
        assert "--runner generate" in err.value.message


@pytest.mark.parametrize("value, prompts", [
    ([5, 6], [[5, 6]]), ([[5], [6, 7]], [[5], [6, 7]])])
def test_token_ids_one_list_or_many(value, prompts):
    assert EmbeddingCall.parse({"input": value}, "id", None, POOLING).prompts == prompts


@pytest.mark.parametrize("value", [True, [True], [[1.5]], [[1], "a"], None, 3])
def test_other_shapes_are_refused(value):
    with pytest.raises(OpenAIError) as err:
        EmbeddingCall.parse({"input": value}, "id", None, POOLING)
    assert err.value.param == "input" and "list of token-id lists" in err.value.message


def test_prompt_of_max_model_len_is_taken_one_more_is_not():
    EmbeddingCall.parse({"input": list(range(8))}, "id", None, POOLING)
    with pytest.raises(OpenAIError, match="9 tokens, more than the model's max_model_len 8"):
        EmbeddingCall.parse({"input": list(range(9))}, "id", None, POOLING)


def test_response_float_base64_and_dimensions():
    call = EmbeddingCall.parse({"input": [[1, 2], [3]], "encoding_format": "base64",
                                "dimensions": 2}, "embd-1", None, POOLING)
    call.vectors = [[3.0, 4.0, 1.0, 1.0], [0.0, 2.0, 5.0, 5.0]]
    r = call.response("m")
    assert (r["object"], r["model"], r["id"]) == ("list", "m", "embd-1")
    assert r["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    got = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4").tolist() for d in r["data"]]
    assert got == [[np.float32(0.6), np.float32(0.8)], [0.0, 1.0]]
    assert [d["index"] for d in r["data"]] == [0, 1]
    with pytest.raises(OpenAIError, match="embedding size 4"):
        EmbeddingCall.parse({"input": [1], "dimensions": 5}, "id", None, POOLING)
