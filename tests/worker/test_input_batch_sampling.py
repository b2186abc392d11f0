"""InputBatch keeps each request's token counts up to date and masks stop ids under min_tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.common.sampling_params import EngineSamplingParams
from services.common.step import CachedRequest, NewRequest, StepInput
from services.worker.input_batch import InputBatch

V, EOS = 32, 2


def _batch() -> InputBatch:
    return InputBatch(torch.device("cpu"), block_size=4, num_kv_blocks=8, vocab_size=V,
                      eos_token_ids=[EOS], max_num_seqs=4, max_model_len=32,
                      max_num_batched_tokens=16)


def _step(batch: InputBatch, step_id: int, new=(), cached=(), finished=()):
    return batch.prepare(batch.update(StepInput(step_id, list(new), list(cached),
                                                list(finished)))).sampling_tensors


def _num_token_aware(batch: InputBatch) -> int:
    """Held requests whose sampling looks at their tokens (a penalty or min_tokens)."""
    return sum(s.counts is not None or bool(s.min_tokens_stop_ids)
               for s in batch.requests.values())


def test_counts_follow_the_output_and_min_tokens_lifts():
    batch = _batch()
    opts = EngineSamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5,
                                min_tokens=2, stop_token_ids=(7,))
    plain = EngineSamplingParams(temperature=0.0)
    s = _step(batch, 1, new=[NewRequest("a", [5, 6, 5], opts, [0], 0, 3),
                             NewRequest("b", [1, 1], plain, [1], 0, 2)])
    assert s.penalties.rows.tolist() == [0]
    assert s.penalties.prompt_mask[0].nonzero().flatten().tolist() == [5, 6]
    assert s.penalties.output_counts.sum().item() == 0
    assert sorted(zip(*(t.tolist() for t in s.min_tokens_mask))) == [(0, EOS), (0, 7)]
    s = _step(batch, 2, cached=[CachedRequest("b", [9], [], False, 2, 1),
                                CachedRequest("a", [9], [], False, 3, 1)])
    assert s.penalties.rows.tolist() == [1]  # "a" is row 1 now
    assert s.penalties.output_counts[0, 9].item() == 1
    assert s.min_tokens_mask[0].tolist() == [1, 1]  # one output < min_tokens 2
    s = _step(batch, 3, cached=[CachedRequest("a", [9], [1], False, 4, 1)])
    assert s.penalties.output_counts[0, 9].item() == 2 and s.min_tokens_mask is None
    assert _num_token_aware(batch) == 1
    _step(batch, 4, cached=[CachedRequest("b", [3], [], False, 3, 1)], finished=["a"])
    assert _num_token_aware(batch) == 0


def test_ignore_eos_masks_only_stop_ids_and_plain_batches_skip_the_work():
    batch = _batch()
    s = _step(batch, 1, new=[NewRequest("a", [5], EngineSamplingParams(
        min_tokens=1, stop_token_ids=(7,), ignore_eos=True), [0], 0, 1)])
    assert s.min_tokens_mask[1].tolist() == [7] and s.penalties is None
    s = _step(batch, 2, new=[NewRequest("b", [5], EngineSamplingParams(), [1], 0, 1)],
              finished=["a"])
    assert s.min_tokens_mask is None and s.penalties is None and s.min_p is None


def _step_request(sampling, vocab_size: int = V):
    from services.common.pb.pagedserve.v1 import worker_pb2
    from services.worker.server import step_input_from_pb

    msg = worker_pb2.StepRequest(step_id=1, new_requests=[worker_pb2.NewRequest(
        request_id="a", prompt_token_ids=[1, 2], block_ids=[0], num_scheduled_tokens=2,
        sampling_params=sampling)])
    return step_input_from_pb(msg, vocab_size)


def test_step_request_decoding_carries_the_routers_object_as_it_is():
    sent = EngineSamplingParams(
        temperature=0.5, top_p=0.9, top_k=7, seed=2**64 - 1, max_tokens=20, min_p=0.25,
        repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=-1.0, min_tokens=3,
        stop_token_ids=(7,), ignore_eos=True, logprobs=0, prompt_logprobs=2)
    got = _step_request(sent.to_pb()).new_requests[0].sampling_params
    assert got.top_p == pytest.approx(0.9) and got.min_p == 0.25
    assert replace(got, top_p=0.9) == sent  # float32 on the wire: 0.9 comes back rounded
    assert got.uses_penalties and not EngineSamplingParams().uses_penalties
    assert _step_request(EngineSamplingParams().to_pb()).new_requests[0].sampling_params == (
        EngineSamplingParams())


@pytest.mark.parametrize("fields", [
    {"temperature": float("nan")}, {"temperature": -1.0}, {"temperature": float("inf")},
    {"top_p": 0.0}, {"top_p": 1.5}, {"min_p": 2.0}, {"repetition_penalty": 0.0},
    {"presence_penalty": float("nan")}, {"stop_token_ids": (V,)}, {"stop_token_ids": (-1,)},
    {"logprobs": V + 1}, {"prompt_logprobs": -2},
])
def test_malformed_sampling_parameters_are_refused_when_decoded(fields):
    """The router never sends these; a malformed message fails with a clear error naming the
    request and the parameters, before anything reaches the sampler."""
    bad = replace(EngineSamplingParams(), **fields)
    with pytest.raises(ValueError, match="new request 'a': sampling parameters the sampler "
                                         "cannot use") as e:
        _step_request(bad.to_pb())
    name, value = next(iter(fields.items()))
    assert f"{name}={value!r}" in str(e.value)


def test_an_unset_message_is_malformed_not_defaults():
    """top_p 0 and repetition_penalty 0 (proto3's unset) are no longer read as 1."""
    from services.common.pb.pagedserve.v1 import engine_pb2

    with pytest.raises(ValueError, match=r"top_p=0\.0"):
        _step_request(engine_pb2.EngineSamplingParams(temperature=1.0))
