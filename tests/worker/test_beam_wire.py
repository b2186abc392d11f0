"""The worker's decoding of issue 20's columns: CachedRequests.first_new_block, the StepRequest
copy columns and a beam's sampling parameters; malformed ones raise ValueError (the servicer
answers INVALID_ARGUMENT before the runner sees the step)."""

from __future__ import annotations

import grpc
import pytest

from services.common.pb.pagedserve.v1 import worker_pb2, worker_pb2_grpc
from services.common.sampling_params import EngineSamplingParams
from services.common.step_wire import cached_requests_from_pb
from services.worker.server import WorkerServicer, step_input_from_pb
from tests.helpers import asynctest
from tests.worker.test_servicer import FakeRunner

V = 32


def _cached(**columns) -> worker_pb2.CachedRequests:
    """Two cached requests with a decode token each, plus ``columns``."""
    return worker_pb2.CachedRequests(**{
        "request_ids": ["a", "b"], "num_new_token_ids": [1, 1], "new_token_ids": [5, 6],
        "num_new_block_ids": [0, 1], "new_block_ids": [9], "resumed_from_preemption": [False] * 2,
        "num_computed_tokens": [20, 20], "num_scheduled_tokens": [1, 1], **columns})


def test_an_empty_first_new_block_column_appends_and_a_set_one_is_read_per_request():
    assert [c.first_new_block for c in cached_requests_from_pb(_cached())] == [-1, -1]
    got = cached_requests_from_pb(_cached(first_new_block=[-1, 1]))
    assert [(c.request_id, c.new_token_ids, c.new_block_ids, c.first_new_block)
            for c in got] == [("a", [5], [], -1), ("b", [6], [9], 1)]


def test_a_first_new_block_column_of_another_length_is_malformed():
    with pytest.raises(ValueError, match="malformed CachedRequests"):
        cached_requests_from_pb(_cached(first_new_block=[1]))


def _copies(src: list[int], dst: list[int]) -> worker_pb2.StepRequest:
    return worker_pb2.StepRequest(step_id=3, copy_src_block_ids=src, copy_dst_block_ids=dst)


def test_copy_columns_become_pairs_in_order():
    step = step_input_from_pb(_copies([4, 4, 0], [7, 8, 9]), V, num_kv_blocks=10)
    assert step.blocks_to_copy == [(4, 7), (4, 8), (0, 9)]
    assert step_input_from_pb(worker_pb2.StepRequest(step_id=4), V, 10).blocks_to_copy == []


@pytest.mark.parametrize("src, dst, message", [
    ([1, 2], [3], "malformed StepRequest: 2 copy_src_block_ids but 1 copy_dst_block_ids"),
    ([1], [10], r"block ids in \[0, 10\), got \[1, 10\]"),
    ([-1], [3], r"block ids in \[0, 10\), got \[-1, 3\]"),
    ([1, 2], [3, 3], "distinct blocks"),  # one destination written twice
    ([1, 3], [3, 4], "distinct blocks"),  # a destination another copy reads
])
def test_malformed_copies_are_refused(src, dst, message):
    with pytest.raises(ValueError, match=message):
        step_input_from_pb(_copies(src, dst), V, num_kv_blocks=10)


def test_copies_are_range_checked_only_where_the_block_count_is_given():
    assert step_input_from_pb(_copies([1], [99]), V).blocks_to_copy == [(1, 99)]


def _new(sampling: EngineSamplingParams) -> worker_pb2.StepRequest:
    return worker_pb2.StepRequest(step_id=1, new_requests=[worker_pb2.NewRequest(
        request_id="beam", prompt_token_ids=[1, 2], block_ids=[0], num_scheduled_tokens=2,
        sampling_params=sampling.to_pb())])


def test_a_beam_may_ask_for_up_to_the_whole_vocabulary_of_candidates():
    beam = EngineSamplingParams(temperature=0.0, beam_width=3, logprobs=V)  # past the 20
    assert step_input_from_pb(_new(beam), V).new_requests[0].sampling_params == beam
    for bad in (EngineSamplingParams(beam_width=3, logprobs=V + 1),
                EngineSamplingParams(beam_width=-1)):
        with pytest.raises(ValueError, match="sampling parameters the sampler cannot use"):
            step_input_from_pb(_new(bad), V)


@asynctest
async def test_the_servicer_checks_copies_against_its_block_count():
    runner = FakeRunner()
    server = grpc.aio.server()
    info = worker_pb2.GetWorkerInfoResponse(vocab_size=V, num_kv_blocks=8)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(runner, info), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            call = stub.Execute()
            await call.write(_copies([3], [8]))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "step 3: block copies must name block ids in [0, 8)" in e.value.details()
            call = stub.Execute()
            await call.write(_copies([3], [7]))
            assert (await call.read()).step_id == 3
            await call.done_writing()
        assert [s.blocks_to_copy for s in runner.steps] == [[(3, 7)]]
    finally:
        await server.stop(None)
