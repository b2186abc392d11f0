"""The worker servicer over gRPC with a stand-in runner: a step whose new request carries
sampling parameters the sampler cannot use fails that step's stream with INVALID_ARGUMENT
naming them, before the runner sees it, and the worker keeps serving the next stream."""

from __future__ import annotations

import grpc
import pytest

from services.common.pb.pagedserve.v1 import worker_pb2, worker_pb2_grpc
from services.common.sampling_params import EngineSamplingParams
from services.worker.server import WorkerServicer
from services.worker.step_input import StepInput, StepOutput
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
