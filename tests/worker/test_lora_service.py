"""LoRA at the worker's edges: its flags (through ``pagedserve serve`` and PAGEDSERVE_*), and
the servicer passing on the requests a step failed (an adapter that cannot be loaded) in its
StepResult while the stream and the worker go on (no fatal)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.cli.flags import forwarded_argv, serve_parser
from services.common.lora import LoRARequest
from services.common.pb.pagedserve.v1 import worker_pb2, worker_pb2_grpc
from services.common.sampling_params import EngineSamplingParams
from services.common.step import NewRequest, StepInput, StepOutput
from services.common.step_wire import step_to_pb
from services.worker.lora import LoRAConfig
from services.worker.server import WorkerServicer, lora_config
from tests.helpers import asynctest


def test_serve_forwards_the_lora_flags_to_the_worker(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_MAX_LORA_RANK", "32")
    ns = serve_parser().parse_args(["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "8"])
    argv = forwarded_argv("worker", ns)
    assert "--enable-lora" in argv
    for flag, value in (("--max-loras", "4"), ("--max-lora-rank", "32"),
                        ("--max-cpu-loras", "8")):
        assert argv[argv.index(flag) + 1] == value
    assert lora_config(ns) == LoRAConfig(4, 32, 8)
    # one value each for the services that share a flag: --enable-lora and --max-lora-rank
    # the router too (its registry), --max-loras the scheduler too (its admission)
    router, scheduler = forwarded_argv("router", ns), forwarded_argv("scheduler", ns)
    assert "--enable-lora" in router and router[router.index("--max-lora-rank") + 1] == "32"
    assert scheduler[scheduler.index("--max-loras") + 1] == "4"
    assert lora_config(serve_parser().parse_args([])) is None  # (off without --enable-lora)
    monkeypatch.delenv("PAGEDSERVE_MAX_LORA_RANK")
    defaults = lora_config(serve_parser().parse_args(["--enable-lora"]))  # vLLM's defaults
    assert defaults == LoRAConfig(1, 16, None) and defaults.cpu_capacity == 1


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-loras", "0"], "argument --max-loras: must be >= 1, got 0"),
    (["--max-lora-rank", "x"], "argument --max-lora-rank: not an integer: 'x'"),
])
def test_bad_lora_flags_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        serve_parser().parse_args(argv)
    assert message in capsys.readouterr().err


def test_fewer_cpu_loras_than_slots_are_refused_naming_both_flags():
    ns = serve_parser().parse_args(["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"])
    with pytest.raises(ValueError, match="--max-cpu-loras 2 must be >= --max-loras 4"):
        lora_config(ns)


class FailingRunner:
    """Leaves out every new request of step 1, as a runner does whose adapter cannot be
    loaded (``LoRAManager.execute``); answers the others."""

    def execute_step(self, step: StepInput) -> StepOutput:
        out = StepOutput(step.step_id, [], [])
        if step.step_id == 1:
            out.failed_request_ids = [r.request_id for r in step.new_requests]
            out.failed_messages = [f"LoRA adapter {r.lora.name!r} ({r.lora.path}): cannot read "
                                   "adapter_config.json" for r in step.new_requests]
        return out


@asynctest
async def test_a_request_whose_adapter_fails_to_load_is_reported_and_the_stream_goes_on():
    fatal = asyncio.Event()
    server = grpc.aio.server()
    info = worker_pb2.GetWorkerInfoResponse(vocab_size=32, max_loras=1)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(
        WorkerServicer(FailingRunner(), info, fatal), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    step = StepInput(1, [NewRequest("r1", [1, 2], EngineSamplingParams(), [0], 0, 2,
                                    LoRARequest(1, "sql", "/x"))], [], [])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = worker_pb2_grpc.WorkerServiceStub(channel).Execute()
            await call.write(step_to_pb(step))
            result = await call.read()
            assert list(result.failed_request_ids) == ["r1"]
            assert list(result.failed_messages) == [
                "LoRA adapter 'sql' (/x): cannot read adapter_config.json"]
            assert not fatal.is_set()  # (a bad adapter is not a broken rank)
            await call.write(worker_pb2.StepRequest(step_id=2))
            result = await call.read()
            assert result.step_id == 2 and not result.failed_request_ids
            await call.done_writing()
    finally:
        await server.stop(None)
