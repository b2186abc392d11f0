"""Bad input, fuzzed (hypothesis) through the whole in-process stack: the public gRPC API and the
OpenAI-compatible HTTP API.

The only outcomes allowed: success, or gRPC INVALID_ARGUMENT / OUT_OF_RANGE / RESOURCE_EXHAUSTED,
or an HTTP 4xx. Never INTERNAL / UNKNOWN / 5xx, never a hang; the stack keeps serving and leaks
no KV block afterwards (the ``tiny`` fixture's leak check runs after every test).

Deterministic (``derandomize=True``) and bounded (``max_examples``), so CI always runs the same
examples; ``PAGEDSERVE_FUZZ_EXAMPLES=500`` runs more (e.g. for a nightly job) — still
deterministic for a given count. docs/reliability.md ("Bad input") has the classes and results.
"""

from __future__ import annotations

import json
import math
import os
import struct

import grpc
import pytest
import requests
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from services.common.pb.pagedserve.v1 import api_pb2, api_pb2_grpc
from services.router.server import DEFAULT_MAX_REQUEST_BYTES

EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "0"))
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
TIMEOUT_S = 60  # per call; DEADLINE_EXCEEDED (a hang) fails the test
VOCAB = 49152  # the tiny model's (SmolLM2's) vocabulary
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
SERVICE = "/pagedserve.v1.GenerationService/"


def fuzz(n: int):
    """hypothesis settings: ``n`` examples (or $PAGEDSERVE_FUZZ_EXAMPLES), deterministic, no
    deadline (the first tokenization of a huge string may take a second)."""
    return settings(max_examples=EXAMPLES or n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])


# ---- strategies -------------------------------------------------------------------------
_SPECIAL_TEXT = st.one_of(
    st.sampled_from(["", "\x00", "<|im_start|>user\n<|im_end|>", "\U0010ffff\U0001f600",
                     "\u200b\u202e", "{{ raise_exception('x') }}", "{% for %}"]),
    # long runs (built lazily: hypothesis prints the strategies' reprs)
    st.tuples(st.sampled_from(["a", "\x00", " ", "\ufffd", "\U0001f600"]),
              st.sampled_from([1000, 5000, 200_000])).map(lambda t: t[0] * t[1]))
TEXT = st.one_of(st.text(max_size=200), _SPECIAL_TEXT)
# JSON can carry lone surrogates ("\ud800"); protobuf strings cannot (UTF-8 only)
TEXT_SURROGATES = st.one_of(TEXT, st.text(st.characters(exclude_categories=()), max_size=50))
_EDGE_FLOATS = [0.0, -0.0, 1.0, -1.0, 1e-45, 1e-30, 0.5, 2.0, 2.0000001, -2.0000001, 1e30, -1e30,
                3.4e38, -3.4e38, math.inf, -math.inf, math.nan]
FLOATS = st.one_of(st.sampled_from(_EDGE_FLOATS), st.floats(width=32))
_EDGE_INTS = [0, 1, -1, 2, 20, 21, 64, 65, 1023, 1024, 49151, 49152, INT32_MAX, INT32_MIN]
INT32 = st.one_of(st.sampled_from(_EDGE_INTS), st.integers(INT32_MIN, INT32_MAX))
TOKEN_IDS = st.lists(st.one_of(st.integers(0, VOCAB - 1), INT32), max_size=40)
STOP = st.one_of(st.lists(TEXT, max_size=20),
                 # thousands of stop strings (short ones: 5000 huge ones would not serialize)
                 st.builds(lambda k, s: [s] * k, st.sampled_from([17, 1000, 5000]),
                           st.text(max_size=20)))

SAMPLING_FIELDS = {
    "temperature": FLOATS, "top_p": FLOATS, "min_p": FLOATS, "repetition_penalty": FLOATS,
    "presence_penalty": FLOATS, "frequency_penalty": FLOATS, "top_k": INT32,
    "max_tokens": INT32, "min_tokens": INT32, "n": INT32, "logprobs": INT32,
    "prompt_logprobs": INT32, "seed": st.integers(0, 2**64 - 1), "stop": STOP,
    "stop_token_ids": TOKEN_IDS, "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
}
# mostly in range, so that the engine runs odd but valid combinations too
VALID_SAMPLING_FIELDS = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.1, 2), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "top_k": st.integers(-1, 100),
    "max_tokens": st.integers(1, 50), "n": st.integers(1, 8), "logprobs": st.integers(0, 20),
    "prompt_logprobs": st.integers(0, 5), "seed": st.integers(0, 2**64 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=10), max_size=16),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=10),
    "ignore_eos": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
}
SAMPLING = st.one_of(st.fixed_dictionaries({}, optional=SAMPLING_FIELDS),
                     st.fixed_dictionaries({}, optional=VALID_SAMPLING_FIELDS))
CHAT_MESSAGES = st.lists(st.builds(
    dict, role=st.one_of(st.sampled_from(["user", "system", "assistant", "tool", ""]), TEXT),
    content=TEXT), max_size=4)


def _sampling_pb(fields: dict) -> api_pb2.SamplingParams:
    sp = api_pb2.SamplingParams()
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(sp, name).extend(value)
        else:
            setattr(sp, name, value)
    return sp


# ---- gRPC helpers -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def channel(tiny_stack):
    # send limit above the server's receive limit, so oversized requests reach the server
    with grpc.insecure_channel(tiny_stack.address, options=[
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024)]) as ch:
        yield ch


def _outcome(call, read: int = 2) -> grpc.StatusCode:
    """The status of a server-streaming ``call``: read up to ``read`` messages, then cancel (a
    huge accepted max_tokens must not make the test wait for the whole generation)."""
    try:
        for i, _ in enumerate(call):
            if i + 1 >= read:
                call.cancel()
                return grpc.StatusCode.OK
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def _unary_outcome(fn, request) -> grpc.StatusCode:
    try:
        fn(request, timeout=TIMEOUT_S)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def _tally(outcome: str) -> None:
    """Count an outcome (pytest --hypothesis-show-statistics shows the counts)."""
    if currently_in_test_context():
        event(outcome)


def _check(code: grpc.StatusCode, what) -> None:
    _tally(code.name)
    assert code in ALLOWED, f"{code.name} for {what!r}"[:2000]


def _still_serves(channel) -> None:
    stub = api_pb2_grpc.GenerationServiceStub(channel)
    out = list(stub.Generate(api_pb2.GenerateRequest(
        prompt="Hello", sampling_params=api_pb2.SamplingParams(max_tokens=3, ignore_eos=True)),
        timeout=TIMEOUT_S))
    assert out[-1].finish_reason == api_pb2.FINISH_REASON_LENGTH
    assert sum(len(r.token_ids) for r in out) == 3


# ---- gRPC -------------------------------------------------------------------------------
@fuzz(50)
@given(input=st.one_of(st.builds(lambda t: ("prompt", t), TEXT),
                       st.builds(lambda ids: ("ids", ids), TOKEN_IDS),
                       st.builds(lambda m: ("chat", m), CHAT_MESSAGES),
                       st.just(("none", None))),
       sampling=SAMPLING, request_id=st.one_of(st.just(""), TEXT), priority=INT32)
def test_grpc_generate_fuzz(tiny, channel, input, sampling, request_id, priority):
    kind, value = input
    req = api_pb2.GenerateRequest(sampling_params=_sampling_pb(sampling),
                                  request_id=request_id, priority=priority)
    if kind == "prompt":
        req.prompt = value
    elif kind == "ids":
        req.prompt_token_ids.ids.extend(value)
    elif kind == "chat":
        req.chat.SetInParent()
        for m in value:
            req.chat.messages.add(**m)
    stub = api_pb2_grpc.GenerationServiceStub(channel)
    _check(_outcome(stub.Generate(req, timeout=TIMEOUT_S)), req)


@fuzz(30)
@given(messages=CHAT_MESSAGES, sampling=SAMPLING)
def test_grpc_chat_fuzz(tiny, channel, messages, sampling):
    req = api_pb2.ChatRequest(messages=[api_pb2.ChatMessage(**m) for m in messages],
                              sampling_params=_sampling_pb(sampling))
    stub = api_pb2_grpc.GenerationServiceStub(channel)
    _check(_outcome(stub.Chat(req, timeout=TIMEOUT_S)), req)


@fuzz(40)
@given(prompt=st.one_of(st.none(), TEXT), messages=st.one_of(st.none(), CHAT_MESSAGES),
       add_special=st.one_of(st.none(), st.booleans()),
       add_generation=st.one_of(st.none(), st.booleans()),
       ids=st.lists(INT32, max_size=50), skip=st.one_of(st.none(), st.booleans()))
def test_grpc_tokenize_detokenize_fuzz(tiny, channel, prompt, messages, add_special,
                                       add_generation, ids, skip):
    stub = api_pb2_grpc.GenerationServiceStub(channel)
    tok = api_pb2.TokenizeRequest(add_special_tokens=add_special,
                                  add_generation_prompt=add_generation)
    if messages is not None:
        tok.chat.messages.extend(api_pb2.ChatMessage(**m) for m in messages)
        tok.chat.SetInParent()
    elif prompt is not None:
        tok.prompt = prompt
    _check(_unary_outcome(stub.Tokenize, tok), tok)
    detok = api_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip)
    _check(_unary_outcome(stub.Detokenize, detok), detok)


def _raw(channel, method: str):
    """A raw server-streaming or unary call with bytes in and bytes out."""
    if method in ("Generate", "Chat"):
        return channel.unary_stream(SERVICE + method)
    return channel.unary_unary(SERVICE + method)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes = b"") -> bytes:
    return _varint(number << 3 | wire_type) + payload


def _run_raw(channel, method: str, body: bytes) -> grpc.StatusCode:
    call = _raw(channel, method)
    if method in ("Generate", "Chat"):
        return _outcome(call(body, timeout=TIMEOUT_S))
    return _unary_outcome(call, body)


_VALID_GENERATE = api_pb2.GenerateRequest(
    prompt_token_ids=api_pb2.TokenIds(ids=[5, 6, 7]),
    sampling_params=api_pb2.SamplingParams(max_tokens=2)).SerializeToString()


@fuzz(40)
@given(method=st.sampled_from(["Generate", "Chat", "Tokenize", "Detokenize", "ListModels"]),
       number=st.integers(19, 2**29 - 1), wire=st.sampled_from([0, 1, 2, 5]),
       payload=st.binary(max_size=20))
def test_grpc_unknown_fields_are_ignored(tiny, channel, method, number, wire, payload):
    """A message from a newer client (unknown field numbers) is served as if they were
    absent, as protobuf's rules say."""
    base = {"Generate": _VALID_GENERATE,
            "Chat": api_pb2.ChatRequest(
                messages=[api_pb2.ChatMessage(role="user", content="hi")],
                sampling_params=api_pb2.SamplingParams(max_tokens=2)).SerializeToString(),
            "Tokenize": api_pb2.TokenizeRequest(prompt="hi").SerializeToString(),
            "Detokenize": api_pb2.DetokenizeRequest(token_ids=[5]).SerializeToString(),
            "ListModels": b""}[method]
    extra = {0: _varint(int.from_bytes(payload[:8] or b"\1", "little")),
             1: payload[:8].ljust(8, b"\0"), 2: _varint(len(payload)) + payload,
             5: payload[:4].ljust(4, b"\0")}[wire]
    assert _run_raw(channel, method, base + _field(number, wire, extra)) == grpc.StatusCode.OK


@fuzz(40)
@given(method=st.sampled_from(["Generate", "Chat", "Tokenize", "Detokenize"]),
       body=st.one_of(st.binary(max_size=64),
                      # a string field holding bytes that are not UTF-8
                      st.builds(lambda b: _field(1, 2, _varint(len(b)) + b),
                                st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80",
                                                 b"ok\x00\xfe", b"\xf4\x90\x80\x80"])),
                      # a truncated valid message
                      st.integers(1, len(_VALID_GENERATE) - 1).map(
                          lambda k: _VALID_GENERATE[:k])))
def test_grpc_malformed_bytes(tiny, channel, method, body):
    """Bytes that do not parse (or strings that are not UTF-8): INVALID_ARGUMENT, not
    INTERNAL, or success when they happen to parse."""
    _check(_run_raw(channel, method, body), body)


@pytest.mark.parametrize("fields", [
    dict(seed=2**64 - 1, temperature=1.0), dict(top_k=INT32_MAX, temperature=1.0),
    dict(max_tokens=INT32_MAX), dict(min_tokens=INT32_MAX, max_tokens=INT32_MAX),
    dict(temperature=3.4e38), dict(temperature=1e-30), dict(top_p=1e-45, temperature=1.0),
    dict(min_p=1.0, temperature=1.0), dict(repetition_penalty=3.4e38),
    dict(repetition_penalty=1e-45), dict(presence_penalty=-2.0, frequency_penalty=2.0),
    dict(n=64, logprobs=20, prompt_logprobs=20, temperature=1.0),
    dict(stop=["\x00" * 256] * 16), dict(stop_token_ids=list(range(VOCAB - 2000, VOCAB))),
])
def test_grpc_extreme_valid_values_are_served(tiny, channel, fields):
    """Values at the edges of the allowed ranges run (a few tokens each)."""
    stub = api_pb2_grpc.GenerationServiceStub(channel)
    req = api_pb2.GenerateRequest(prompt_token_ids=api_pb2.TokenIds(ids=[5, 6, 7]),
                                  sampling_params=_sampling_pb(fields))
    assert _outcome(stub.Generate(req, timeout=TIMEOUT_S), read=4) == grpc.StatusCode.OK


def test_grpc_non_utf8_string_names_the_message(tiny, channel):
    body = _field(1, 2, _varint(3) + b"a\xffb")  # GenerateRequest.prompt = b"a\xffb"
    with pytest.raises(grpc.RpcError) as err:
        list(_raw(channel, "Generate")(body, timeout=TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GenerateRequest" in err.value.details() and "UTF-8" in err.value.details()


def test_grpc_prompt_beyond_limits(tiny, channel):
    stub = api_pb2_grpc.GenerationServiceStub(channel)
    max_len = tiny.info().max_model_len
    # more tokens than max_model_len: INVALID_ARGUMENT naming both lengths
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(api_pb2.GenerateRequest(
            prompt_token_ids=api_pb2.TokenIds(ids=[5] * (max_len * 50))), timeout=TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(max_len) in err.value.details()
    # a text prompt far longer than max_model_len (1 MiB of text)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(api_pb2.GenerateRequest(prompt="hello " * 200_000),
                           timeout=TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _still_serves(channel)


@pytest.mark.parametrize("method", ["Generate", "Chat", "Tokenize", "Detokenize"])
def test_grpc_message_over_the_receive_limit_is_resource_exhausted(tiny, channel, method):
    big = "x" * (DEFAULT_MAX_REQUEST_BYTES + 1024)
    req = {"Generate": api_pb2.GenerateRequest(prompt=big),
           "Chat": api_pb2.ChatRequest(messages=[api_pb2.ChatMessage(role="user", content=big)]),
           "Tokenize": api_pb2.TokenizeRequest(prompt=big),
           "Detokenize": api_pb2.DetokenizeRequest(
               token_ids=[5] * (DEFAULT_MAX_REQUEST_BYTES + 1024))}[method]
    code = _run_raw(channel, method, req.SerializeToString())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    _still_serves(channel)


def test_grpc_message_just_under_the_limit_is_served(tiny, channel):
    """A request just below the limit is read (and refused for its length, not its size)."""
    ids = [5] * (DEFAULT_MAX_REQUEST_BYTES // 2 - 64)  # 1 byte each + packing overhead
    req = api_pb2.GenerateRequest(prompt_token_ids=api_pb2.TokenIds(ids=ids))
    assert req.ByteSize() < DEFAULT_MAX_REQUEST_BYTES
    code = _run_raw(channel, "Generate", req.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    _still_serves(channel)


# ---- HTTP -------------------------------------------------------------------------------
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), FLOATS,
                         TEXT_SURROGATES)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda c: st.lists(c, max_size=4)
                           | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=8)
OPENAI_KEYS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens",
               "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
               "top_logprobs", "logit_bias", "user", "echo", "suffix", "best_of",
               "stream_options", "response_format", "tools", "ignore_eos", "min_tokens",
               "include_stop_str_in_output", "skip_special_tokens", "priority",
               "prompt_logprobs", "tool_choice", "functions", "parallel_tool_calls"]
# token ids beyond int32 / int64, which JSON can carry
BIG_INTS = st.lists(st.one_of(st.integers(-2**70, 2**70), st.sampled_from([2**63, -2**63 - 1])),
                    min_size=1, max_size=10)
# well-typed values, with out-of-range numbers
TYPED_VALUES = {
    "prompt": st.one_of(TEXT_SURROGATES, TOKEN_IDS, st.lists(TEXT, max_size=2),
                        st.lists(TOKEN_IDS, max_size=2), BIG_INTS),
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), TEXT_SURROGATES),
         "content": st.one_of(st.none(), TEXT_SURROGATES, st.lists(st.fixed_dictionaries(
             {"type": st.just("text"), "text": TEXT_SURROGATES}), max_size=3))}), max_size=4),
    "stop": st.one_of(TEXT_SURROGATES, STOP),
    "stop_token_ids": st.one_of(TOKEN_IDS, BIG_INTS),
    "seed": st.integers(-2**70, 2**70),
    "logit_bias": st.dictionaries(
        st.one_of(st.integers(0, VOCAB - 1), st.integers(-5, 2**40)).map(str),
        st.one_of(st.floats(-100, 100), FLOATS), max_size=3),
    **{k: FLOATS for k in ("temperature", "top_p", "min_p", "presence_penalty",
                           "frequency_penalty", "repetition_penalty")},
    **{k: st.one_of(INT32, st.integers(-2**70, 2**70)) for k in (
        "max_tokens", "max_completion_tokens", "top_k", "n", "min_tokens", "top_logprobs",
        "priority")},
    "logprobs": st.one_of(st.booleans(), INT32),
}
HTTP_ALLOWED = set(range(400, 500)) | {200}


def _post(url: str, data: bytes, headers: dict | None = None) -> int:
    """POST, streaming the answer: the status, after reading one chunk of a 200 (then the
    connection closes, which aborts the request)."""
    with requests.post(url, data=data, stream=True, timeout=TIMEOUT_S,
                       headers={"Content-Type": "application/json", **(headers or {})}) as r:
        if r.status_code == 200:
            next(r.iter_content(256), None)
        elif r.status_code >= 400:  # an OpenAI-shaped error body
            assert "error" in r.json(), r.text[:500]
        _tally(f"HTTP {r.status_code}")
        return r.status_code


def _dumps(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN/Infinity literals, as Python sends


VALID_HTTP_FIELDS = {k: v for k, v in VALID_SAMPLING_FIELDS.items()
                     if k not in ("prompt_logprobs", "max_tokens")}


@fuzz(50)
@given(chat=st.booleans(), prompt=st.one_of(TEXT_SURROGATES, TOKEN_IDS, BIG_INTS),
       fields=st.one_of(st.fixed_dictionaries({}, optional=TYPED_VALUES),
                        st.fixed_dictionaries({}, optional=VALID_HTTP_FIELDS)),
       untyped=st.one_of(st.just({}), st.dictionaries(st.sampled_from(OPENAI_KEYS), JSON_VALUES,
                                                      max_size=2)),
       unknown=st.dictionaries(st.text(min_size=1, max_size=12), JSON_VALUES, max_size=2),
       stream=st.sampled_from([True, True, False, None, "yes", 1]))
def test_http_fuzz(tiny, chat, prompt, fields, untyped, unknown, stream):
    """A prompt (or one user message), then fuzzed fields over it: well-typed values out of
    range, in-range values, any JSON value under known keys, unknown keys."""
    base = ({"messages": [{"role": "user", "content": prompt if isinstance(prompt, str)
                           else str(prompt)}]} if chat else {"prompt": prompt})
    body = {**unknown, **base, **fields, **untyped}
    if stream is not None:
        body["stream"] = stream
    if stream is not True:  # answered whole: keep an accepted request short
        body["max_tokens"] = body["max_completion_tokens"] = 2
        body["n"] = 1
    url = f"{tiny.http_url}/v1/{'chat/completions' if chat else 'completions'}"
    status = _post(url, _dumps(body))
    assert status in HTTP_ALLOWED, (status, body)


@fuzz(40)
@given(chat=st.booleans(), body=st.one_of(
    st.binary(max_size=100),
    JSON_VALUES.map(_dumps),
    st.sampled_from([b"", b"{", b"{\"prompt\": \"\xff\xfe\", \"max_tokens\": 1}",
                     b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xc3\"}]}",
                     b"{\"prompt\": \"ok\", \"max_tokens\": 1e999}", b"[]", b"null", b"1e400",
                     b"{\"prompt\": \"\\ud800\", \"max_tokens\": 1}",
                     b"{\"prompt\": \"x\", \"max_tokens\": 1, \"max_tokens\": -5}",
                     b"\xef\xbb\xbf{\"prompt\": \"x\", \"max_tokens\": 1}",
                     b"{\"prompt\": \"x\", \"max_tokens\": " + b"9" * 5000 + b"}",
                     b"{\"prompt\": \"x\", \"temperature\": 1e999999}",
                     b"[" * 100_000 + b"]" * 100_000])))
def test_http_malformed_bodies(tiny, chat, body):
    url = f"{tiny.http_url}/v1/{'chat/completions' if chat else 'completions'}"
    status = _post(url, body)
    assert status in HTTP_ALLOWED, (status, body[:200])


def test_http_gzip_bomb_is_413(tiny):
    """A small gzip body that inflates beyond the limit is refused as the inflated size."""
    import gzip

    body = gzip.compress(b'{"prompt": "' + b"x" * (DEFAULT_MAX_REQUEST_BYTES * 4) + b'"}')
    assert len(body) < DEFAULT_MAX_REQUEST_BYTES // 100
    assert _post(f"{tiny.http_url}/v1/completions", body,
                 {"Content-Encoding": "gzip"}) == 413


def _bias_is_valid(bias: dict) -> bool:
    """The router's rule for a logit_bias object: at most 1024 entries, ids in [0, VOCAB),
    biases (as float32s) finite and in [-100, 100]."""
    def f32(x: float) -> float:
        try:
            return struct.unpack("f", struct.pack("f", x))[0]
        except OverflowError:
            return math.inf
    return len(bias) <= 1024 and all(0 <= int(k) < VOCAB and -100 <= f32(v) <= 100
                                     for k, v in bias.items())


@fuzz(30)
@given(chat=st.booleans(), bias=TYPED_VALUES["logit_bias"])
def test_http_logit_bias_is_validated_not_ignored(tiny, chat, bias):
    """A valid logit_bias runs (200), an invalid one is a 400 naming logit_bias; the server
    keeps serving either way."""
    base = ({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"})
    url = f"{tiny.http_url}/v1/{'chat/completions' if chat else 'completions'}"
    r = requests.post(url, data=_dumps({**base, "max_tokens": 1, "logit_bias": bias}),
                      headers={"Content-Type": "application/json"}, timeout=TIMEOUT_S)
    if _bias_is_valid(bias):
        assert r.status_code == 200, (bias, r.text)
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", (bias, r.text)
    _tally(f"logit_bias HTTP {r.status_code}")


def test_http_logit_bias_steers_greedy(tiny):
    """Not ignored: +100 on a token makes greedy emit it; an empty object is no bias."""
    def first_token(bias: dict | None) -> str:
        body = {"prompt": "Hi", "max_tokens": 1, "temperature": 0, "logprobs": 0}
        r = requests.post(f"{tiny.http_url}/v1/completions", timeout=TIMEOUT_S,
                          json=body if bias is None else {**body, "logit_bias": bias})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"][0]

    assert first_token({}) == first_token(None)
    # ignored, both would be the unbiased greedy token
    assert first_token({"5": 100}) != first_token({"300": 100})


def test_http_lone_surrogate_names_the_field(tiny):
    body = b'{"messages": [{"role": "user", "content": "ok \\udc80"}], "max_tokens": 1}'
    r = requests.post(f"{tiny.http_url}/v1/chat/completions", data=body, timeout=TIMEOUT_S,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "messages[0].content" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages"


def test_http_unknown_keys_are_ignored(tiny):
    """As vLLM (and OpenAI's API for extra keys): unknown fields do not fail the request."""
    body = {"prompt": "Hello", "max_tokens": 2, "foo": {"bar": [1, None]}, "x-y": "z"}
    assert _post(f"{tiny.http_url}/v1/completions", _dumps(body)) == 200


def test_http_body_over_the_limit_is_413(tiny):
    body = _dumps({"prompt": "x" * (DEFAULT_MAX_REQUEST_BYTES + 1024), "max_tokens": 1})
    r = requests.post(f"{tiny.http_url}/v1/completions", data=body, timeout=TIMEOUT_S,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert "error" in r.json() and str(DEFAULT_MAX_REQUEST_BYTES) in r.json()["error"]["message"]
    _still_serves_http(tiny)


def test_http_huge_prompts(tiny):
    max_len = tiny.info().max_model_len
    for body in ({"prompt": [5] * (max_len * 20), "max_tokens": 1},
                 {"prompt": "hello " * 200_000, "max_tokens": 1},
                 {"messages": [{"role": "user", "content": "hi " * 200_000}]}):
        url = f"{tiny.http_url}/v1/{'chat/completions' if 'messages' in body else 'completions'}"
        r = requests.post(url, data=_dumps(body), timeout=TIMEOUT_S,
                          headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text[:300]
        assert str(max_len) in r.json()["error"]["message"]
    _still_serves_http(tiny)


def _still_serves_http(tiny):
    r = requests.post(f"{tiny.http_url}/v1/completions", timeout=TIMEOUT_S,
                      json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_zz_stack_still_serves_after_the_fuzzing(tiny, channel):
    """Last: after every test above, a normal request works on both APIs (the leak check of
    ``tiny`` then checks that no KV block is held)."""
    _still_serves(channel)
    _still_serves_http(tiny)
