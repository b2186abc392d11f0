"""The worker servicer over gRPC with a stand-in runner.

- A step whose new request carries sampling parameters the sampler cannot use fails that
  step's stream with INVALID_ARGUMENT naming them, before the runner sees it, and the worker
  keeps serving the next stream.
- The scheduler pushes its limits in GetWorkerInfo; a worker started for other ones refuses
  with FAILED_PRECONDITION naming the flag and both values, and the scheduler stops at once
  with that message.
"""

from __future__ import annotations

import argparse
import contextlib

import grpc
import pytest

from services.common.pb.pagedserve.v1 import worker_pb2, worker_pb2_grpc
from services.common.sampling_params import EngineSamplingParams
from services.common.step import StepInput, StepOutput
from services.scheduler import server as scheduler_server
from services.scheduler.worker_client import WorkerError, WorkerGroup
from services.worker.server import WorkerServicer, limits_refused
from tests.helpers import asynctest


class FakeRunner:
    """Samples token 7 for every new request; records the steps it ran."""

    def __init__(self) -> None:
        self.steps: list[StepInput] = []

    def execute_step(self, step: StepInput) -> StepOutput:
        self.steps.append(step)
        ids = [r.request_id for r in step.new_requests]
        return StepOutput(step.step_id, ids, [7] * len(ids))


def _step(step_id: int, sampling: EngineSamplingParams) -> worker_pb2.StepRequest:
    return worker_pb2.StepRequest(step_id=step_id, new_requests=[worker_pb2.NewRequest(
        request_id=f"r{step_id}", prompt_token_ids=[1, 2], block_ids=[0],
        num_scheduled_tokens=2, sampling_params=sampling.to_pb())])


@asynctest
async def test_a_malformed_new_request_fails_its_step_and_the_worker_keeps_serving():
    runner = FakeRunner()
    server = grpc.aio.server()
    info = worker_pb2.GetWorkerInfoResponse(vocab_size=32)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(runner, info), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            for bad, shown in ((EngineSamplingParams(temperature=float("nan")), "temperature=nan"),
                               (EngineSamplingParams(top_p=0.0), "top_p=0.0")):
                call = stub.Execute()
                await call.write(_step(1, bad))
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call.read()
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert e.value.details().startswith(
                    "step 1: new request 'r1': sampling parameters the sampler cannot use")
                assert shown in e.value.details()
            assert runner.steps == []  # refused before the model or the sampler ran
            call = stub.Execute()
            await call.write(_step(2, EngineSamplingParams(temperature=0.0)))
            result = await call.read()
            assert (result.step_id, list(result.sampled_token_ids)) == (2, [7])
            await call.done_writing()
    finally:
        await server.stop(None)


INFO = worker_pb2.GetWorkerInfoResponse(
    model="m", dtype="float32", num_kv_blocks=64, block_size=16, max_model_len=1024,
    vocab_size=32, max_num_seqs=64, max_num_batched_tokens=512)


@pytest.mark.parametrize("limits, message", [
    ({"block_size": 32}, "the scheduler has --block-size 32 but this worker was started with "
                         "--block-size 16; start both with the same value"),
    ({"block_size": 8}, "--block-size 8 but this worker was started with --block-size 16"),
    ({"max_model_len": 2048}, "the scheduler has --max-model-len 2048 but this worker's "
                              "max_model_len is 1024"),
    ({"max_num_seqs": 256}, "the scheduler has --max-num-seqs 256 but this worker was started "
                            "with --max-num-seqs 64"),
    ({"max_num_batched_tokens": 2048}, "the scheduler has --max-num-batched-tokens 2048 but "
                                       "this worker was started with --max-num-batched-tokens "
                                       "512"),
])
def test_a_limit_the_worker_was_not_started_for_is_refused_naming_both_values(limits, message):
    assert message in limits_refused(worker_pb2.GetWorkerInfoRequest(**limits), INFO)


def test_equal_or_smaller_limits_and_unset_ones_are_accepted():
    for limits in ({}, {"block_size": 16, "max_model_len": 1024, "max_num_seqs": 64,
                        "max_num_batched_tokens": 512},
                   {"block_size": 16, "max_model_len": 100, "max_num_seqs": 1,
                    "max_num_batched_tokens": 16}):
        assert limits_refused(worker_pb2.GetWorkerInfoRequest(**limits), INFO) is None


@contextlib.asynccontextmanager
async def _worker(info=INFO):
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(FakeRunner(), info),
                                                        server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def _scheduler_args(address: str, *argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    scheduler_server.add_args(p)
    return p.parse_args(["--workers", address, "--worker-connect-timeout", "30", *argv])


@asynctest
async def test_the_scheduler_stops_at_once_when_a_worker_refuses_its_limits():
    async with _worker() as address:
        for argv, message in (
                (["--block-size", "32"], "--block-size 32 but this worker was started with "
                                         "--block-size 16"),
                (["--max-model-len", "4096"], "--max-model-len 4096 but this worker's "
                                              "max_model_len is 1024"),
                (["--max-num-seqs", "256"], "--max-num-seqs 256 but this worker was started "
                                            "with --max-num-seqs 64")):
            with pytest.raises(WorkerError) as e:
                await scheduler_server.build_engine(_scheduler_args(address, *argv))
            assert str(e.value).startswith(f"worker {address} refused this scheduler: ")
            assert message in str(e.value)


@asynctest
async def test_a_worker_serves_a_scheduler_within_its_limits():
    async with _worker() as address:
        args = _scheduler_args(address, "--max-num-seqs", "8", "--max-num-batched-tokens",
                               "128", "--max-model-len", "512")
        engine, info = await scheduler_server.build_engine(args)
        try:
            assert (info.max_model_len, info.block_size, info.max_num_seqs,
                    info.max_num_batched_tokens) == (512, 16, 8, 128)
        finally:
            await engine.workers.close()
        engine, info = await scheduler_server.build_engine(_scheduler_args(
            address, "--max-num-seqs", "64", "--max-num-batched-tokens", "512"))
        try:
            assert info.max_model_len == 1024  # unset: the workers'
        finally:
            await engine.workers.close()
        group = WorkerGroup([address])  # no limits (e.g. an old scheduler): nothing checked
        try:
            assert (await group.connect(timeout=5))[0].block_size == 16
        finally:
            await group.close()


@asynctest
async def test_the_worker_reports_its_kv_cache_groups():
    """GetWorkerInfo carries the runner's groups in their order (the scheduler's block tables
    are concatenated in it); a one-group model reports its one full group."""
    from types import SimpleNamespace

    from services.worker.kv_cache_groups import kv_cache_groups
    from services.worker.server import worker_info

    def runner(windows):
        return SimpleNamespace(
            model_name="m", dtype_name="float32", num_kv_blocks=64, block_size=16,
            max_model_len=1024, vocab_size=32, eos_token_ids=[2], device="cpu",
            attention_backend_name="torch", max_num_seqs=64, max_num_batched_tokens=512,
            kv_cache_groups=kv_cache_groups(windows), kv_cache_dtype_name="int8",
            weights_quantization="w8a8")

    info = worker_info(runner([0 if i in (5, 11, 17) else 512 for i in range(18)]))
    assert [(g.sliding_window, list(g.layer_ids)) for g in info.kv_cache_groups] == [
        (512, [0, 1, 2]), (512, [3, 4, 6]), (0, [5, 11, 17]), (512, [7, 8, 9]),
        (512, [10, 12, 13]), (512, [14, 15, 16])]
    async with _worker(info) as address, grpc.aio.insecure_channel(address) as channel:
        got = await worker_pb2_grpc.WorkerServiceStub(channel).GetWorkerInfo(
            worker_pb2.GetWorkerInfoRequest())
        assert got.kv_cache_groups == info.kv_cache_groups and got.num_kv_blocks == 64
        assert got.kv_cache_dtype == "int8"  # (--kv-cache-dtype, for the scheduler's metrics)
        assert got.quantization == "w8a8"  # (how the weights are stored, likewise)
    info = worker_info(runner([0] * 3))
    assert [(g.sliding_window, list(g.layer_ids)) for g in info.kv_cache_groups] == [
        (0, [0, 1, 2])]
