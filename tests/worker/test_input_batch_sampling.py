"""InputBatch keeps each request's token counts up to date and masks stop ids under min_tokens."""

from __future__ import annotations

import torch

from services.worker.input_batch import InputBatch
from services.worker.step_input import CachedRequest, NewRequest, SamplingOptions, StepInput

V, EOS = 32, 2


def _batch() -> InputBatch:
    return InputBatch(torch.device("cpu"), block_size=4, num_kv_blocks=8, vocab_size=V,
                      eos_token_ids=[EOS], max_num_seqs=4, max_model_len=32,
                      max_num_batched_tokens=16)


def _step(batch: InputBatch, step_id: int, new=(), cached=(), finished=()):
    return batch.prepare(batch.update(StepInput(step_id, list(new), list(cached),
                                                list(finished)))).sampling


def test_counts_follow_the_output_and_min_tokens_lifts():
    batch = _batch()
    opts = SamplingOptions(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5,
                           min_tokens=2, stop_token_ids=(7,))
    plain = SamplingOptions(temperature=0.0)
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
    assert batch.num_token_aware == 1
    _step(batch, 4, cached=[CachedRequest("b", [3], [], False, 3, 1)], finished=["a"])
    assert batch.num_token_aware == 0


def test_ignore_eos_masks_only_stop_ids_and_plain_batches_skip_the_work():
    batch = _batch()
    s = _step(batch, 1, new=[NewRequest("a", [5], SamplingOptions(
        min_tokens=1, stop_token_ids=(7,), ignore_eos=True), [0], 0, 1)])
    assert s.min_tokens_mask[1].tolist() == [7] and s.penalties is None
    s = _step(batch, 2, new=[NewRequest("b", [5], SamplingOptions(), [1], 0, 1)],
              finished=["a"])
    assert s.min_tokens_mask is None and s.penalties is None and s.min_p is None


def test_step_request_decoding_carries_the_new_fields():
    from services.common.pb.pagedserve.v1 import worker_pb2
    from services.worker.server import step_input_from_pb

    msg = worker_pb2.StepRequest(step_id=1, new_requests=[worker_pb2.NewRequest(
        request_id="a", prompt_token_ids=[1, 2], block_ids=[0], num_scheduled_tokens=2,
        sampling_params=worker_pb2.WorkerSamplingParams(
            temperature=0.5, min_p=0.25, presence_penalty=0.5, frequency_penalty=-1.0,
            min_tokens=3, stop_token_ids=[7], ignore_eos=True))])
    o = step_input_from_pb(msg).new_requests[0].sampling
    assert (o.min_p, o.repetition_penalty, o.presence_penalty, o.frequency_penalty,
            o.min_tokens, o.stop_token_ids, o.ignore_eos) == (0.25, 1.0, 0.5, -1.0, 3, (7,), True)
    assert o.uses_penalties and not SamplingOptions().uses_penalties
