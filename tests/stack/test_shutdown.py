"""Graceful shutdown in process: stopping the stack drains the streams in flight, refuses new
ones with UNAVAILABLE, and ends what outlives --shutdown-timeout with UNAVAILABLE.
(tests/e2e/test_shutdown.py checks the same through SIGTERM and ``pagedserve serve``.)"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagedserve_client import Client

from services.common.shutdown import InFlight, drain
from tests.stack_harness import InProcessStack

WORKER_ARGV = ["--dtype", "float32", "--kv-cache-memory", "64MiB"]


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                    timeout=2).status


def _stream(address: str, max_tokens: int, out: dict, started: threading.Event) -> None:
    tokens, finish = [], None
    try:
        with Client(address, max_retries=0) as c:
            for d in c.stream(prompt_token_ids=[5, 6, 7], max_tokens=max_tokens,
                              ignore_eos=True):
                tokens += d.token_ids
                finish = d.finish_reason or finish
                started.set()
    except grpc.RpcError as e:
        out["error"] = e
    out.update(tokens=tokens, finish=finish)
    started.set()


def _start_streams(stack, n: int, max_tokens: int):
    results = [{} for _ in range(n)]
    started = [threading.Event() for _ in range(n)]
    threads = [threading.Thread(target=_stream, args=(stack.address, max_tokens, r, s))
               for r, s in zip(results, started)]
    for t in threads:
        t.start()
    for s in started:
        assert s.wait(30)
    return results, threads


def test_stop_drains_streams_in_flight_and_refuses_new_ones(tiny_model_dir):
    stack = InProcessStack(tiny_model_dir, worker_argv=WORKER_ARGV,
                           router_argv=["--shutdown-timeout", "60"]).start()
    stopper = threading.Thread(target=stack.stop)
    try:
        results, threads = _start_streams(stack, 2, max_tokens=300)
        stopper.start()
        deadline = time.monotonic() + 2
        while _health(stack.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "router still SERVING 2 s after stop"
            time.sleep(0.02)
        with Client(stack.address, max_retries=0) as c, pytest.raises(grpc.RpcError) as e:
            c.generate(prompt_token_ids=[5, 6], max_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in e.value.details()
        assert all(t.is_alive() for t in threads), "streams ended before the checks"
        for t, r in zip(threads, results):
            t.join(60)
            assert "error" not in r, r.get("error")
            assert (len(r["tokens"]), r["finish"]) == (300, "length")
        stopper.join(60)
        assert not stopper.is_alive()
    finally:
        if stopper.ident is None:  # failed before the stop began: stop here
            stack.stop()


def test_streams_outliving_the_shutdown_timeout_end_with_unavailable(tiny_model_dir):
    stack = InProcessStack(tiny_model_dir, worker_argv=WORKER_ARGV,
                           scheduler_argv=["--shutdown-timeout", "0.3"],
                           router_argv=["--shutdown-timeout", "0.3"]).start()
    results, threads = _start_streams(stack, 1, max_tokens=100_000)
    t0 = time.monotonic()
    stack.stop()  # returns once every service's serve() has returned
    threads[0].join(10)
    error = results[0].get("error")
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in error.details()
    assert 0 < len(results[0]["tokens"]) < 100_000 and results[0]["finish"] is None
    assert time.monotonic() - t0 < 10


def test_drain_waits_for_the_work_in_flight_then_gives_up_at_the_timeout():
    import asyncio

    class Health:
        def __init__(self):
            self.statuses = {}

        async def set(self, name, status):
            self.statuses[name] = status

    async def scenario():
        health, inflight, ended = Health(), InFlight(), []

        async def work(seconds):
            with inflight.track():
                await asyncio.sleep(seconds)

        task = asyncio.ensure_future(work(0.1))
        await asyncio.sleep(0)
        assert inflight.count == 1
        assert await drain("t", health, ["svc"], 5.0, inflight.begin_drain, inflight.wait_idle)
        assert task.done() and inflight.draining
        assert set(health.statuses.values()) == {health_pb2.HealthCheckResponse.NOT_SERVING}
        assert set(health.statuses) == {"", "svc"}
        slow = asyncio.ensure_future(work(10))
        await asyncio.sleep(0)
        t0 = time.monotonic()
        assert not await drain("t", health, [], 0.1, inflight.begin_drain, inflight.wait_idle,
                               on_timeout=lambda: ended.append(True))
        assert ended == [True] and time.monotonic() - t0 < 1
        slow.cancel()

    asyncio.run(scenario())
