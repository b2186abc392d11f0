"""Speculative decoding on the worker's wire (services/common/step_wire.py, the servicer): the
CachedRequests draft columns, StepRequest.num_speculative_tokens, the StepResult's per-request counts and
proposals (only when needed), --speculative-config and the scheduler check."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import grpc
import pytest

from services.common.pb.pagedserve.v1 import worker_pb2, worker_pb2_grpc
from services.common.spec_decode_config import SpeculativeConfig
from services.common.step import CachedRequest, StepOutput
from services.common.step_wire import cached_requests_from_pb, step_output_to_pb
from services.worker import server
from services.worker.server import WorkerServicer, limits_refused, step_input_from_pb
from tests.helpers import asynctest

NGRAM = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')


def _cached(**columns) -> worker_pb2.CachedRequests:
    base = {"request_ids": ["a", "b", "c"], "num_new_block_ids": [0, 1, 0],
            "new_block_ids": [9], "resumed_from_preemption": [False] * 3,
            "num_computed_tokens": [10, 20, 30], "num_scheduled_tokens": [3, 1, 2]}
    return worker_pb2.CachedRequests(**{**base, **columns})


def test_draft_columns_become_each_requests_spec_token_ids():
    got = cached_requests_from_pb(_cached(num_spec_token_ids=[2, 0, 1],
                                          spec_token_ids=[5, 6, 7]))
    assert [c.spec_token_ids for c in got] == [[5, 6], [], [7]]
    assert got[1] == CachedRequest("b", [], [9], False, 20, 1, -1, [])
    assert [c.spec_token_ids for c in cached_requests_from_pb(_cached())] == [[], [], []]


@pytest.mark.parametrize("columns", [
    {"num_spec_token_ids": [2, 0], "spec_token_ids": [5, 6]},  # a column short
    {"num_spec_token_ids": [2, 0, 1], "spec_token_ids": [5, 6]},  # counts over the tokens
    {"spec_token_ids": [5]},  # tokens without counts
    {"num_spec_token_ids": [-1, 1, 0], "spec_token_ids": []},
])
def test_draft_columns_that_disagree_are_refused(columns):
    with pytest.raises(ValueError, match="malformed CachedRequests"):
        cached_requests_from_pb(_cached(**columns))


def test_the_step_carries_num_speculative_tokens():
    msg = worker_pb2.StepRequest(step_id=4, cached_requests=_cached(), num_speculative_tokens=3)
    step = step_input_from_pb(msg, vocab_size=32)
    assert step.num_speculative_tokens == 3
    assert step_input_from_pb(worker_pb2.StepRequest(step_id=5), 32).num_speculative_tokens == 0


def test_the_result_has_counts_and_proposals_only_when_needed():
    plain = step_output_to_pb(StepOutput(1, ["a", "b"], [4, 5], num_sampled_token_ids=[1, 1],
                                         draft_token_ids=[[], []]))
    assert list(plain.num_sampled_token_ids) == list(plain.num_draft_token_ids) == []
    assert list(plain.draft_token_ids) == []
    spec = step_output_to_pb(StepOutput(2, ["a", "b"], [4, 6, 7, 5], num_sampled_token_ids=[3, 1],
                                        draft_token_ids=[[8, 9], []]))
    assert list(spec.sampled_token_ids) == [4, 6, 7, 5]
    assert list(spec.num_sampled_token_ids) == [3, 1]
    assert (list(spec.num_draft_token_ids), list(spec.draft_token_ids)) == ([2, 0], [8, 9])


INFO = worker_pb2.GetWorkerInfoResponse(block_size=16, max_model_len=1024, max_num_seqs=8,
                                        max_num_batched_tokens=64)


def test_a_scheduler_with_another_speculative_config_is_refused():
    theirs = worker_pb2.GetWorkerInfoRequest(block_size=16, speculative_config=NGRAM.to_json())
    refused = limits_refused(theirs, INFO, "")
    assert refused is not None and "--speculative-config" in refused and "(none)" in refused
    assert limits_refused(theirs, INFO, NGRAM.to_json()) is None
    other = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}')
    assert limits_refused(theirs, INFO, other.to_json()) is not None
    none = worker_pb2.GetWorkerInfoRequest(block_size=16)
    assert "(none)" in limits_refused(none, INFO, NGRAM.to_json())
    assert limits_refused(worker_pb2.GetWorkerInfoRequest(), INFO, NGRAM.to_json()) is None


@asynctest
async def test_the_servicer_checks_the_runners_config():
    runner = SimpleNamespace(speculative=NGRAM)
    grpc_server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(runner, INFO),
                                                        grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(block_size=16))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "--speculative-config" in e.value.details()
            got = await stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(
                block_size=16, speculative_config=NGRAM.to_json()))
            assert got.block_size == 16
    finally:
        await grpc_server.stop(None)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    server.add_args(p)
    return p.parse_args(list(argv))


def test_the_flag_is_checked_when_parsed_and_kept_as_given(capsys):
    text = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert _args("--speculative-config", text).speculative_config == text
    assert _args().speculative_config is None
    with pytest.raises(SystemExit):
        _args("--speculative-config", '{"num_speculative_tokens": 99}')
    assert "num_speculative_tokens must be an integer 1..16" in capsys.readouterr().err


def test_speculation_with_pipeline_stages_is_refused_before_joining():
    args = _args("--speculative-config", '{"num_speculative_tokens": 2}',
                 "--pipeline-parallel-size", "2", "--rank", "0")
    with pytest.raises(ValueError, match="--speculative-config does not work with "
                                         "--pipeline-parallel-size 2"):
        server.build_runner(args)
