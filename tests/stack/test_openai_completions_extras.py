"""logit_bias, echo, best_of and a batch of prompts through the whole tiny stack, with the
official ``openai`` client unchanged (token ids read back with the gRPC SDK)."""

from __future__ import annotations

import openai
import pytest
import requests
from pagedserve_client import Client
from transformers import AutoTokenizer

PROMPT = "The quick brown fox"
IDS = [5, 6, 7, 8, 9]
NO_EOS = {"ignore_eos": True}  # vLLM's extra: every choice runs to max_tokens
SAMPLED = dict(temperature=1.0, seed=7, max_tokens=6)


@pytest.fixture(scope="module")
def model(tiny_stack):
    return tiny_stack.info().model


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def grpc_client(tiny_stack):
    with Client(tiny_stack.address) as c:
        yield c


def _greedy_first(grpc_client, **sampling) -> int:
    return grpc_client.generate(prompt_token_ids=IDS, temperature=0, max_tokens=1,
                                **sampling).token_ids[0]


# ---- logit_bias -------------------------------------------------------------------------
def test_logit_bias_steers_greedy_and_logprobs_stay_raw(oai, model, grpc_client, tokenizer):
    first = _greedy_first(grpc_client)
    target = (first + 1234) % 49152
    r = oai.completions.create(model=model, prompt=IDS, temperature=0, max_tokens=1,
                               logprobs=1, logit_bias={str(target): 100})
    lp = r.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([target])]
    # the raw distribution (before the bias) still ranks the unbiased greedy token first
    assert list(lp.top_logprobs[0]) == [tokenizer.decode([first])]
    assert lp.token_logprobs[0] < lp.top_logprobs[0][tokenizer.decode([first])]
    r = oai.completions.create(model=model, prompt=IDS, temperature=0, max_tokens=1,
                               logprobs=0, logit_bias={str(first): -100})
    assert r.choices[0].logprobs.tokens != [tokenizer.decode([first])]
    chat = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       temperature=0, max_tokens=1, logprobs=True,
                                       logit_bias={str(target): 100})
    assert chat.choices[0].logprobs.content[0].token == tokenizer.decode([target])


@pytest.mark.parametrize("bias, words", [
    ({"49152": 1}, ["logit_bias", "49152"]),
    ({"-1": 1}, ["logit_bias", "-1"]),
    ({"5": 100.5}, ["logit_bias[5]", "100.5"]),
    ({"5": -1000}, ["logit_bias[5]", "-1000"]),
    ({"five": 1}, ["logit_bias", "five"]),
    ({"5": "high"}, ["logit_bias[5]", "high"]),
    ({str(i): 1 for i in range(1025)}, ["logit_bias", "1024"]),
])
def test_bad_logit_bias_is_400_and_the_server_keeps_serving(oai, model, bias, words):
    for create in (lambda: oai.completions.create(model=model, prompt=IDS, max_tokens=1,
                                                   logit_bias=bias),
                   lambda: oai.chat.completions.create(
                       model=model, messages=[{"role": "user", "content": "hi"}],
                       max_tokens=1, logit_bias=bias)):
        with pytest.raises(openai.BadRequestError) as err:
            create()
        assert err.value.param == "logit_bias"
        assert all(w in err.value.message for w in words), err.value.message
    assert oai.completions.create(model=model, prompt=IDS, max_tokens=1).choices[0].text


# ---- echo -------------------------------------------------------------------------------
def test_echo_prepends_the_prompt(oai, model, tokenizer):
    plain = oai.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=5,
                                   extra_body=NO_EOS).choices[0].text
    r = oai.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=5,
                               echo=True, extra_body=NO_EOS)
    assert r.choices[0].text == PROMPT + plain and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == 5
    ids_plain = oai.completions.create(model=model, prompt=IDS, temperature=0, max_tokens=3,
                                       extra_body=NO_EOS).choices[0].text
    r = oai.completions.create(model=model, prompt=IDS, temperature=0, max_tokens=3, echo=True,
                               extra_body=NO_EOS)
    assert r.choices[0].text == tokenizer.decode(IDS) + ids_plain


def test_echo_with_logprobs_puts_the_prompt_tokens_first(oai, model, grpc_client, tokenizer):
    k = 2
    plain = oai.completions.create(model=model, prompt=IDS, temperature=0, max_tokens=4,
                                   logprobs=k, extra_body=NO_EOS).choices[0]
    r = oai.completions.create(model=model, prompt=IDS, temperature=0, max_tokens=4,
                               logprobs=k, echo=True, extra_body=NO_EOS)
    (c,) = r.choices
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) \
        == len(lp.text_offset) == len(IDS) + 4
    assert lp.tokens[:len(IDS)] == [tokenizer.decode([t]) for t in IDS]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # OpenAI's
    # the prompt's logprobs are the engine's prompt_logprobs (as the gRPC API gives them)
    g = grpc_client.generate(prompt_token_ids=IDS, temperature=0, max_tokens=1,
                             prompt_logprobs=k)
    assert lp.token_logprobs[1:len(IDS)] == pytest.approx([t.logprob for t in g.prompt_logprobs])
    assert all(len(top) == k for top in lp.top_logprobs[1:])
    # the output part is the plain request's, offsets running on after the prompt
    assert lp.tokens[len(IDS):] == plain.logprobs.tokens
    assert lp.token_logprobs[len(IDS):] == pytest.approx(plain.logprobs.token_logprobs)
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets
    assert c.text == tokenizer.decode(IDS) + plain.text
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens == len(IDS)


def test_echo_with_max_tokens_0_scores_the_prompt(oai, model):
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    (c,) = r.choices
    assert c.text == PROMPT and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == r.usage.prompt_tokens and c.logprobs.token_logprobs[0] is None
    assert r.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as err:  # without echo there is nothing to return
        oai.completions.create(model=model, prompt=PROMPT, max_tokens=0)
    assert err.value.param == "max_tokens"


def test_streamed_echo_equals_the_whole_response(oai, model):
    kwargs = dict(model=model, prompt=PROMPT, n=2, echo=True, logprobs=1, extra_body=NO_EOS,
                  **SAMPLED)
    whole = oai.completions.create(**kwargs)
    chunks = [c for c in oai.completions.create(stream=True, **kwargs) if c.choices]
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert mine[0].text.startswith(PROMPT)  # the prompt comes in the choice's first chunk
        assert "".join(m.text for m in mine) == choice.text
        assert [t for m in mine if m.logprobs for t in m.logprobs.tokens] \
            == choice.logprobs.tokens


# ---- best_of ----------------------------------------------------------------------------
def _score(choice) -> float:
    return sum(choice.logprobs.token_logprobs)


def test_best_of_returns_the_n_best_candidates(oai, model):
    kwargs = dict(model=model, prompt=PROMPT, extra_body=NO_EOS, **SAMPLED)
    # the same seeded candidates (choice i samples with seed + i), all returned with logprobs
    every = oai.completions.create(n=4, logprobs=0, **kwargs).choices
    ranked = sorted(every, key=_score, reverse=True)
    assert len({c.text for c in every}) > 1, "candidates too alike for this test"
    r = oai.completions.create(n=2, best_of=4, **kwargs)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [c.text for c in ranked[:2]]
    assert all(c.logprobs is None for c in r.choices)  # not asked for
    assert r.usage.completion_tokens == 4 * 6  # every candidate is billed
    with_lp = oai.completions.create(n=1, best_of=4, logprobs=1, **kwargs).choices
    assert [c.text for c in with_lp] == [ranked[0].text]
    assert _score(with_lp[0]) == pytest.approx(_score(ranked[0]))


def test_best_of_refusals(oai, model):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model, prompt=PROMPT, max_tokens=2, best_of=3, stream=True)
    assert err.value.param == "best_of" and "stream" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model, prompt=PROMPT, max_tokens=2, n=3, best_of=2)
    assert err.value.param == "best_of"


# ---- a batch of prompts -----------------------------------------------------------------
@pytest.mark.parametrize("prompts", [["Hello there", PROMPT], [IDS, [11, 12]]])
def test_batch_of_prompts(oai, model, prompts):
    kwargs = dict(model=model, n=2, extra_body=NO_EOS, **SAMPLED)
    singles = [oai.completions.create(prompt=p, **kwargs) for p in prompts]
    r = oai.completions.create(prompt=prompts, **kwargs)
    assert [c.index for c in r.choices] == list(range(2 * len(prompts)))
    for p, single in enumerate(singles):  # index = prompt * n + choice, each as run alone
        assert [c.text for c in r.choices[2 * p:2 * p + 2]] == [c.text for c in single.choices]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == len(prompts) * 2 * 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(oai.completions.create(prompt=prompts, stream=True,
                                         stream_options={"include_usage": True}, **kwargs))
    assert chunks[-1].usage.model_dump() == r.usage.model_dump()
    assert len({k.id for k in chunks}) == 1  # one response, whichever prompt a chunk is of
    for c in r.choices:
        assert "".join(k.choices[0].text for k in chunks[:-1] if k.choices[0].index == c.index) \
            == c.text


def test_a_bad_prompt_in_a_batch_is_400_naming_it(tiny, oai, model):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model, prompt=[IDS, [1, 49152]], max_tokens=2)
    assert err.value.param == "prompt" and err.value.body["message"].startswith("prompt[1]: ")
    r = requests.post(f"{tiny.http_url}/v1/completions", timeout=30,
                      json={"prompt": ["ok", ""], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt[1]")


def test_a_batch_is_one_response_named_by_its_request_id(tiny):
    r = requests.post(f"{tiny.http_url}/v1/completions", timeout=30,
                      json={"prompt": ["a", "b"], "max_tokens": 1})
    assert r.status_code == 200 and r.json()["id"] == r.headers["X-Request-Id"]
    assert r.json()["id"].startswith("cmpl-") and len(r.json()["choices"]) == 2
