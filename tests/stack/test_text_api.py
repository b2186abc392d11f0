"""The public RPCs around Generate through the whole stack: Chat, Tokenize, Detokenize and
ListModels, against transformers' tokenizer and against Generate itself."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from pagedserve_client import AsyncClient, Client

TEXTS = ["Hello there, how are you?", "  leading spaces and tabs\tand\nnewlines  ",
         "Ünïcödé — 東京 🙂 and emoji", "<|im_start|>user\nspecial strings<|im_end|>"]
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_then_detokenize_equals_transformers(tiny, hf_tokenizer, text):
    with Client(tiny.address, timeout=30) as c:
        tok = c.tokenize(text)
        assert tok.token_ids == hf_tokenizer.encode(text)  # add_special_tokens=True default
        assert tok.count == len(tok.token_ids)
        assert tok.max_model_len == tiny.info().max_model_len
        for skip in (True, False):
            assert c.detokenize(tok.token_ids, skip_special_tokens=skip) == \
                hf_tokenizer.decode(tok.token_ids, skip_special_tokens=skip)
        assert c.detokenize(tok.token_ids) == hf_tokenizer.decode(tok.token_ids,
                                                                  skip_special_tokens=True)
        if "<|im_end|>" not in text:
            assert c.detokenize(tok.token_ids) == text  # SmolLM2's byte-level BPE round-trips


def test_tokenize_count_is_generate_prompt_tokens(tiny):
    with Client(tiny.address, timeout=30) as c:
        for kw in (dict(prompt=TEXTS[0]), dict(messages=MESSAGES)):
            tok = c.tokenize(**kw)
            r = c.generate(**kw, max_tokens=1)
            assert tok.count == r.usage.prompt_tokens


def test_tokenize_chat_options_match_the_chat_template(tiny, hf_tokenizer):
    with Client(tiny.address, timeout=30) as c:
        default = c.tokenize(messages=MESSAGES).token_ids
        bare = c.tokenize(messages=MESSAGES, add_generation_prompt=False).token_ids
        special = c.tokenize(messages=MESSAGES, add_special_tokens=True).token_ids
    rendered = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                add_generation_prompt=True)
    assert default == hf_tokenizer.encode(rendered, add_special_tokens=False)
    rendered_bare = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                     add_generation_prompt=False)
    assert bare == hf_tokenizer.encode(rendered_bare, add_special_tokens=False)
    assert len(bare) < len(default) and default[:len(bare)] == bare
    assert special == hf_tokenizer.encode(rendered, add_special_tokens=True)


def test_chat_equals_generate_with_chat_input(tiny):
    with Client(tiny.address, timeout=60) as c:
        chat = c.chat(MESSAGES, temperature=0, max_tokens=12, ignore_eos=True)
        gen = c.generate(messages=MESSAGES, temperature=0, max_tokens=12, ignore_eos=True)
        sampled = c.chat(MESSAGES, n=2, seed=5, max_tokens=8, ignore_eos=True)
        sampled_gen = c.generate(messages=MESSAGES, n=2, seed=5, max_tokens=8, ignore_eos=True)
        deltas = list(c.chat_stream(MESSAGES, temperature=0, max_tokens=12, ignore_eos=True,
                                    request_id="chat-1"))
    assert chat.token_ids == gen.token_ids and len(chat.token_ids) == 12
    assert chat.text == gen.text and chat.usage == gen.usage and chat.finish_reason == "length"
    assert [ch.token_ids for ch in sampled.choices] == [ch.token_ids for ch in
                                                        sampled_gen.choices]
    assert [t for d in deltas for t in d.token_ids] == gen.token_ids
    assert {d.request_id for d in deltas} == {"chat-1"}
    assert deltas[-1].finish_reason == "length" and deltas[-1].usage == gen.usage


def test_async_client_text_calls(tiny):
    async def go():
        async with AsyncClient(tiny.address, timeout=60) as c:
            models = await c.list_models()
            tok = await c.tokenize(TEXTS[0])
            text = await c.detokenize(tok.token_ids)
            chat = await c.chat(MESSAGES, temperature=0, max_tokens=4, ignore_eos=True)
            gen = await c.generate(messages=MESSAGES, temperature=0, max_tokens=4,
                                   ignore_eos=True)
            return models, text, chat, gen

    models, text, chat, gen = asyncio.run(go())
    assert models[0].id == tiny.info().model and text == TEXTS[0]
    assert chat.token_ids == gen.token_ids


def test_list_models_describes_the_engine(tiny):
    info = tiny.info()
    with Client(tiny.address, timeout=30) as c:
        models = c.list_models()
    assert len(models) == 1
    m = models[0]
    assert (m.id, m.max_model_len, m.vocab_size, m.dtype) == (
        info.model, info.max_model_len, info.vocab_size, info.dtype)
    assert m.id and m.dtype == "float32" and m.vocab_size > 0
    assert m.eos_token_ids == list(info.eos_token_ids)


@pytest.mark.parametrize("call, field", [
    (lambda c: c.tokenize(""), "prompt"),
    (lambda c: c.tokenize(messages=[]), "chat.messages"),
    (lambda c: c.detokenize([5, -1]), "token_ids[1]"),
    (lambda c: c.detokenize([5, 6, 10**9]), "token_ids[2]"),
    (lambda c: c.chat([], max_tokens=2), "messages"),
    (lambda c: c.chat(MESSAGES, max_tokens=0), "max_tokens"),
    (lambda c: c.chat(MESSAGES, top_p=2.0), "top_p"),
])
def test_bad_requests_are_invalid_argument_naming_the_field(tiny, call, field):
    with Client(tiny.address, timeout=30) as c:
        with pytest.raises(grpc.RpcError) as err:
            call(c)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert field in err.value.details()
        assert c.detokenize([]) == ""  # the router keeps serving


def test_detokenize_message_names_the_vocab_size(tiny):
    vocab = tiny.info().vocab_size
    with Client(tiny.address, timeout=30) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.detokenize([vocab])
    assert f"[0, {vocab})" in err.value.details() and str(vocab) in err.value.details()


def test_large_tokenize_runs_off_the_loop_and_matches(tiny, hf_tokenizer):
    text = "The quick brown fox jumps over the lazy dog. " * 500  # > 16 KiB: on a thread
    with Client(tiny.address, timeout=60) as c:
        tok = c.tokenize(text)
        assert tok.token_ids == hf_tokenizer.encode(text) and tok.count > tok.max_model_len
        assert c.detokenize(tok.token_ids) == text


def test_cancelled_chat_stream_aborts_and_frees_blocks(tiny):
    with Client(tiny.address, timeout=60) as c:
        stream = c.chat_stream(MESSAGES, max_tokens=800, ignore_eos=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()  # cancels the RPC
    assert tiny.wait_idle(timeout=5).num_running == 0, "cancelled chat still running"
