"""The Embed call's validation apart from the stack: ``prepare_embed`` (services/router/
embedding.py: the server's runner, inputs, lengths, dimensions), the OpenAI mapping
(openai/embeddings.py: input shapes, encoding_format) and the answers' shapes."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2
from services.router.embedding import PreparedEmbed, prepare_embed, shorten
from services.router.openai.embeddings import (
    embedding_response,
    parse_embedding,
)
from services.router.openai.errors import OpenAIError
from services.router.validation import RequestError

POOLING = engine_pb2.GetEngineInfoResponse(model="m", max_model_len=8, vocab_size=100,
                                           runner="pooling", embedding_size=4,
                                           is_matryoshka=True)


def _prepare(body: dict, info=POOLING) -> PreparedEmbed:
    return prepare_embed(parse_embedding(body)[0], None, info)


def test_a_generate_server_refuses_embeddings_naming_the_runner():
    for runner in ("generate", ""):  # ("": a scheduler from before runners)
        info = engine_pb2.GetEngineInfoResponse(model="m", max_model_len=8, vocab_size=100,
                                                runner=runner)
        with pytest.raises(RequestError) as err:
            _prepare({"input": [1, 2]}, info)
        assert "does not support Embeddings API" in err.value.message
        assert "--runner generate" in err.value.message


@pytest.mark.parametrize("value, prompts", [
    ([5, 6], [[5, 6]]), ([[5], [6, 7]], [[5], [6, 7]])])
def test_token_ids_one_list_or_many(value, prompts):
    assert _prepare({"input": value}).prompts == prompts


@pytest.mark.parametrize("value", [True, [True], [[1.5]], [[1], "a"], None, 3, []])
def test_other_shapes_are_refused(value):
    with pytest.raises(OpenAIError) as err:
        parse_embedding({"input": value})
    assert err.value.param == "input" and "list of token-id lists" in err.value.message


@pytest.mark.parametrize("body, words, param", [
    ({"input": list(range(9))}, "9 tokens, more than the model's max_model_len 8", "input"),
    ({"input": [[1], []]}, "input[1] is empty", "input"),
    ({"input": ["a"] * 2049}, "between 1 and 2048", "input"),
    ({"input": [[1, 100]]}, "input[0][1] = 100 is not a token id", "input"),
    ({"input": [1], "dimensions": 5}, "embedding size 4", "dimensions"),
    ({"input": [1], "truncate_prompt_tokens": 0}, ">= 1, or -1", "truncate_prompt_tokens")])
def test_limits_name_the_field(body, words, param):
    with pytest.raises(RequestError) as err:
        _prepare(body)
    assert words in err.value.message and err.value.param == param


def test_prompt_of_max_model_len_is_taken_and_truncation_keeps_the_last():
    assert _prepare({"input": list(range(8))}).prompts == [list(range(8))]
    assert _prepare({"input": list(range(20)), "truncate_prompt_tokens": 3}).prompts == [
        [17, 18, 19]]
    assert _prepare({"input": list(range(20)), "truncate_prompt_tokens": -1}).prompts == [
        list(range(12, 20))]


def test_encoding_format_and_number_types():
    assert parse_embedding({"input": "a", "encoding_format": "base64"})[1] == "base64"
    for body, param in (({"input": "a", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "a", "dimensions": "2"}, "dimensions"),
                        ({"input": "a", "truncate_prompt_tokens": 1.5},
                         "truncate_prompt_tokens")):
        with pytest.raises(OpenAIError) as err:
            parse_embedding(body)
        assert err.value.param == param


def test_openai_response_float_base64_and_shortened_vectors():
    req = _prepare({"input": [[1, 2], [3]], "dimensions": 2})
    assert req.dimensions == 2
    vectors = [shorten([3.0, 4.0, 1.0, 1.0], 2), shorten([0.0, 2.0, 5.0, 5.0], 2)]
    r = embedding_response(req, vectors, "base64", "m")
    assert (r["object"], r["model"], r["id"][:5]) == ("list", "m", "embd-")
    assert r["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    got = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4").tolist() for d in r["data"]]
    assert got == [[np.float32(0.6), np.float32(0.8)], [0.0, 1.0]]
    assert [d["index"] for d in r["data"]] == [0, 1]
    assert embedding_response(req, vectors, "float", "m")["data"][0]["embedding"] == [0.6, 0.8]


def test_grpc_request_texts_are_tokenized_with_special_tokens():
    class Tok:
        def encode(self, text, add_special_tokens=True):
            return [1, len(text)] if add_special_tokens else [len(text)]
    req = api_pb2.EmbedRequest(input=[api_pb2.EmbedInput(text="abc")], request_id="x")
    prepared = prepare_embed(req, Tok(), POOLING)
    assert (prepared.request_id, prepared.prompts) == ("x", [[1, 3]])
