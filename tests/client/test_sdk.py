"""The SDK's request building (vLLM-style arguments, errors that name the field) and its folding
of streamed choices into results."""

from __future__ import annotations

import pytest
from pagedserve_client import Usage, build_request
from pagedserve_client.pb.pagedserve.v1 import api_pb2
from pagedserve_client.types import delta_from_pb, join


def test_stop_accepts_one_string_like_vllm():
    req = build_request("hi", stop="Paris", max_tokens=3)
    assert list(req.sampling_params.stop) == ["Paris"]


def test_penalties_and_min_tokens_pass_through():
    req = build_request("hi", min_p=0.25, repetition_penalty=1.5, presence_penalty=-0.5,
                        frequency_penalty=1.0, min_tokens=3, max_tokens=8)
    p = req.sampling_params
    assert (p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
            p.min_tokens) == (0.25, 1.5, -0.5, 1.0, 3)
    assert not build_request("hi").sampling_params.HasField("repetition_penalty")
    with pytest.raises(ValueError, match="min_tokens"):
        build_request("hi", min_tokens=2**40)


def test_exactly_one_prompt_form():
    with pytest.raises(ValueError, match="exactly one"):
        build_request("hi", prompt_token_ids=[1])
    with pytest.raises(ValueError, match="exactly one"):
        build_request()


@pytest.mark.parametrize("kwargs, field", [
    (dict(seed=-1), "seed"), (dict(max_tokens=2**31), "max_tokens"),
    (dict(stop_token_ids=[2**40]), "stop_token_ids"), (dict(top_k=2**40), "top_k")])
def test_out_of_range_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        build_request("hi", **kwargs)


def test_unknown_parameter_and_bad_messages():
    with pytest.raises(ValueError, match="temprature"):
        build_request("hi", temprature=0.5)
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        build_request(messages=[{"content": "x"}])


def test_prompt_forms():
    assert build_request("text").prompt == "text"
    chat = build_request(messages=[{"role": "user", "content": "hi"}]).chat.messages
    assert [(m.role, m.content) for m in chat] == [("user", "hi")]
    assert list(build_request(prompt_token_ids=[1, 2]).prompt_token_ids.ids) == [1, 2]


def test_n_and_priority():
    req = build_request("hi", n=4, priority=-3, seed=1)
    assert req.sampling_params.n == 4 and req.priority == -3
    assert not build_request("hi").sampling_params.HasField("n")
    assert build_request("hi").priority == 0
    with pytest.raises(ValueError, match="priority"):
        build_request("hi", priority=2**31)
    with pytest.raises(TypeError, match="priority"):
        build_request("hi", priority="high")


def _msg(index, ids, text, finish=0, usage=None, stop_reason=""):
    return api_pb2.GenerateResponse(request_id="r", token_ids=ids, text=text, index=index,
                                    finish_reason=finish, usage=usage, stop_reason=stop_reason)


def test_join_folds_interleaved_choices_ordered_by_index():
    msgs = [_msg(1, [7], "b"), _msg(0, [5], "a"), _msg(2, [9], "c", 2, api_pb2.Usage(
                prompt_tokens=3, completion_tokens=1, num_cached_tokens=0)),
            _msg(1, [8], "B", 1, api_pb2.Usage(prompt_tokens=3, completion_tokens=2,
                                               num_cached_tokens=16), "STOP"),
            _msg(0, [6], "A", 2, api_pb2.Usage(prompt_tokens=3, completion_tokens=2))]
    deltas = [delta_from_pb(m) for m in msgs]
    assert [d.index for d in deltas] == [1, 0, 2, 1, 0]
    assert deltas[0].usage is None and deltas[3].usage == Usage(3, 2, 16)
    r = join(deltas)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [(c.text, c.token_ids, c.finish_reason) for c in r.choices] == [
        ("aA", [5, 6], "length"), ("bB", [7, 8], "stop"), ("c", [9], "length")]
    assert r.choices[1].stop_reason == "STOP" and r.choices[1].usage.num_cached_tokens == 16
    # the single-choice attributes are choice 0's
    assert (r.text, r.token_ids, r.finish_reason, r.usage, r.stop_reason) == (
        "aA", [5, 6], "length", Usage(3, 2, 0), None)


def test_join_single_choice_and_empty():
    r = join([delta_from_pb(_msg(0, [1], "x")), delta_from_pb(_msg(0, [2], "y", 1, api_pb2.Usage(
        prompt_tokens=4, completion_tokens=2)))])
    assert (r.text, r.token_ids, r.finish_reason, r.usage) == ("xy", [1, 2], "stop", Usage(4, 2))
    assert len(r.choices) == 1 and r.choices[0].text == "xy"
    empty = join([])
    assert empty.text == "" and empty.choices == [] and empty.finish_reason is None


def test_logprobs_are_typed_and_joined_per_choice():
    from pagedserve_client import TokenLogprob, TopLogprob

    def lp(t, v):
        return api_pb2.TokenLogprob(token_id=t, logprob=v,
                                    top=[api_pb2.TopLogprob(token_id=t, logprob=v)])
    msgs = [api_pb2.GenerateResponse(request_id="r", token_ids=[5], logprobs=[lp(5, -0.5)],
                                     prompt_logprobs=[lp(3, -2.0)]),
            api_pb2.GenerateResponse(request_id="r", index=1, token_ids=[7],
                                     logprobs=[lp(7, -1.0)]),
            api_pb2.GenerateResponse(request_id="r", token_ids=[6], logprobs=[lp(6, -0.25)],
                                     finish_reason=2)]
    deltas = [delta_from_pb(m) for m in msgs]
    assert deltas[0].logprobs == [TokenLogprob(5, -0.5, [TopLogprob(5, -0.5)])]
    r = join(deltas)
    assert [x.token_id for x in r.logprobs] == r.token_ids == [5, 6]
    assert r.choices[1].logprobs == [TokenLogprob(7, -1.0, [TopLogprob(7, -1.0)])]
    assert r.prompt_logprobs == [TokenLogprob(3, -2.0, [TopLogprob(3, -2.0)])]
    assert r.choices[1].prompt_logprobs is None
    assert delta_from_pb(api_pb2.GenerateResponse(token_ids=[1])).logprobs is None
    assert join([delta_from_pb(api_pb2.GenerateResponse(token_ids=[1]))]).logprobs is None
