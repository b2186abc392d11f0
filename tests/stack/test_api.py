"""The public API through the whole stack: streaming text, stop strings, cancellation, bad input."""

from __future__ import annotations

import time

import grpc
import pytest
from pagedserve_client import Client

from services.router.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _sample(address: str, seed: int, **kw):
    with Client(address) as c:
        deltas = list(c.stream(prompt_token_ids=[5, 6, 7, 8], temperature=1.0, seed=seed,
                               max_tokens=kw.pop("max_tokens", 40), ignore_eos=True, **kw))
    return deltas


def test_streamed_text_equals_decoded_text_with_multibyte(tiny, tokenizer):
    found_multibyte = False
    for seed in range(12):
        deltas = _sample(tiny.address, seed)
        ids = [t for d in deltas for t in d.token_ids]
        streamed = "".join(d.text for d in deltas)
        assert len(ids) == 40 and deltas[-1].finish_reason == "length"
        assert streamed == tokenizer.decode(ids, skip_special_tokens=True)
        assert all("\ufffd" not in d.text or "\ufffd" in streamed for d in deltas)
        found_multibyte |= any(ord(ch) > 127 for ch in streamed)
    assert found_multibyte, "no multi-byte character in 12 sampled outputs; test proves nothing"


def test_same_seed_same_output(tiny):
    a = [t for d in _sample(tiny.address, 123) for t in d.token_ids]
    b = [t for d in _sample(tiny.address, 123) for t in d.token_ids]
    assert a == b


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tiny, tokenizer, include):
    deltas = _sample(tiny.address, 7, max_tokens=60)
    full = "".join(d.text for d in deltas)
    ids = [t for d in deltas for t in d.token_ids]
    # a stop string made of the text of tokens 10..12, so it spans several tokens
    start = len(tokenizer.decode(ids[:10], skip_special_tokens=True))
    stop = full[start:start + 8]
    assert len(stop) == 8 and stop.strip(), "sampled text too short for this test"
    first = full.find(stop)
    stopped = _sample(tiny.address, 7, max_tokens=60, stop=[stop],
                      include_stop_str_in_output=include)
    text = "".join(d.text for d in stopped)
    assert text == (full[:first + len(stop)] if include else full[:first])
    assert stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason == stop
    # no streamed prefix may show a part of the stop string that is later cut
    shown = ""
    for d in stopped[:-1]:
        shown += d.text
        assert full[:first].startswith(shown) or include


def test_cancelled_stream_aborts_and_frees_blocks(tiny):
    with Client(tiny.address) as c:
        stream = c.stream(prompt_token_ids=list(range(3, 40)), max_tokens=800, ignore_eos=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()  # cancels the RPC
    t0 = time.monotonic()
    s = tiny.wait_idle(timeout=5)
    assert s.num_running == 0, "cancelled request still running"
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_bad_sampling_params_are_invalid_argument(tiny, kwargs, field):
    with Client(tiny.address) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate(prompt_token_ids=[5, 6, 7], **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    # the stack keeps serving
    with Client(tiny.address) as c:
        assert c.generate(prompt_token_ids=[5, 6, 7], max_tokens=2).usage.completion_tokens == 2


def test_empty_prompt_is_invalid_argument(tiny):
    with Client(tiny.address) as c:
        for kw in (dict(prompt=""), dict(prompt_token_ids=[])):
            with pytest.raises(grpc.RpcError) as err:
                c.generate(**kw, max_tokens=2)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "prompt" in err.value.details()


def test_too_long_prompt_names_both_lengths(tiny):
    max_len = tiny.info().max_model_len
    with Client(tiny.address) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate(prompt_token_ids=[5] * (max_len + 10), max_tokens=2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(max_len + 10) in err.value.details() and str(max_len) in err.value.details()
    with Client(tiny.address) as c:
        assert c.generate(prompt_token_ids=[5, 6], max_tokens=1).finish_reason == "length"


def test_usage_and_text_prompt(tiny, tokenizer):
    with Client(tiny.address) as c:
        r = c.generate(prompt="Hello there", temperature=0, max_tokens=5, ignore_eos=True)
    assert r.usage.prompt_tokens == len(tokenizer("Hello there")["input_ids"])
    assert r.usage.completion_tokens == 5 == len(r.token_ids)


def test_duplicate_running_request_id_is_refused_and_the_first_goes_on(tiny):
    with Client(tiny.address, timeout=30) as c:
        first = c.stream(prompt_token_ids=[5, 6, 7], max_tokens=40, ignore_eos=True,
                         request_id="dup")
        head = next(first)
        with pytest.raises(grpc.RpcError) as err:
            c.generate(prompt_token_ids=[5, 6, 7], max_tokens=2, request_id="dup")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "already running" in err.value.details()
        rest = list(first)
    assert rest[-1].finish_reason == "length"
    assert len(head.token_ids) + sum(len(d.token_ids) for d in rest) == 40
