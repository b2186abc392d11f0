"""Chat's mapping onto Generate, Tokenize's add_special_tokens semantics, Detokenize's id checks
and ListModels, without gRPC (``services.router.text_api``); the servicer's status mapping."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2
from services.router import text_api
from services.router.generation import prepare
from services.router.server import GenerationServicer
from services.router.validation import RequestError
from tests.router import tiny_bos_tokenizer, tiny_sentencepiece_tokenizer

INFO = engine_pb2.GetEngineInfoResponse(model="tiny", max_model_len=64, vocab_size=12,
                                        dtype="float32", eos_token_ids=[2])
CHAT = api_pb2.ChatMessages(messages=[api_pb2.ChatMessage(role="user", content="hello")])


def tokenize(**kw) -> list[int]:
    return list(text_api.tokenize(api_pb2.TokenizeRequest(**kw), tiny_bos_tokenizer(),
                                  INFO).token_ids)


def test_tokenize_defaults_are_what_generate_sends():
    tok = tiny_bos_tokenizer()
    for kw in (dict(prompt="hello world"), dict(chat=CHAT)):
        sent = prepare(api_pb2.GenerateRequest(**kw), tok, INFO).prompt_token_ids
        assert tokenize(**kw) == sent
    assert tokenize(prompt="hello world") == [1, 3, 4]  # the post-processor's BOS
    assert tokenize(chat=CHAT) == [1, 5, 3, 6]  # the template's BOS, not doubled


def test_add_special_tokens_and_generation_prompt():
    assert tokenize(prompt="hello world", add_special_tokens=False) == [3, 4]
    assert tokenize(chat=CHAT, add_special_tokens=True) == [1, 1, 5, 3, 6]  # as asked
    assert tokenize(chat=CHAT, add_generation_prompt=False) == [1, 5, 3]
    r = text_api.tokenize(api_pb2.TokenizeRequest(prompt="hi hi hi"), tiny_bos_tokenizer(), INFO)
    assert (r.count, r.max_model_len) == (4, 64)


@pytest.mark.parametrize("request_, field", [
    (api_pb2.TokenizeRequest(), "prompt"),
    (api_pb2.TokenizeRequest(prompt=""), "prompt"),
    (api_pb2.TokenizeRequest(chat=api_pb2.ChatMessages()), "chat.messages"),
])
def test_tokenize_errors_name_the_field(request_, field):
    with pytest.raises(RequestError) as err:
        text_api.tokenize(request_, tiny_bos_tokenizer(), INFO)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.message


def test_tokenize_chat_without_template_is_invalid():
    with pytest.raises(RequestError, match="no chat template"):
        text_api.tokenize(api_pb2.TokenizeRequest(chat=CHAT), tiny_sentencepiece_tokenizer(),
                          INFO)


def test_detokenize_checks_ids_against_vocab_size():
    tok = tiny_bos_tokenizer()

    def detok(ids, **kw):
        return text_api.detokenize(api_pb2.DetokenizeRequest(token_ids=ids, **kw), tok,
                                   INFO).text

    assert detok([1, 3, 4]) == "hello world"
    assert detok([1, 3, 4], skip_special_tokens=False) == "<s> hello world"
    assert detok([]) == ""
    for ids, msg in (([3, 12], "token_ids[1] must be in [0, 12), got 12"),
                     ([-5], "token_ids[0] must be in [0, 12), got -5")):
        with pytest.raises(RequestError) as err:
            detok(ids)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.message == msg
    assert detok([3, 10, 11]) == "hello"  # in the model's (padded) vocab, not the tokenizer's


def test_chat_to_generate_copies_everything():
    req = api_pb2.ChatRequest(messages=CHAT.messages, request_id="r1", priority=3,
                              sampling_params=api_pb2.SamplingParams(max_tokens=7, n=2))
    gen = text_api.chat_to_generate(req)
    assert gen.WhichOneof("input") == "chat" and gen.chat == CHAT
    assert (gen.request_id, gen.priority, gen.sampling_params.max_tokens,
            gen.sampling_params.n) == ("r1", 3, 7, 2)
    with pytest.raises(RequestError, match="messages is empty"):
        text_api.chat_to_generate(api_pb2.ChatRequest())


def test_list_models_from_engine_info():
    (m,) = text_api.list_models(INFO).models
    assert (m.id, m.max_model_len, m.vocab_size, m.dtype, list(m.eos_token_ids)) == (
        "tiny", 64, 12, "float32", [2])


class _Aborted(Exception):
    pass


class _Context:
    """The part of grpc.aio's ServicerContext the servicer uses: abort raises."""

    async def abort(self, code, details):
        self.code, self.details = code, details
        raise _Aborted


@pytest.mark.parametrize("method, request_", [
    ("Tokenize", api_pb2.TokenizeRequest(prompt="hello")),
    ("Detokenize", api_pb2.DetokenizeRequest(token_ids=[3])),
    ("ListModels", api_pb2.ListModelsRequest()),
])
def test_servicer_is_unavailable_before_the_engine_info(method, request_):
    context = _Context()
    servicer = GenerationServicer(SimpleNamespace(info=None), tiny_bos_tokenizer())
    with pytest.raises(_Aborted):
        asyncio.run(getattr(servicer, method)(request_, context))
    assert context.code == grpc.StatusCode.UNAVAILABLE
    servicer.engine.info = INFO
    assert asyncio.run(getattr(servicer, method)(request_, context)).ByteSize() > 0


def test_servicer_maps_request_errors_to_their_status():
    context = _Context()
    servicer = GenerationServicer(SimpleNamespace(info=INFO), tiny_bos_tokenizer())
    with pytest.raises(_Aborted):
        asyncio.run(servicer.Detokenize(api_pb2.DetokenizeRequest(token_ids=[99]), context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and "token_ids[0]" in context.details


def test_a_template_refusal_names_messages_over_http():
    """The template's own refusal (role order, raise_exception) is about the messages:
    ``param`` "messages" (it named no field while the param was read from the message)."""
    from services.router.openai.requests import from_error

    tok = tiny_bos_tokenizer()  # (shared: its template is put back)
    template, tok.chat_template = tok.chat_template, "{{ raise_exception('no') }}"
    try:
        with pytest.raises(RequestError, match="chat template rejected the messages") as err:
            text_api.tokenize(api_pb2.TokenizeRequest(chat=CHAT), tok, INFO)
    finally:
        tok.chat_template = template
    assert err.value.param == "messages"
    assert from_error(err.value, prompt_param="messages").param == "messages"
    assert from_error(err.value, prompt_param="input").param == "input"  # /v1/responses
