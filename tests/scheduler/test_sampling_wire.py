"""The sampling parameters survive router -> scheduler -> worker encoding."""

from __future__ import annotations

from services.common.pb.pagedserve.v1 import engine_pb2
from services.scheduler.engine import params_from_pb
from services.scheduler.request import EngineSamplingParams
from services.scheduler.worker_client import _sampling_pb


def test_defaults_decode_to_off():
    p = params_from_pb(engine_pb2.EngineSamplingParams(temperature=1.0))
    assert (p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
            p.min_tokens) == (0.0, 1.0, 0.0, 0.0, 0)  # repetition_penalty 0 on the wire = off


def test_penalties_and_min_tokens_pass_through():
    wire = engine_pb2.EngineSamplingParams(
        temperature=0.5, top_p=0.9, top_k=7, seed=3, max_tokens=20, stop_token_ids=[4, 5],
        ignore_eos=True, min_p=0.25, repetition_penalty=1.5, presence_penalty=-0.5,
        frequency_penalty=0.75, min_tokens=6)
    p = params_from_pb(wire)
    assert (p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
            p.min_tokens, p.stop_token_ids, p.ignore_eos) == (0.25, 1.5, -0.5, 0.75, 6, [4, 5],
                                                              True)
    w = _sampling_pb(p)
    assert (w.min_p, w.repetition_penalty, w.presence_penalty, w.frequency_penalty,
            w.min_tokens, list(w.stop_token_ids), w.ignore_eos, w.seed) == (
        0.25, 1.5, -0.5, 0.75, 6, [4, 5], True, 3)


def test_stop_ids_go_to_the_worker_only_with_min_tokens():
    w = _sampling_pb(EngineSamplingParams(stop_token_ids=[4], ignore_eos=True))
    assert list(w.stop_token_ids) == [] and not w.ignore_eos and w.min_tokens == 0


def test_logprobs_pass_through_and_unset_stays_unset():
    assert params_from_pb(engine_pb2.EngineSamplingParams()).logprobs is None
    assert not _sampling_pb(EngineSamplingParams()).HasField("logprobs")
    p = params_from_pb(engine_pb2.EngineSamplingParams(logprobs=0, prompt_logprobs=2))
    assert p.logprobs == 0 and p.prompt_logprobs == 2
    assert _sampling_pb(p).prompt_logprobs == 2
    w = _sampling_pb(p)
    assert w.HasField("logprobs") and w.logprobs == 0
    assert _sampling_pb(EngineSamplingParams(logprobs=20)).logprobs == 20


def test_step_result_logprobs_are_cut_per_request():
    import pytest

    from services.common.pb.pagedserve.v1 import worker_pb2
    from services.scheduler.logprobs import TokenLogprobs, logprobs_from_pb

    result = worker_pb2.StepResult(
        step_id=1, request_ids=["a", "b", "c"], sampled_token_ids=[1, 2, 3],
        num_top_logprobs=[2, -1, 0], sampled_logprobs=[-0.5, -1.5],
        top_token_ids=[1, 7], top_logprobs=[-0.5, -2.0])
    assert logprobs_from_pb(result) == {"a": TokenLogprobs(-0.5, [1, 7], [-0.5, -2.0]),
                                        "c": TokenLogprobs(-1.5, [], [])}
    assert logprobs_from_pb(worker_pb2.StepResult(request_ids=["a"])) is None
    del result.top_logprobs[1]
    with pytest.raises(ValueError, match="malformed"):
        logprobs_from_pb(result)


def test_step_result_prompt_logprobs_are_cut_per_request():
    import pytest

    from services.common.pb.pagedserve.v1 import worker_pb2
    from services.scheduler.logprobs import PromptLogprobs, prompt_logprobs_from_pb

    result = worker_pb2.StepResult(
        prompt_request_ids=["a", "b"], prompt_first_positions=[1, 9],
        prompt_num_tokens=[2, 1], prompt_num_top=[1, 0], prompt_logprobs=[-1.0, -2.0, -3.0],
        prompt_top_token_ids=[4, 5], prompt_top_logprobs=[-0.5, -0.75])
    assert prompt_logprobs_from_pb(result) == {
        "a": PromptLogprobs(1, [-1.0, -2.0], [4, 5], [-0.5, -0.75], 1),
        "b": PromptLogprobs(9, [-3.0], [], [], 0)}
    assert prompt_logprobs_from_pb(worker_pb2.StepResult()) is None
    del result.prompt_logprobs[0]
    with pytest.raises(ValueError, match="malformed"):
        prompt_logprobs_from_pb(result)
    p = PromptLogprobs(3, [-1.0, -2.0], [7, 8], [-1.0, -2.0], 1)
    assert p.from_position(2) is p and p.from_position(5) is None
    assert p.from_position(4) == PromptLogprobs(4, [-2.0], [8], [-2.0], 1)
