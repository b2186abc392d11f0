"""The OpenAI-compatible HTTP API through the whole stack, with the official ``openai`` client."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
from pagedserve_client import Client

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = dict(temperature=0, max_tokens=8)
# vLLM's extra fields go in extra_body with the openai client
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_name(tiny_stack):
    return tiny_stack.info().model


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_health_and_models(tiny, oai, model_name):
    assert _get(f"{tiny.http_url}/health")[0] == 200
    models = oai.models.list()
    assert [m.id for m in models.data] == [model_name]
    status, body = _get(f"{tiny.http_url}/v1/nope")
    assert status == 404 and json.loads(body)["error"]["type"] == "invalid_request_error"


def test_completion_matches_grpc_and_stream(tiny, oai, model_name):
    r = oai.completions.create(model=model_name, prompt=PROMPT, extra_body=NO_EOS, **GREEDY)
    with Client(tiny.address) as c:
        g = c.generate(prompt=PROMPT, ignore_eos=True, **GREEDY)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == model_name
    (choice,) = r.choices
    assert choice.text == g.text and choice.finish_reason == "length" and choice.index == 0
    assert r.usage.completion_tokens == len(g.token_ids) == 8
    assert r.usage.prompt_tokens == g.usage.prompt_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8

    chunks = list(oai.completions.create(model=model_name, prompt=PROMPT, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body=NO_EOS, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_matches_grpc_and_stream(tiny, oai, model_name):
    r = oai.chat.completions.create(model=model_name, messages=CHAT, extra_body=NO_EOS,
                                    **GREEDY)
    with Client(tiny.address) as c:
        g = c.generate(messages=CHAT, ignore_eos=True, **GREEDY)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == g.text
    assert r.usage.completion_tokens == len(g.token_ids) == 8
    assert r.usage.prompt_tokens == g.usage.prompt_tokens

    stream = oai.chat.completions.create(model=model_name, messages=CHAT, stream=True,
                                         stream_options={"include_usage": True},
                                         max_completion_tokens=8, temperature=0,
                                         extra_body=NO_EOS)
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_n_choices_and_summed_usage(oai, model_name):
    r = oai.completions.create(model=model_name, prompt=[5, 6, 7, 8], n=2, seed=3,
                               temperature=1.0, max_tokens=5, extra_body=NO_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 10
    chunks = list(oai.completions.create(model=model_name, prompt=[5, 6, 7, 8], n=2, seed=3,
                                         temperature=1.0, max_tokens=5, stream=True,
                                         extra_body=NO_EOS))
    for c in r.choices:  # the stream, regrouped by choice, gives the same texts
        assert "".join(k.choices[0].text for k in chunks if k.choices[0].index == c.index) \
            == c.text


def test_repeated_long_prompt_reports_cached_tokens(oai, model_name):
    prompt = list(range(100, 180))  # 80 tokens = 5 full blocks of 16
    first = oai.completions.create(model=model_name, prompt=prompt, max_tokens=2)
    again = oai.completions.create(model=model_name, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == 80
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_stop_string_and_extras(tiny, oai, model_name):
    full = oai.completions.create(model=model_name, prompt=PROMPT, extra_body=NO_EOS,
                                  **GREEDY).choices[0].text
    stop = full[3:6]
    assert stop.strip(), "greedy text too short for this test"
    r = oai.completions.create(model=model_name, prompt=PROMPT, stop=stop, **GREEDY,
                               extra_body={"ignore_eos": True, "top_k": 5, "priority": 0,
                                           "unknown_field": 1})
    assert r.choices[0].text == full[:full.find(stop)] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason == stop  # (vLLM's extra field)


def test_stop_token_ids_finish_gives_an_integer_stop_reason(tiny, oai, model_name):
    with Client(tiny.address) as c:
        full = c.generate(PROMPT, temperature=0, max_tokens=8, ignore_eos=True).token_ids
    stop = full[3]
    body = {"ignore_eos": True, "stop_token_ids": [stop]}
    r = oai.completions.create(model=model_name, prompt=PROMPT, extra_body=body, **GREEDY)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == stop
    assert r.usage.completion_tokens == full.index(stop) + 1
    chunks = list(oai.completions.create(model=model_name, prompt=PROMPT, extra_body=body,
                                         stream=True, **GREEDY))
    last = next(c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason)
    assert last.finish_reason == "stop" and last.stop_reason == stop
    r = oai.completions.create(model=model_name, prompt=PROMPT, extra_body=NO_EOS, **GREEDY)
    assert r.choices[0].finish_reason == "length" and r.choices[0].stop_reason is None


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=2.0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=21), "logprobs"),
    (dict(prompt=["a", ""]), "prompt"),  # a batch whose prompt[1] is empty
    (dict(prompt=""), "prompt"),
    (dict(extra_body={"temperature": "hot"}), "temperature"),
    (dict(extra_body={"temperature": 10**400}), "temperature"),
])
def test_bad_requests_are_400_naming_the_field(oai, model_name, kwargs, param):
    kwargs = {"prompt": PROMPT, "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model_name, **kwargs)
    assert err.value.status_code == 400 and err.value.param == param
    assert param in err.value.message


def test_chat_refusals(oai, model_name):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=model_name, messages=CHAT, logprobs=True,
                                    top_logprobs=21)
    assert err.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=model_name, messages=[], max_tokens=2)
    assert err.value.param == "messages"
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    assert err.value.code == "model_not_found"


def test_closed_stream_aborts_the_engine_request(tiny, oai, model_name):
    stream = oai.completions.create(model=model_name, prompt=list(range(3, 40)), stream=True,
                                    max_tokens=800, extra_body=NO_EOS)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert tiny.wait_idle(timeout=5).num_running == 0, "closed stream's request still running"


def test_client_gone_mid_request_aborts_the_engine_request(tiny, model_name):
    """A non-streaming request whose client times out (closes the connection) is aborted."""
    client = openai.OpenAI(base_url=f"{tiny.http_url}/v1", api_key="unused", max_retries=0,
                           timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model=model_name, prompt=list(range(3, 40)), max_tokens=800,
                                  extra_body=NO_EOS)
    client.close()
    assert tiny.wait_idle(timeout=5).num_running == 0, "abandoned request still running"
