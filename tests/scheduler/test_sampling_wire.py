"""The sampling parameters cross router -> scheduler -> worker as one type, unchanged; the
workers' logprobs come back cut per request."""

from __future__ import annotations

from dataclasses import fields

from services.common.pb.pagedserve.v1 import engine_pb2, worker_pb2
from services.common.sampling_params import EngineSamplingParams
from services.common.step_wire import step_to_pb
from services.scheduler.request import Request
from tests.scheduler.factories import make_scheduler

FULL = EngineSamplingParams(
    temperature=0.5, top_p=0.75, top_k=7, seed=2**64 - 1, max_tokens=20, stop_token_ids=(4, 5),
    ignore_eos=True, min_p=0.25, repetition_penalty=1.5, presence_penalty=-0.5,
    frequency_penalty=0.75, min_tokens=6, logprobs=0, prompt_logprobs=20,
    structured_output='{"grammars": [{"lark_grammar": "start: \\"a\\""}]}',
    logit_bias=((3, 100.0), (0, -0.5)), reasoning_end_token_id=0)


def test_the_message_is_the_type_field_for_field():
    """Same names (logit_bias as two parallel columns); the message's optional fields are the
    type's None-able ones."""
    message = engine_pb2.EngineSamplingParams.DESCRIPTOR.fields
    names = [f.name for f in fields(EngineSamplingParams)]
    names[names.index("logit_bias"):names.index("logit_bias") + 1] = [
        "logit_bias_token_ids", "logit_bias_values"]
    assert [f.name for f in message] == names
    assert {f.name for f in message if f.has_presence} == {
        "seed", "max_tokens", "logprobs", "prompt_logprobs", "reasoning_end_token_id"}
    for params in (FULL, EngineSamplingParams()):
        assert EngineSamplingParams.from_pb(params.to_pb()) == params


def test_unset_stays_unset_and_zero_stays_zero():
    wire = EngineSamplingParams().to_pb()
    assert not any(wire.HasField(n) for n in ("seed", "max_tokens", "logprobs", "prompt_logprobs",
                                              "reasoning_end_token_id"))
    assert (wire.top_p, wire.repetition_penalty, wire.top_k) == (1.0, 1.0, -1)  # sent, not implied
    assert FULL.to_pb().HasField("logprobs") and FULL.to_pb().logprobs == 0
    assert FULL.to_pb().HasField("reasoning_end_token_id")  # id 0 is an id, not "unset"


def test_the_scheduler_forwards_the_submitted_message_unchanged():
    """What a router submits is what every worker rank gets in the request's NewRequest (stop
    ids and ignore_eos too, which the worker uses only under min_tokens)."""
    for params in (FULL, EngineSamplingParams(stop_token_ids=(4,), ignore_eos=True)):
        submitted = params.to_pb()
        s = make_scheduler()
        s.add_request(Request("req-0", [1, 2, 3],
                              EngineSamplingParams.from_pb(submitted)))
        (new,) = step_to_pb(s.schedule()).new_requests
        assert new.sampling_params == submitted
        assert isinstance(new.sampling_params, engine_pb2.EngineSamplingParams)
        assert worker_pb2.NewRequest.DESCRIPTOR.fields_by_name["sampling_params"].message_type \
            is engine_pb2.EngineSamplingParams.DESCRIPTOR


def test_step_result_logprobs_are_cut_per_request():
    import pytest

    from services.common.pb.pagedserve.v1 import worker_pb2
    from services.common.step import Logprobs
    from services.common.step_wire import step_output_from_pb
    from services.scheduler.step_results import results_by_request

    result = worker_pb2.StepResult(
        step_id=1, request_ids=["a", "b", "c"], sampled_token_ids=[1, 2, 3],
        num_top_logprobs=[2, -1, 0], sampled_logprobs=[-0.5, -1.5],
        top_token_ids=[1, 7], top_logprobs=[-0.5, -2.0])
    cut = results_by_request(step_output_from_pb(result))
    assert {rid: r.logprobs for rid, r in cut.items()} == {
        "a": Logprobs("a", 0, [-0.5], [1, 7], [-0.5, -2.0]), "b": None,
        "c": Logprobs("c", 0, [-1.5], [], [])}
    assert results_by_request(step_output_from_pb(worker_pb2.StepResult(
        request_ids=["a"], sampled_token_ids=[1])))["a"].logprobs is None
    del result.top_logprobs[1]
    with pytest.raises(ValueError, match="malformed"):
        step_output_from_pb(result)


def test_step_result_prompt_logprobs_are_cut_per_request():
    import pytest

    from services.common.pb.pagedserve.v1 import worker_pb2
    from services.common.step import Logprobs
    from services.common.step_wire import step_output_from_pb

    result = worker_pb2.StepResult(
        prompt_request_ids=["a", "b"], prompt_first_positions=[1, 9],
        prompt_num_tokens=[2, 1], prompt_num_top=[1, 0], prompt_logprobs=[-1.0, -2.0, -3.0],
        prompt_top_token_ids=[4, 5], prompt_top_logprobs=[-0.5, -0.75])
    assert step_output_from_pb(result).prompt_logprobs == [
        Logprobs("a", 1, [-1.0, -2.0], [4, 5], [-0.5, -0.75]),
        Logprobs("b", 9, [-3.0], [], [])]
    assert step_output_from_pb(worker_pb2.StepResult()).prompt_logprobs == []
    del result.prompt_logprobs[0]
    with pytest.raises(ValueError, match="malformed"):
        step_output_from_pb(result)
    p = Logprobs("a", 3, [-1.0, -2.0], [7, 8], [-1.0, -2.0])
    assert p.from_position(2) is p and p.from_position(5) is None
    assert p.from_position(4) == Logprobs("a", 4, [-2.0], [8], [-2.0])
