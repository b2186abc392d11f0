"""Logprobs through the whole stack (tiny float32 Llama): against transformers' log_softmax,
with n > 1 and stop strings, through the OpenAI client; and sampling edge cases that logprobs
tests lean on (top_k=1, tiny temperatures, seeds in any batch mix)."""

from __future__ import annotations

import asyncio
import math

import grpc
import openai
import pytest
from pagedserve_client import AsyncClient, Client

PROMPT_IDS = [1, 17, 42, 99, 7, 300, 12]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_logprobs(model, ids: list[int]):
    """log_softmax of transformers' float32 logits at the last position of ``ids``: ``[V]``."""
    import torch
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


def check_against_hf(model, prompt: list[int], token_ids: list[int], logprobs, k: int):
    assert len(logprobs) == len(token_ids)
    for i, (t, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        ref = hf_logprobs(model, prompt + token_ids[:i])
        assert lp.token_id == t
        assert abs(lp.logprob - ref[t].item()) < 1e-4
        assert len(lp.top) == k
        assert [x.token_id for x in lp.top] == ref.topk(k).indices.tolist()
        for x in lp.top:
            assert abs(x.logprob - ref[x.token_id].item()) < 1e-4


@pytest.mark.parametrize("sampling", [dict(temperature=0.0),
                                      dict(temperature=0.8, top_p=0.9, seed=3,
                                           repetition_penalty=1.3)])
def test_logprobs_equal_transformers(tiny, hf_model, sampling):
    with Client(tiny.address) as c:
        r = c.generate(prompt_token_ids=PROMPT_IDS, max_tokens=MAX_TOKENS, ignore_eos=True,
                       logprobs=5, **sampling)
    assert len(r.token_ids) == MAX_TOKENS
    # raw distribution: independent of temperature / penalties / top-p
    check_against_hf(hf_model, PROMPT_IDS, r.token_ids, r.logprobs, 5)


def test_logprobs_zero_and_unset_and_n(tiny, hf_model):
    with Client(tiny.address) as c:
        zero = c.generate(prompt_token_ids=PROMPT_IDS, max_tokens=3, ignore_eos=True,
                          temperature=0, logprobs=0)
        none = c.generate(prompt_token_ids=PROMPT_IDS, max_tokens=3, ignore_eos=True,
                          temperature=0)
        many = c.generate(prompt_token_ids=PROMPT_IDS, max_tokens=4, ignore_eos=True,
                          temperature=1.0, seed=11, n=3, logprobs=2)
    assert none.logprobs is None and none.token_ids == zero.token_ids
    check_against_hf(hf_model, PROMPT_IDS, zero.token_ids, zero.logprobs, 0)
    for choice in many.choices:
        check_against_hf(hf_model, PROMPT_IDS, choice.token_ids, choice.logprobs, 2)


def test_logprobs_stay_aligned_at_a_stop_string(tiny):
    with Client(tiny.address) as c:
        full = c.generate(prompt_token_ids=PROMPT_IDS, max_tokens=12, ignore_eos=True,
                          temperature=0, logprobs=1)
        stop = full.text[len(full.text) // 2:][:3]
        if not stop.strip():
            pytest.skip("greedy text of the tiny model has no usable stop string")
        cut = c.generate(prompt_token_ids=PROMPT_IDS, max_tokens=12, ignore_eos=True,
                         temperature=0, logprobs=1, stop=[stop])
    assert cut.finish_reason == "stop"
    assert [lp.token_id for lp in cut.logprobs] == cut.token_ids
    assert cut.logprobs == full.logprobs[:len(cut.token_ids)]


def test_logprobs_validation(tiny):
    with Client(tiny.address) as c:
        for bad, field in ((dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"),
                           (dict(prompt_logprobs=21), "prompt_logprobs")):
            with pytest.raises(grpc.RpcError) as e:
                c.generate(prompt_token_ids=PROMPT_IDS, max_tokens=2, **bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in e.value.details()


def check_prompt_against_hf(model, prompt: list[int], prompt_logprobs, k: int):
    """Prompt token i (1 <= i < P): logprob given prompt[:i], from one transformers forward."""
    import torch
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert [x.token_id for x in prompt_logprobs] == prompt[1:]
    for i, x in enumerate(prompt_logprobs, start=1):
        assert abs(x.logprob - ref[i - 1, prompt[i]].item()) < 1e-4
        assert [t.token_id for t in x.top] == ref[i - 1].topk(k).indices.tolist()


def test_prompt_logprobs_equal_transformers_across_chunks_and_cache_hits(tiny, hf_model):
    """A 300-token prompt takes two prefill chunks (256-token budget); the repeat would hit
    the prefix cache, which a prompt_logprobs request skips."""
    long_prompt = [(7 * i + 3) % 500 + 1 for i in range(300)]
    with Client(tiny.address) as c:
        for prompt in (PROMPT_IDS, long_prompt, long_prompt):
            r = c.generate(prompt_token_ids=prompt, max_tokens=2, temperature=0,
                           ignore_eos=True, prompt_logprobs=3, logprobs=1)
            check_prompt_against_hf(hf_model, prompt, r.prompt_logprobs, 3)
            check_against_hf(hf_model, prompt, r.token_ids, r.logprobs, 1)
        many = c.generate(prompt_token_ids=PROMPT_IDS, max_tokens=2, temperature=1.0, n=3,
                          ignore_eos=True, prompt_logprobs=0)
        plain = c.generate(prompt_token_ids=PROMPT_IDS, max_tokens=2, ignore_eos=True)
    for choice in many.choices:
        check_prompt_against_hf(hf_model, PROMPT_IDS, choice.prompt_logprobs, 0)
    assert plain.prompt_logprobs is None


@pytest.mark.parametrize("temperature", [0.5, 1.0, 5.0])
def test_top_k_1_is_greedy_at_any_temperature(tiny, temperature):
    with Client(tiny.address) as c:
        greedy = c.generate(prompt_token_ids=PROMPT_IDS, max_tokens=MAX_TOKENS, temperature=0,
                            ignore_eos=True)
        top1 = c.generate(prompt_token_ids=PROMPT_IDS, max_tokens=MAX_TOKENS, top_k=1,
                          temperature=temperature, ignore_eos=True)
    assert top1.token_ids == greedy.token_ids


def test_tiny_temperatures_are_greedy(tiny):
    with Client(tiny.address) as c:
        greedy = c.generate(prompt_token_ids=PROMPT_IDS, max_tokens=MAX_TOKENS, temperature=0,
                            ignore_eos=True, logprobs=1)
        for t in (1e-2, 1e-4, 1e-6, 1e-8):
            r = c.generate(prompt_token_ids=PROMPT_IDS, max_tokens=MAX_TOKENS, temperature=t,
                           ignore_eos=True, logprobs=1)
            assert r.token_ids == greedy.token_ids, t
            assert all(math.isfinite(lp.logprob) for lp in r.logprobs)


def test_seeded_request_is_independent_of_the_batch(tiny):
    seeded = dict(prompt_token_ids=PROMPT_IDS, max_tokens=8, temperature=1.0, seed=1234,
                  ignore_eos=True)

    async def run(mix: list[dict]) -> list[int]:
        async with AsyncClient(tiny.address) as c:
            results = await asyncio.gather(c.generate(**seeded),
                                           *(c.generate(**m) for m in mix))
        return results[0].token_ids

    others = [dict(prompt_token_ids=[5, 6, 7, 8 + i], max_tokens=6 + i, temperature=1.0,
                   ignore_eos=True) for i in range(4)]
    alone = asyncio.run(run([]))
    assert asyncio.run(run(others)) == alone
    assert asyncio.run(run(others[:2] + [dict(prompt_token_ids=PROMPT_IDS * 3, max_tokens=3,
                                              temperature=0.7, seed=9, ignore_eos=True)])) == alone
    assert asyncio.run(run([dict(o, logprobs=3) for o in others[1:]])) == alone


# ---- OpenAI HTTP ------------------------------------------------------------------------------

def _tok(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def test_openai_completion_logprobs_equal_grpc(tiny, oai, tiny_model_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = "The quick brown fox"
    with Client(tiny.address) as c:
        g = c.generate(prompt=prompt, max_tokens=5, temperature=0, ignore_eos=True, logprobs=3)
    r = oai.completions.create(model="", prompt=prompt, max_tokens=5, temperature=0,
                               logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == [_tok(tokenizer, t) for t in g.token_ids]
    assert lp.token_logprobs == pytest.approx([x.logprob for x in g.logprobs], abs=1e-6)
    assert lp.text_offset[0] == 0 and len(lp.text_offset) == 5
    for top, ref in zip(lp.top_logprobs, g.logprobs, strict=True):
        assert len(top) == 3
        for x in ref.top:
            assert top[_tok(tokenizer, x.token_id)] == pytest.approx(x.logprob, abs=1e-6)

    chunks = list(oai.completions.create(model="", prompt=prompt, max_tokens=5, temperature=0,
                                         logprobs=3, stream=True,
                                         extra_body={"ignore_eos": True}))
    streamed = [x for ch in chunks for c in ch.choices if c.logprobs
                for x in c.logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_openai_chat_logprobs_equal_grpc(tiny, oai, tiny_model_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": "Hello there"}]
    with Client(tiny.address) as c:
        g = c.generate(messages=messages, max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    r = oai.chat.completions.create(model="", messages=messages, max_tokens=5, temperature=0,
                                    logprobs=True, top_logprobs=2,
                                    extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [_tok(tokenizer, t) for t in g.token_ids]
    assert [c.logprob for c in content] == pytest.approx([x.logprob for x in g.logprobs],
                                                         abs=1e-6)
    for c, ref in zip(content, g.logprobs, strict=True):
        assert c.bytes == list(c.token.encode())
        assert [t.token for t in c.top_logprobs] == [_tok(tokenizer, x.token_id)
                                                     for x in ref.top]
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(
            [x.logprob for x in ref.top], abs=1e-6)

    stream = list(oai.chat.completions.create(model="", messages=messages, max_tokens=5,
                                              temperature=0, logprobs=True, stream=True,
                                              extra_body={"ignore_eos": True}))
    streamed = [x for ch in stream for c in ch.choices if c.logprobs and c.logprobs.content
                for x in c.logprobs.content]
    assert [x.logprob for x in streamed] == pytest.approx([c.logprob for c in content],
                                                          abs=1e-6)
    assert all(x.top_logprobs == [] for x in streamed)

    plain = oai.chat.completions.create(model="", messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="", messages=messages, max_tokens=2, top_logprobs=2)
