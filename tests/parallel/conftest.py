"""Fixtures of the parallel-worker tests: a stack whose worker is a group of rank processes.

``ParallelStack`` runs the rank supervisor (``services/cli/ranks.py``: one process per
rank, as ``pagedserve worker --tensor-parallel-size N --pipeline-parallel-size M`` does), the
scheduler and the router in one background event loop; ``reference_greedy`` computes the
single-rank greedy tokens with a ``ModelRunner`` in this process.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from services.cli.ranks import RankSupervisor
from services.common.ports import free_port_range
from services.router import server as router_server
from services.scheduler import server as scheduler_server
from services.worker import server as worker_server
from tests.helpers import make_servable_tiny_llama
from tests.stack_harness import _args, _BackgroundStack

WORKER_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--distributed-timeout", "20"]


def _no_metrics(module) -> list[str]:
    """``--metrics-port -1`` where the service has that flag (no fixed port to collide on)."""
    import argparse
    p = argparse.ArgumentParser()
    module.add_args(p)
    return ["--metrics-port", "-1"] if any(
        "--metrics-port" in a.option_strings for a in p._actions) else []




class ParallelStack(_BackgroundStack):
    """Rank processes + scheduler + router; ``address`` is the router's gRPC address,
    ``scheduler_address`` the scheduler's, ``supervisor.procs[r]`` rank r's process."""

    def __init__(self, model: str | None, tp: int = 1, pp: int = 1,
                 worker_argv: list[str] = (), scheduler_argv: list[str] = (),
                 router_argv: list[str] = ()):
        model_flag = ["--model", model] if model else []
        world = tp * pp
        self.worker_args = _args(worker_server, [
            "--port", str(free_port_range(world)), "--tensor-parallel-size", str(tp),
            "--pipeline-parallel-size", str(pp), *model_flag, *WORKER_FLAGS,
            *_no_metrics(worker_server), *worker_argv])
        self.supervisor = RankSupervisor(self.worker_args, base_delay=0.1)
        self.scheduler_args = _args(scheduler_server, [
            "--port", "0", "--workers", ",".join(reversed(self.supervisor.addresses)),
            "--worker-connect-timeout", "120", *_no_metrics(scheduler_server), *scheduler_argv])
        self.router_args = _args(router_server, ["--port", "0", "--http-port", "-1",
                                                 *model_flag, *_no_metrics(router_server),
                                                 *router_argv])
        super().__init__()
        self.scheduler_address = ""

    async def _start(self):
        self._stop = asyncio.Event()
        ready = asyncio.Event()
        task = asyncio.ensure_future(self.supervisor.run(ready, self._stop))
        waiter = asyncio.ensure_future(ready.wait())
        done, _ = await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if task in done:
            task.result()
            raise RuntimeError("worker ranks stopped during start-up")
        self._tasks.append(task)
        self._tasks.append(await self._serve(scheduler_server, self.scheduler_args, self._stop))
        self.scheduler_address = f"127.0.0.1:{self.scheduler_args.port}"
        self.router_args.scheduler = self.scheduler_address
        self._tasks.append(await self._serve(router_server, self.router_args, self._stop))
        self._router_started(self.router_args)

    def stop(self) -> None:
        try:
            self._stop_services()
        finally:
            self.supervisor.stop()  # in any case: no rank process outlives the test
            self._close_loop()


def reference_greedy(model: str | None, prompts: list[list[int]],
                     max_tokens: int) -> list[list[int]]:
    """Greedy tokens of one single-rank float32 ``ModelRunner``, all prompts in one batch."""
    from services.common.sampling_params import EngineSamplingParams
    from services.common.step import CachedRequest, NewRequest, StepInput
    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner

    runner = ModelRunner(WorkerConfig(model=model, dtype="float32", device="cpu",
                                      kv_cache_memory=16 << 20))
    bs, per_request = runner.block_size, 8
    greedy = EngineSamplingParams(temperature=0.0)
    new = [NewRequest(str(i), p, greedy, list(range(i * per_request, (i + 1) * per_request)), 0,
                      len(p)) for i, p in enumerate(prompts)]
    assert all(len(p) + max_tokens <= per_request * bs for p in prompts)
    out = runner.execute_step(StepInput(1, new, [], []))
    tokens = {rid: [t] for rid, t in zip(out.request_ids, out.sampled_token_ids)}
    for step in range(2, max_tokens + 1):
        cached = [CachedRequest(str(i), [], [], False,  # (the runner kept its samples)
                                len(p) + len(tokens[str(i)]) - 1, 1) for i, p in enumerate(prompts)]
        out = runner.execute_step(StepInput(step, [], cached, []))
        for rid, t in zip(out.request_ids, out.sampled_token_ids):
            tokens[rid].append(t)
    return [tokens[str(i)] for i in range(len(prompts))]


def stack_greedy(stack: ParallelStack, prompts: list[list[int]],
                 max_tokens: int) -> list[list[int]]:
    """Greedy tokens through the router, all prompts at once (so they share steps)."""
    from concurrent.futures import ThreadPoolExecutor

    from pagedserve_client import Client

    def one(p):
        with Client(stack.address) as c:
            return c.generate(prompt_token_ids=p, temperature=0, max_tokens=max_tokens,
                              ignore_eos=True).token_ids
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


PROMPTS = [[5, 6, 7, 8, 9], [100 + 3 * i for i in range(21)], [42] * 3]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 3-layer tiny Llama, 4 heads, 2 KV heads, with SmolLM2's tokenizer files."""
    return make_servable_tiny_llama(Path(tmp_path_factory.mktemp("tiny-tp")))


@pytest.fixture(scope="session")
def tp2_stack(tiny_model):
    """TP=2 on the tiny model, shared: the rank-failure test leaves it serving again."""
    stack = ParallelStack(tiny_model, tp=2).start()
    yield stack
    stack.stop()


def wait_for(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` every 0.1 s until true; fails the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def stream_in_background(address: str) -> tuple[threading.Thread, list]:
    """A stream that only a failure ends (``ignore_eos``, no max_tokens) on a thread, already
    streaming when this returns; the list gets ``(status code, time.monotonic())`` of the
    ``grpc.RpcError`` that ends it."""
    import grpc

    from pagedserve_client import Client

    errors: list = []
    streaming = threading.Event()

    def long_stream():
        try:
            with Client(address) as c:
                for _ in c.stream(prompt_token_ids=[5, 6, 7], ignore_eos=True):
                    streaming.set()
        except grpc.RpcError as e:
            errors.append((e.code(), time.monotonic()))

    t = threading.Thread(target=long_stream)
    t.start()
    assert streaming.wait(30), "no token streamed"
    return t, errors
