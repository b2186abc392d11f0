"""LoRA at the worker's edges: its flags (through ``pagedserve serve`` and PAGEDSERVE_*), and
the servicer answering a step whose adapter cannot be loaded with INVALID_ARGUMENT while the
worker keeps serving (no fatal)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.cli.flags import forwarded_argv, serve_parser
from services.common.pb.pagedserve.v1 import worker_pb2, worker_pb2_grpc
from services.common.step import StepInput, StepOutput
from services.worker.lora import LoRAConfig, LoRALoadError
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


class RefusingRunner:
    """Fails step 1 as a runner does whose adapter cannot be loaded; answers the others."""

    def execute_step(self, step: StepInput) -> StepOutput:
        if step.step_id == 1:
            raise LoRALoadError("LoRA adapter 'sql' (/x): cannot read adapter_config.json")
        return StepOutput(step.step_id, [], [])


@asynctest
async def test_an_adapter_that_fails_to_load_fails_its_step_not_the_worker():
    fatal = asyncio.Event()
    server = grpc.aio.server()
    info = worker_pb2.GetWorkerInfoResponse(vocab_size=32, max_loras=1)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(
        WorkerServicer(RefusingRunner(), info, fatal), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            call = stub.Execute()
            await call.write(worker_pb2.StepRequest(step_id=1))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details() == ("step 1: LoRA adapter 'sql' (/x): cannot read "
                                         "adapter_config.json")
            assert not fatal.is_set()  # (a bad adapter is not a broken rank)
            call = stub.Execute()
            await call.write(worker_pb2.StepRequest(step_id=2))
            assert (await call.read()).step_id == 2
            await call.done_writing()
    finally:
        await server.stop(None)
