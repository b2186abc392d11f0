"""Request validation: ranges, defaults, vLLM-style messages, INVALID_ARGUMENT everywhere."""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.pb.pagedserve.v1 import api_pb2
from services.common.sampling_params import EngineSamplingParams
from services.router.validation import (
    CHAT_ROLES,
    RequestError,
    TextOptions,
    validate_chat_template_kwargs,
    validate_messages,
    validate_n,
    validate_priority,
    validate_prompt_ids,
    validate_request_id,
    validate_sampling,
)

VOCAB = 49152


def check(**fields):
    return validate_sampling(api_pb2.SamplingParams(**fields), vocab_size=VOCAB)


def error(fn, *args, **kwargs) -> str:
    with pytest.raises(RequestError) as e:
        fn(*args, **kwargs)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(e.value) == e.value.message
    return e.value.message


def test_defaults():
    engine, text = check()
    assert (engine.temperature, engine.top_p, engine.top_k) == (1.0, 1.0, -1)
    assert engine.seed is None and engine.max_tokens is None
    assert list(engine.stop_token_ids) == [] and not engine.ignore_eos
    assert engine == EngineSamplingParams()  # every default filled in, once, here
    assert text == TextOptions(stop=(), include_stop_str_in_output=False,
                               skip_special_tokens=True)


def test_values_are_carried_over():
    engine, text = check(temperature=0.0, top_p=0.9, top_k=40, seed=2**64 - 1, max_tokens=7,
                         stop=["\n\n", "User:"], stop_token_ids=[2, 0, VOCAB - 1],
                         ignore_eos=True, include_stop_str_in_output=True,
                         skip_special_tokens=False)
    assert engine.temperature == 0.0 and math.isclose(engine.top_p, 0.9, rel_tol=1e-6)
    assert (engine.top_k, engine.seed, engine.max_tokens) == (40, 2**64 - 1, 7)
    assert list(engine.stop_token_ids) == [2, 0, VOCAB - 1] and engine.ignore_eos
    assert text == TextOptions(("\n\n", "User:"), True, False)


@pytest.mark.parametrize("top_k", [0, -1, VOCAB, VOCAB + 5, 2**31 - 1])
def test_top_k_off_values_become_minus_one(top_k):
    assert check(top_k=top_k)[0].top_k == -1


@pytest.mark.parametrize("fields, message", [
    ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
    ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
    ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"top_p": -0.1}, "top_p must be in (0, 1], got -0.1"),
    ({"top_p": float("-inf")}, "top_p must be a finite number, got -inf"),
    ({"top_k": -2}, "top_k must be -1 (off) or >= 0, got -2"),
    ({"max_tokens": -3}, "max_tokens must be >= 1, got -3"),
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"stop": ["x"] * 17}, "stop must have at most 16 strings, got 17"),
    ({"stop": ["ok", ""]}, "stop[1] must have 1 to 256 characters, got 0"),
    ({"stop": ["é" * 257]}, "stop[0] must have 1 to 256 characters, got 257"),
    ({"stop_token_ids": [5, VOCAB]}, f"stop_token_ids[1] must be in [0, {VOCAB}), got {VOCAB}"),
    ({"stop_token_ids": [-1]}, f"stop_token_ids[0] must be in [0, {VOCAB}), got -1"),
    ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
    ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
    ({"min_p": float("nan")}, "min_p must be a finite number, got nan"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty must be > 0, got -1.0"),
    ({"repetition_penalty": float("inf")},
     "repetition_penalty must be a finite number, got inf"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
    ({"presence_penalty": -2.1}, "presence_penalty must be in [-2, 2], got -2.1"),
    ({"frequency_penalty": 3.0}, "frequency_penalty must be in [-2, 2], got 3.0"),
    ({"frequency_penalty": float("-inf")},
     "frequency_penalty must be a finite number, got -inf"),
    ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
    ({"min_tokens": 8, "max_tokens": 7}, "min_tokens must be <= max_tokens (7), got 8"),
    ({"logprobs": 21}, "logprobs must be in [0, 20] (the router's --max-logprobs), got 21"),
    ({"logprobs": -1}, "logprobs must be in [0, 20] (the router's --max-logprobs), got -1"),
    ({"prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20] (the router's --max-logprobs), got 21"),
    ({"logit_bias": {VOCAB: 1.0}}, f"logit_bias token id {VOCAB} must be in [0, {VOCAB})"),
    ({"logit_bias": {5: 0.0, -1: 1.0}}, f"logit_bias token id -1 must be in [0, {VOCAB})"),
    ({"logit_bias": {5: 100.5}}, "logit_bias[5] must be in [-100, 100], got 100.5"),
    ({"logit_bias": {7: -101.0}}, "logit_bias[7] must be in [-100, 100], got -101.0"),
    ({"logit_bias": {7: float("nan")}}, "logit_bias[7] must be a finite number, got nan"),
    ({"logit_bias": {7: float("-inf")}}, "logit_bias[7] must be a finite number, got -inf"),
    ({"logit_bias": dict.fromkeys(range(1025), 1.0)},
     "logit_bias must have at most 1024 entries, got 1025"),
])
def test_out_of_range_fields(fields, message):
    assert error(check, **fields) == message
    with pytest.raises(RequestError) as e:
        check(**fields)
    assert e.value.param == next(iter(fields))  # the field itself, OpenAI's ``param``


def test_limits_are_inclusive():
    check(temperature=0.0, top_p=1.0, top_k=0, max_tokens=1, stop=["x" * 256] * 16,
          stop_token_ids=[0, VOCAB - 1])
    for min_p in (0.0, 1.0):
        check(min_p=min_p)
    for penalty in (-2.0, 2.0):
        check(presence_penalty=penalty, frequency_penalty=penalty)
    check(min_tokens=7, max_tokens=7)
    check(repetition_penalty=1e-3)
    assert check(logprobs=0)[0].logprobs == 0 and check(logprobs=20)[0].logprobs == 20
    assert check()[0].logprobs is None
    assert check(prompt_logprobs=0)[0].prompt_logprobs == 0
    assert check()[0].prompt_logprobs is None


def test_logit_bias_is_sorted_by_id_with_inclusive_limits():
    assert check()[0].logit_bias == ()
    engine, _ = check(logit_bias={VOCAB - 1: 100.0, 0: -100.0, 7: 0.5})
    assert engine.logit_bias == ((0, -100.0), (7, 0.5), (VOCAB - 1, 100.0))
    assert len(check(logit_bias=dict.fromkeys(range(1024), 1.0))[0].logit_bias) == 1024


def test_penalty_defaults_and_values():
    engine, _ = check()
    assert (engine.min_p, engine.repetition_penalty, engine.presence_penalty,
            engine.frequency_penalty, engine.min_tokens) == (0.0, 1.0, 0.0, 0.0, 0)
    engine, _ = check(min_p=0.25, repetition_penalty=1.5, presence_penalty=-0.5,
                      frequency_penalty=1.25, min_tokens=100)  # no max_tokens: any min_tokens
    assert (engine.min_p, engine.repetition_penalty, engine.presence_penalty,
            engine.frequency_penalty, engine.min_tokens) == (0.25, 1.5, -0.5, 1.25, 100)


@given(st.floats(allow_nan=True, allow_infinity=True, width=32))
def test_temperature_is_accepted_iff_finite_and_non_negative(t):
    ok = math.isfinite(t) and t >= 0
    if ok:
        assert check(temperature=t)[0].temperature == t
    else:
        error(check, temperature=t)


@given(st.floats(allow_nan=True, allow_infinity=True, width=32))
def test_top_p_is_accepted_iff_in_half_open_unit_interval(p):
    if math.isfinite(p) and 0 < p <= 1:
        assert check(top_p=p)[0].top_p == p
    else:
        assert "top_p must be" in error(check, top_p=p)


def test_prompt_ids():
    validate_prompt_ids([0, 5, VOCAB - 1], max_model_len=4, vocab_size=VOCAB)
    assert error(validate_prompt_ids, [], max_model_len=8192, vocab_size=VOCAB) == \
        "prompt is empty"
    assert error(validate_prompt_ids, [1] * 9000, max_model_len=8192, vocab_size=VOCAB) == (
        "prompt has 9000 tokens but max_model_len is 8192: the prompt must be shorter than "
        "max_model_len")
    assert "prompt has 8 tokens" in error(validate_prompt_ids, [1] * 8, max_model_len=8,
                                          vocab_size=VOCAB)
    assert error(validate_prompt_ids, [1, 2, -4], max_model_len=8, vocab_size=VOCAB) == \
        f"prompt_token_ids[2] must be in [0, {VOCAB}), got -4"
    assert error(validate_prompt_ids, [VOCAB, 1], max_model_len=8, vocab_size=VOCAB) == \
        f"prompt_token_ids[0] must be in [0, {VOCAB}), got {VOCAB}"


def test_request_id():
    assert validate_request_id("req-1") == "req-1"
    assert validate_request_id("x" * 128) == "x" * 128
    made = validate_request_id("")
    assert len(made) == 32 and made != validate_request_id("")
    assert error(validate_request_id, "x" * 129) == \
        "request_id must have at most 128 characters, got 129"


def test_n_defaults_to_one_and_accepts_1_to_64():
    assert validate_n(api_pb2.SamplingParams()) == 1
    for n in (1, 2, 64):
        assert validate_n(api_pb2.SamplingParams(n=n)) == n


@pytest.mark.parametrize("n", [0, -1, 65, 2**31 - 1])
def test_n_out_of_range(n):
    assert error(validate_n, api_pb2.SamplingParams(n=n)) == f"n must be in [1, 64], got {n}"


@pytest.mark.parametrize("priority", [0, 1, -5, 2**31 - 1, -2**31])
def test_any_int32_priority_under_the_priority_policy(priority):
    assert validate_priority(priority, scheduling_policy="priority") == priority


@pytest.mark.parametrize("policy", ["fcfs", ""])  # "" = an engine that predates the field
def test_priority_must_be_zero_under_fcfs(policy):
    assert validate_priority(0, scheduling_policy=policy) == 0
    message = error(validate_priority, 3, scheduling_policy=policy)
    assert message.startswith("priority must be 0 unless the scheduler runs "
                              "--scheduling-policy priority")
    assert message.endswith("got 3") and "fcfs" in message


@pytest.mark.parametrize("role", CHAT_ROLES)
def test_every_openai_chat_role_is_accepted(role):
    # a tool message must answer an earlier tool call (tests/router/test_openai_messages.py)
    asks = api_pb2.ChatMessage(role="assistant", tool_calls=[
        api_pb2.ToolCall(id="c", name="f", arguments="{}")])
    extra = {"tool_call_id": "c"} if role == "tool" else {}
    msg = api_pb2.ChatMessage(role=role, content="hi", **extra)
    assert validate_messages([asks, msg])[1] == {"role": role, "content": "hi", **extra}
    assert validate_messages([asks, {"role": role, "content": "hi", **extra}])[1] == {
        "role": role, "content": "hi", **extra}


@pytest.mark.parametrize("role", ["wizard", "", "User", "bot"])
def test_unknown_chat_role_is_refused_naming_the_message(role):
    messages = [api_pb2.ChatMessage(role="user", content="a"),
                api_pb2.ChatMessage(role=role, content="b")]
    assert error(validate_messages, messages) == (
        "messages[1].role must be one of system, developer, user, assistant, tool, function, "
        f"got {role!r}")


def test_chat_rpc_refuses_an_unknown_role_before_tokenizing():
    """The Chat RPC's own path (servicer -> chat_to_generate -> prepare) without gRPC."""
    from services.common.pb.pagedserve.v1 import engine_pb2
    from services.router.generation import prepare
    from services.router.text_api import chat_to_generate
    from tests.router import tiny_bos_tokenizer

    info = engine_pb2.GetEngineInfoResponse(vocab_size=16, max_model_len=64)
    chat = api_pb2.ChatRequest(messages=[api_pb2.ChatMessage(role="wizard", content="hi")])
    with pytest.raises(RequestError) as e:
        prepare(chat_to_generate(chat), tiny_bos_tokenizer(), info)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.message.startswith("messages[0].role must be one of system,")
    chat.messages[0].role = "user"
    assert prepare(chat_to_generate(chat), tiny_bos_tokenizer(), info).prompt_token_ids


@pytest.mark.parametrize("text", ['{"x": NaN}', '{"x": [Infinity]}', '{"x": {"y": -Infinity}}',
                                  '{"x": 1e400}'])
def test_chat_template_kwargs_refuse_numbers_that_are_not_json(text):
    """Python's json reads them (1e400 as inf); gRPC and HTTP requests alike are refused."""
    with pytest.raises(RequestError) as e:
        validate_chat_template_kwargs(text)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.message.startswith("chat.chat_template_kwargs must hold JSON values only")
    assert validate_chat_template_kwargs('{"x": 1e300, "y": [1, null]}') == {
        "x": 1e300, "y": [1, None]}


@pytest.mark.parametrize("call, param", [
    (lambda: validate_prompt_ids([], max_model_len=8, vocab_size=VOCAB), "prompt"),
    (lambda: validate_prompt_ids([1] * 8, max_model_len=8, vocab_size=VOCAB), "prompt"),
    (lambda: validate_prompt_ids([VOCAB], max_model_len=8, vocab_size=VOCAB), "prompt"),
    (lambda: validate_messages([]), "messages"),
    (lambda: validate_messages([{"role": "tool", "content": "x"}]), "messages"),
    (lambda: validate_messages([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "name": "f", "arguments": "[]"}]}]), "messages"),
    (lambda: validate_chat_template_kwargs("[]"), "chat_template_kwargs"),
    (lambda: validate_chat_template_kwargs('{"tools": 1}', ("tools",)), "chat_template_kwargs"),
    (lambda: validate_request_id("x" * 129), "request_id"),
    (lambda: validate_n(api_pb2.SamplingParams(n=0)), "n"),
    (lambda: validate_priority(1, scheduling_policy="fcfs"), "priority"),
    (lambda: check(use_beam_search=True, temperature=0.5), "temperature"),
    (lambda: check(use_beam_search=True, stop=["x"]), "stop"),
    (lambda: check(beam_width=3), "beam_width"),
])
def test_every_refusal_names_its_field(call, param):
    """``RequestError.param``: the field, carried to OpenAI's error body as it is (no message
    is parsed for it)."""
    with pytest.raises(RequestError) as e:
        call()
    assert e.value.param == param
